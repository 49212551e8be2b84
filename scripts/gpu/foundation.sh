#!/usr/bin/env bash
# GPU run for the foundation issue: tests (cuda marker included) + the sync loop on an 8B-shaped model.
# Run through the device tool from the repo root; logs land in $OUT.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/test_device.py 2>&1 | tee $OUT/pytest.log | tail -15
for n in 256 512; do
  python3 -m minibatch bench --model llama3-8b-shape --device cuda --num-prompts 32 --prompt-len 256 \
    --max-new-tokens $n --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress --out $OUT/sync_8b_$n \
    2>&1 | tee $OUT/bench_8b_$n.log
done
