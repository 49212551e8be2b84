#!/usr/bin/env bash
# GPU run: sync vs async with CUDA graphs (8B shape), GPU tests, then the same bench eager.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KINETO_LOG_LEVEL=5
bench() {  # $1 = graphs on/off
  python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
    --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
    --cuda-graphs $1 --out $OUT/b8_$1 2>&1 | tee $OUT/bench_8b_graphs_$1.log
}
bench on
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -s tests/test_gpu.py tests/test_device.py \
  tests/test_parity.py -k "cuda or gpu" 2>&1 | tee $OUT/pytest.log | tail -25
bench off
