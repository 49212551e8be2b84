#!/usr/bin/env bash
# GPU runs for the full floor, the split Triton decode kernel and the shape x batch x context sweep.
# One part per call (each well under 10 minutes), e.g.:
#     bash scripts/gpu/floor_and_kernel.sh kernel    # ~1-2 min: decode_attention_ab + the kernel's GPU tests
#     bash scripts/gpu/floor_and_kernel.sh bench     # ~3 min: 8B batch 32, 256/256, sync+async, sdpa vs triton, --floor
#     bash scripts/gpu/floor_and_kernel.sh sweep     # ~5-8 min: scripts/sweep.py, full grid, 64 new tokens
#     bash scripts/gpu/floor_and_kernel.sh host      # < 1 min: host cost per step on this machine's CPU
# Everything lands in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
part=${1:-kernel}
case $part in
  kernel)
    timeout 300 python3 scripts/gpu/decode_attention_ab.py $OUT/attn 2>&1 | grep -v -i warn | tee $OUT/attn.log
    timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_paged_kernel.py tests/test_gpu.py \
      > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log ;;
  bench)
    for attn in sdpa triton; do
      timeout 280 python3 -m minibatch bench --model llama3-8b-shape --device cuda --modes sync,async --num-prompts 32 \
        --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress \
        --floor --decode-attention $attn --out $OUT/b8_$attn 2>&1 | grep -v -i warn > $OUT/bench_$attn.log
      tail -12 $OUT/bench_$attn.log
    done ;;
  sweep)
    timeout 590 python3 scripts/sweep.py --device cuda --out $OUT/sweep 2>&1 | grep -v -i warn | tee $OUT/sweep.log ;;
  host)
    timeout 300 python3 scripts/host_cost.py $OUT/host --rows 32,128 --context 1024 | tee $OUT/host.log ;;
  *) echo "unknown part $part: kernel, bench, sweep or host"; exit 2 ;;
esac
