#!/usr/bin/env bash
# Prepared for the next GPU session (not yet run): time the Triton decode kernel that reads the paged
# cache in place (triton_decode.py) against SDPA over a gathered copy, then the headline workload
# with it; its GPU correctness tests. Expected (BENCHMARKS.md): about -1 ms per 8B step at 512 keys
# (the gather's cost), if the kernel streams K/V at the gather's ~4 TB/s.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 240 python3 scripts/gpu/step_ab.py 2>&1 | grep -v -i warn > $OUT/ab.log; grep "ctx" $OUT/step_ab.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_paged_kernel.py tests/test_gpu.py \
  > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
timeout 200 python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
  --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress --floor \
  --decode-attention triton --out $OUT/b8_triton 2>&1 | grep -v -i warn > $OUT/bench_triton.log; tail -8 $OUT/bench_triton.log
