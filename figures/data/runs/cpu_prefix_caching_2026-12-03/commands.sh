set -u
cd "$(git rev-parse --show-toplevel)"
for pc in on off on off; do
  python -m minibatch serve --model tiny --device cpu --mode async --port 8477 --max-batch-size 8 --max-batch-tokens 256 --prefix-caching $pc > "${OUT:?set OUT to a folder}"/server-$pc.log 2>&1 &
  pid=$!
  for i in $(seq 60); do curl -sf http://127.0.0.1:8477/health > /dev/null && break; sleep 1; done
  python -m minibatch bench-serve --url http://127.0.0.1:8477 --rates 4,inf --num-prompts 32 --prompt-len 32 --shared-prefix-len 384 --max-tokens 16 --token-prompts --out "$OUT" --label prefix-$pc --no-progress 2>&1 | grep -E "^rate"
  curl -s http://127.0.0.1:8477/metrics | grep -E "^minibatch_prefix_cache"
  kill -TERM $pid; wait $pid
done
