#!/usr/bin/env bash
# GPU run: device-layer, graph and async tests on CUDA; then sync vs async, eager vs CUDA graphs, 8B shape.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KINETO_LOG_LEVEL=5
python3 -m pytest -q -p no:cacheprovider -o addopts="" -s tests/test_device.py tests/test_gpu.py tests/test_parity.py \
  tests/test_races.py tests/test_async.py 2>&1 | tee $OUT/pytest.log | tail -30
for g in on off; do
  python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
    --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
    --cuda-graphs $g --out $OUT/b8_$g 2>&1 | tee $OUT/bench_8b_graphs_$g.log
done
