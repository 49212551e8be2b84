#!/usr/bin/env bash
# GPU run A (session 2): 8B headline, sync/async with and without torch.compile, beside transformers'
# generate_batch in its four modes (each after an untimed warm-up run) and the weight floor; GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async,sync+compile,async+compile \
  --num-prompts 32 --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup \
  --no-progress --hf --hf-all --floor --out $OUT/b8 2>&1 | grep -v -i warn > $OUT/bench.log
tail -14 $OUT/bench.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_device.py \
  -k "bf16 or cuda" > $OUT/pytest.log 2>&1; tail -4 $OUT/pytest.log
