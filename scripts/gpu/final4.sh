#!/usr/bin/env bash
# GPU run C (session 2): model x batch sweep, sync vs async (graphs); GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 330 python3 scripts/sweep.py --device cuda --models qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape \
  --batches 1,4,16,32,64 --prompt-len 256 --max-new-tokens 128 --out $OUT 2>&1 | grep -v -i warn > $OUT/sweep.log
tail -16 $OUT/sweep.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_device.py \
  -k "bf16 or cuda" > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
