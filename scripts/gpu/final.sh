#!/usr/bin/env bash
# GPU run: 8B sync vs async (graphs) beside transformers' generate_batch and the weight floor; GPU tests.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
  --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
  --hf --hf-all --floor --out $OUT/b8 2>&1 | grep -v Warning | tee $OUT/bench.log
timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_device.py \
  -k "bf16 or cuda" 2>&1 | tee $OUT/pytest.log | tail -5
