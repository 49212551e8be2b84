#!/usr/bin/env bash
# Serving on the GPU, into the folder given as the first argument:
#
#   bash scripts/gpu/serve_bench.sh OUTDIR
#
# 1. the 8B shape with random weights saved as a folder in bf16, with a word-level tokenizer
#    (save_random_folder.py: one token per bench-serve word, so every server sees the same prompt lengths);
# 2. our server from that folder, sync, async, async --compile (cold: an empty TORCHINDUCTOR_CACHE_DIR),
#    async --compile again (label async+compile-cached: the same cache); the time from `serve` to a ready
#    /health of each;
# 3. bench-serve against each (sync, async: 4 rates; compile: rate inf), 64 prompts of 256 tokens, 256 new
#    tokens, greedy, the requests spread over CLIENTS client processes (default 4); then, on the same server,
#    rate inf once more after an untimed pass of the whole workload (`bench-serve --warmup`; label
#    LABEL-warm), the warm server against the offline engine (`bench --warmup`) on the same workload;
# 4. `transformers serve --continuous-batching` on the same folder, in its own process, driven by the same
#    bench-serve (completions, else chat); if it cannot run, its log says why.
# PARTS picks steps 2-4 (default: "sync async warm allgraphs offline compile transformers"; allgraphs: async
# with --cuda-graphs on, every step a graph captured the first time its shape comes up, against the server's
# default of decode steps only;
# warm: the rate-inf rerun above; oneclient, not in the default: async at the highest rate from one client process),
# so the work can be split over several shorter runs into the same OUTDIR (the folder of step 1 is kept and
# reused). SERVE_FLAGS adds flags to each of our servers and TAG a suffix to their labels, for an A/B of
# one setting (e.g. SERVE_FLAGS="--switch-interval-ms 0.5" TAG=-si0.5, or SERVE_FLAGS="--capture-up-to 512"
# TAG=-capture512: every decode graph of the workload captured before the server is ready; with "--cuda-graphs on" as well,
# every prefill and mixed step's graph too); BENCH_FLAGS adds flags to every
# bench-serve (e.g. BENCH_FLAGS="--shared-prefix-len 1024": prompts that share a system prompt). Each server's log ends with its
# steps, CUDA graph captures and the seconds they held its loop (printed after each server stops), and
# its engine's timeline (every step's spans, each request's arrival) is written to
# OUTDIR/timeline-LABEL.json ("+" in a label becomes "-" in file names) as it stops, and summarised
# burst by burst (scripts/timeline_bursts.py: arrivals and their spread, steps, device busy, ms per step, the longest steps;
# the offline run's too) into OUTDIR/bursts.txt.
# Writes OUTDIR/bench_serve.json + .png (one label per server and mode), OUTDIR/startup.tsv, a log each;
# after each bench, the CPU seconds of the server's main thread (its HTTP event loop) and of the whole
# server process over that bench (server-cpu.tsv).
# Needs: a CUDA GPU with ~60 GB free, ~20 GB of disk, fastapi, uvicorn and openai (wheels: set WHEELS=DIR to
# install them from there without a network; for a Python 3.12 machine, fetch them elsewhere with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d DIR \
#       fastapi uvicorn httptools uvloop "openai<3" "httpx<1" rich
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d DIR \
#       accelerate psutil
# ); about 20 minutes for everything, so split it with PARTS where one command has a shorter limit. MODEL, DEVICE,
# NUM_PROMPTS, LEN, RATES, COMPILE=0 shrink it for a dry run on a CPU (e.g. MODEL=random-llama DEVICE=cpu
# NUM_PROMPTS=8 LEN=32 COMPILE=0); OFFLINE_MODES (default sync,async) the offline engine's modes, e.g.
# async,async+compile,async+dynamic; MAX_BATCH (default NUM_PROMPTS) caps the batch, e.g. for NUM_PROMPTS=256,
# whose batch of 256 whole-context requests would not fit in the KV cache.
set -uo pipefail
out=${1:?usage: serve_bench.sh OUTDIR}
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
out=$(cd "$out" && pwd)
model=${MODEL:-llama3-8b-shape}; device=${DEVICE:-cuda}; n=${NUM_PROMPTS:-64}; len=${LEN:-256}
rates=${RATES:-4,16,32,inf}; port=${PORT:-8321}; url=http://127.0.0.1:$port
parts=" ${PARTS:-sync async warm allgraphs offline compile transformers} "; clients=${CLIENTS:-4}
want() { [[ $parts == *" $1 "* ]]; }
for p in $parts; do  # a misspelt part would otherwise measure nothing, silently
  case $p in sync|async|warm|allgraphs|oneclient|offline|compile|transformers) ;;
    *) echo "unknown part '$p' in PARTS (sync async warm allgraphs oneclient offline compile transformers)"; exit 2;;
  esac
