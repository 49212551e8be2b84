#!/usr/bin/env bash
# GPU run B (session 2): the article's experiment at 1024 new tokens; the model x batch sweep; does our
# device-busy fraction agree with torch.profiler's kernel timeline.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
  --prompt-len 256 --max-new-tokens 1024 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
  --floor --out $OUT/b8_1024 2>&1 | grep -v -i warn > $OUT/bench_1024.log
tail -8 $OUT/bench_1024.log
rm -f $OUT/b8_1024/timeline_sync.json  # at most 8 files come back; the async timeline and bench.json do
timeout 300 python3 scripts/sweep.py --device cuda --models qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape \
  --batches 1,4,16,32,64 --prompt-len 256 --max-new-tokens 128 --out $OUT 2>&1 | grep -v -i warn > $OUT/sweep.log
tail -16 $OUT/sweep.log
KINETO_LOG_LEVEL=5 timeout 150 python3 scripts/gpu/profile_async.py > $OUT/profile_async.log 2>&1
head -3 $OUT/profile_async.txt
