#!/usr/bin/env bash
# GPU run: graph/pool tests, then the 8B sync vs async bench with CUDA graphs (timelines kept).
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -s tests/test_gpu.py 2>&1 | tee $OUT/pytest.log | tail -8
python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
  --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
  --cuda-graphs on --out $OUT/b8 2>&1 | tee $OUT/bench.log