done
if [ -n "${WHEELS:-}" ]; then  # rich and accelerate: what `transformers serve` needs beyond the server itself
  python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn httptools uvloop openai rich accelerate; fi
python3 -c "import fastapi, uvicorn, openai" || { echo "needs fastapi, uvicorn and openai (set WHEELS=DIR)"; exit 1; }
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$out/versions.txt"

folder=$out/$model-folder
dtype=$([ "$device" = cpu ] && echo float32 || echo bfloat16)
[ -f "$folder/config.json" ] || python3 scripts/gpu/save_random_folder.py "$model" "$folder" --device "$device" \
  --dtype "$dtype" > "$out/save.log" 2>&1 || { tail -5 "$out/save.log"; exit 1; }
# MAX_BATCH: for NUM_PROMPTS past what fits; MAX_BATCH_TOKENS: the step's token budget (a latency trade-off);
# PREFIX_CACHING (default off): bench-serve sends the same prompts at every rate, so with the cache on every
# rate after the first would find its prompts cached and skip their prefill (on: for --shared-prefix-len)
limits=(--max-batch-size "${MAX_BATCH:-$n}" --max-batch-tokens "${MAX_BATCH_TOKENS:-2048}")
serve_limits=("${limits[@]}" --prefix-caching "${PREFIX_CACHING:-off}")
# shellcheck disable=SC2206  # BENCH_FLAGS: words on purpose
bench=(--url "$url" --rates "$rates" --num-prompts "$n" --prompt-len "$len" --max-tokens "$len" ${BENCH_FLAGS:-}
       --slo ttft=1000,tpot=50 --out "$out" --no-progress)
[ -f "$out/startup.tsv" ] || printf 'label\tseconds_to_ready_health\n' > "$out/startup.tsv"
[ -f "$out/server-cpu.tsv" ] || printf 'label\twall_s\tmain_thread_cpu_s\tprocess_cpu_s\n' > "$out/server-cpu.tsv"
cpu_s() {  # cpu_s FILE: utime + stime of a /proc stat file, in seconds
  awk -v hz="$(getconf CLK_TCK)" '{sub(/.*\) /, ""); print ($12 + $13) / hz}' "$1" 2>/dev/null || echo 0
}
measured() {  # measured LABEL COMMAND...: run a bench, then record the server's CPU over it
  local label=$1; shift
  local t0=$EPOCHREALTIME m0 p0
  m0=$(cpu_s "/proc/$pid/task/$pid/stat"); p0=$(cpu_s "/proc/$pid/stat")
  "$@"; local rc=$?
  awk -v l="$label" -v a="$t0" -v b="$EPOCHREALTIME" -v m0="$m0" -v m1="$(cpu_s "/proc/$pid/task/$pid/stat")" \
    -v p0="$p0" -v p1="$(cpu_s "/proc/$pid/stat")" 'BEGIN{printf "%s\t%.1f\t%.1f\t%.1f\n", l, b - a, m1 - m0, p1 - p0}' \
    | tee -a "$out/server-cpu.tsv"
  return $rc
}

