#!/usr/bin/env bash
# GPU run B (session 2): 8B headline again after the decode-bucket/dynamic-compile change (no transformers:
# run A has it); the article's experiment at 1024 new tokens; does our device-busy fraction agree with
# torch.profiler's kernel timeline.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async,sync+compile,async+compile \
  --num-prompts 32 --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup \
  --no-progress --floor --out $OUT/b8 2>&1 | grep -v -i warn > $OUT/bench.log
tail -10 $OUT/bench.log; rm -f $OUT/b8/timeline_*compile.json
timeout 200 python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
  --prompt-len 256 --max-new-tokens 1024 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
  --floor --out $OUT/b1024 2>&1 | grep -v -i warn > $OUT/bench_1024.log
tail -7 $OUT/bench_1024.log; rm -f $OUT/b1024/timeline_sync.json
KINETO_LOG_LEVEL=5 timeout 120 python3 scripts/gpu/profile_async.py > $OUT/profile_async.log 2>&1
head -3 $OUT/profile_async.txt
