#!/usr/bin/env bash
# GPU run C (session 2): compiled modes again after the dynamic=True fix (sync and async must agree);
# GPU tests; profiler agreement with gap bridging; model x batch sweep in whatever time is left.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync+compile,async+compile \
  --num-prompts 32 --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup \
  --no-progress --floor --out $OUT/bc 2>&1 | grep -v -i warn > $OUT/bench_compile.log
tail -6 $OUT/bench_compile.log; rm -rf $OUT/bc
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_device.py \
  -k "bf16 or cuda" > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
KINETO_LOG_LEVEL=5 timeout 100 python3 scripts/gpu/profile_async.py > $OUT/profile_async.log 2>&1
head -4 $OUT/profile_async.txt
timeout $((530 - SECONDS)) python3 scripts/sweep.py --device cuda --models qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape \
  --batches 1,4,16,32,64 --prompt-len 256 --max-new-tokens 96 --out $OUT 2>&1 | grep -v -i warn > $OUT/sweep.log
tail -16 $OUT/sweep.log