start() {  # start LABEL COMMAND...: run the server in the background, wait for /health (10 min at most)
  local label=$1; shift
  local t0=$EPOCHREALTIME
  log=$out/server-${label//+/-}.log  # (file names without "+": some copying tools refuse them)
  "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 6000); do
    if curl -sf "$url/health" > /dev/null 2>&1; then
      awk -v l="$label" -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{printf "%s\t%.1f\n", l, b - a}' \
        | tee -a "$out/startup.tsv"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "$label: the server exited:"; tail -5 "$log"; return 1; }
    sleep 0.1
  done
  echo "$label: no ready /health in 10 minutes"; stop; return 1
}
stop() {  # SIGTERM, then the time it took to exit and the server's own stop line (steps, graph captures)
  local t0=$EPOCHREALTIME
  kill -TERM "$pid" 2>/dev/null; wait "$pid"; local rc=$?
  awk -v rc=$rc -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{printf "stopped (exit %d) in %.1f s\n", rc, b - a}'
  grep -hE "minibatch: (stopping|since ready)" "$log" 2>/dev/null || true
  local tl=${log%/*}/timeline-${log##*/server-}; tl=${tl%.log}.json
  [ -f "$tl" ] && python3 scripts/timeline_bursts.py "$tl" --longest 5 | tee -a "$out/bursts.txt"
  pid=  # gone: nothing for the trap below to stop
}
sends() {  # sends LABEL RATES [BENCH-SERVE FLAGS...]: bench-serve against the running server
  local label=$1 r=$2; shift 2
  measured "$label" python3 -m minibatch bench-serve "${bench[@]}" --rates "$r" --label "$label" "$@" \
    > "$out/bench-${label//+/-}.log" 2>&1; grep -E "^rate|failed|warning" "$out/bench-${label//+/-}.log" || true
}
ours() {  # ours LABEL RATES SERVE-FLAGS...
  local base=$1 label=$1${TAG:-} r=$2; shift 2
  echo "== $label ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086  # SERVE_FLAGS: words on purpose
  start "$label" python3 -m minibatch serve --model "$folder" --device "$device" --port "$port" "${serve_limits[@]}" "$@" \
    --timeline "$out/timeline-${label//+/-}.json" ${SERVE_FLAGS:-} || return 1
  [ "$r" = none ] || sends "$label" "$r" --processes "$clients"
  if [ "$r" != none ] && want warm; then  # the same server: a warm pass, then rate inf
    sends "$label-warm" inf --processes "$clients" --warmup; fi
  if [ "$base" = async ] && want oneclient; then  # the same server, one client process at the highest rates
    sends async-1client "${rates##*,}" --processes 1; fi
  stop
}

# cut short (e.g. by `timeout`, which signals the whole process group): wait for the running server to
# write its stop line and timeline before this script exits, so that a cut run still leaves them
pid=
cut() { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && stop; exit "$1"; }
trap 'cut 143' TERM
trap 'cut 130' INT

want sync && ours sync "$rates" --mode sync
want async && ours async "$rates" --mode async
want allgraphs && [ "$device" != cpu ] && ours async-all-graphs "$rates" --mode async --cuda-graphs on
if want compile && [ "${COMPILE:-1}" = 1 ]; then
  export TORCHINDUCTOR_CACHE_DIR=$out/inductor-cache
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  ours async+compile inf --mode async --compile   # cold: compiles everything
  ours async+compile-cached none --mode async --compile  # the same on-disk caches filled: start-up only
fi

if want offline; then
echo "== offline engine, same workload ($(date -u +%H:%M:%S))"
python3 -m minibatch bench --model "$folder" --device "$device" --modes "${OFFLINE_MODES:-sync,async}" --num-prompts "$n" \
  --prompt-len "$len" --max-new-tokens "$len" "${limits[@]}" --warmup --no-progress --out "$out/offline" \
  > "$out/offline.log" 2>&1; tail -6 "$out/offline.log"
for tl in "$out"/offline/timeline_*.json; do  # one per mode
  [ -f "$tl" ] && python3 scripts/timeline_bursts.py "$tl" --longest 5 | tee -a "$out/bursts.txt"; done
fi
want transformers || { cat "$out/startup.tsv"; exit 0; }

echo "== transformers serve --continuous-batching ($(date -u +%H:%M:%S))"
tf=(transformers serve "$folder" --continuous-batching --host 127.0.0.1 --port "$port" --device "$device")
if start transformers "${tf[@]}"; then
  for endpoint in completions chat; do
    measured transformers timeout 420 python3 -m minibatch bench-serve "${bench[@]}" --rates "${TF_RATES:-$rates}" \
      --model "$folder" --endpoint "$endpoint" --processes "$clients" \
      --label transformers > "$out/bench-transformers-$endpoint.log" 2>&1 && break
    echo "transformers serve: bench-serve on $endpoint failed:"; grep -E "failed|error" \
      "$out/bench-transformers-$endpoint.log" | head -3
  done
  grep -hE "^rate" "$out"/bench-transformers-*.log
  stop
else
  echo "transformers serve could not start; its log:"; tail -20 "$out/server-transformers.log"
fi
cat "$out/startup.tsv"
