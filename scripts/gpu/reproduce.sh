#!/usr/bin/env bash
# Every GPU number and figure of the project, into the folder given as the first argument.
#
#   bash scripts/gpu/reproduce.sh OUTDIR [SECTION ...]     # default: every section, in this order
#
# Sections (each writes OUTDIR/SECTION/ and a log; BENCHMARKS.md, or for older runs the histories it links in
# notes/benchmarks_history_*.md, says which table each one fills):
#   tests      the GPU tests (tests/test_gpu.py, the cuda half of tests/test_device.py, the Triton kernel)
#   headline   8B shape, 32 x 256-token prompts, 256 new tokens: sync and async with CUDA graphs, the floor,
#              and transformers' generate_batch in each of its modes, each in a process of its own
#   eager      the same workload without CUDA graphs (every step eager)
#   arrivals   the same workload with requests arriving over the first 128 steps (prefill steps all along)
#   compile    sync and async with torch.compile'd decode steps, beside transformers' generate_batch modes
#   floor      the decode step at fixed batch x context against its full floor, default and compiled (with and
#              without q/k/v and gate/up merged), its kernels summed by kind (floor_matrix.py --kernels)
#   prefill    prefill and mixed steps as CUDA graphs against eager, four workloads (experiments/prefill_graphs_ab.py)
#   kernels    decode-step variants against the floor (experiments/step_ab.py); the decode attentions, gather + SDPA
#              against the Triton kernel that reads the paged cache in place (experiments/decode_attention_ab.py); that
#              kernel's launch settings swept (experiments/decode_kernel_tune.py)
#   linear     the 8B shape's Linear layers at 1-128 rows: cuBLAS, a Triton skinny-product kernel, merged
#              projections, against the weight floor (experiments/skinny_mm_ab.py)
#   small      small models (0.6B and 1B shapes): the compiled decode step with few-row products on
#              speed/skinny.py's kernel against all on cuBLAS (floor_matrix.py --skinny-ab) and against
#              kernels launched late, without combined kernels and with the vocabulary's argmax as one
#              reduction (--variants late:... separate:... one_argmax:...), and the 0.6B
#              shape's products alone at every kernel setting (experiments/skinny_gemv_ab.py)
#   switches   the small-model switches against the default step (floor_matrix.py --variants, 0.6B shape,
#              batches 1, 4 and 8 in a command each, ~4 minutes each; BATCHES="1 4" runs a part, for a time
#              limit per command): the step without q/k/v handed to the decode kernel as their projections
#              left them (fresh=0: model/fresh.py, the default for small models); the merged q/k/v and gate/up
#              products on speed/skinny.py's kernel (widest=...); that with the carry-over as one compiled
#              kernel (carry=1, off); not in the default list
#   gated      the 0.6B shape's gate/up product with silu(gate) * up inside (speed/gated.py) alone against
#              cuBLAS (experiments/skinny_gemv_ab.py --grid gated), and the compiled step at batches 1, 4 and 8
#              without it (gated=0), with it at one row only (gated_rows=0), and without fresh's path (fresh=0);
#              not in the default list
#   target     the small models' compiled decode step against 3x its floor, in one process per model (~8
#              minutes): the 0.6B shape at batches 1, 4 and 8, the default step (fresh's path: model/fresh.py's
#              rule for small models), the step without it (fresh=0) and the default with the merged q/k/v
#              product on cuBLAS (short_k=0: skinny.SHORT_K); the 1B shape's default step and the step without
#              fresh's path; not in the default list
#   qkv        the 0.6B shape's merged q/k/v product on speed/skinny.py's tensor-core tiles alone against cuBLAS
#              (experiments/skinny_gemv_ab.py --grid tiles), and the compiled step at batches 1, 4 and 8, the
#              default (q/k/v on the kernel at 1-4 rows: skinny.SHORT_K) against q/k/v on cuBLAS (short_k=0)
#              and on its best tile per row count, 8 rows included (skinny_timed=1: skinny.TIMED); ~6 minutes;
#              not in the default list
#   attn       the decode attention's keys per loop step, warps and pipeline stages inside the 0.6B shape's compiled
#              step at batches 4 and 8 (floor_matrix.py --variants LABEL:attn=KEYSxWARPSxSTAGES: triton_decode.SETTINGS)
#              against the shipped 64 keys, 2 warps, 2 stages; ~5 minutes; not in the default list
#   down8      the 0.6B shape's compiled step at batch 8 with its down product (1024 x 3072), its attention output
#              (1024 x 2048) or both on skinny.py's tensor-core tile instead of cuBLAS, whose down product at 8 rows
#              is two kernels (split K, then a reduce): floor_matrix.py --variants ...:tile=8:1024:3072; ~3 minutes;
#              not in the default list (run at commit a4a3da4 with one more variant: gpu_small_models_hoist_tiles_combo_2026-12-06)
#   combo      the 0.6B shape's compiled step at batches 4 and 8 without Inductor's combo kernels (combo_kernels=0,
#              compiled.COMBO) against the default and the default again, with the sources of the step's
#              kernels that Inductor named without their ops; ~4 minutes; not in the default list
#   outer      the 0.6B shape's compiled step at batches 1, 4 and 8 with the rotary angles' one-term matrix product
#              (transformers before 5.24: a cuBLAS kernel a step, never launched early) as a multiply (the default:
#              fx_edits.OUTER) against the product kept (outer=0), and the default again; ~4 minutes; not in the
#              default list
#   splits     the 0.6B shape's compiled step at batches 1, 4 and 8 with the decode attention's splits no shorter
#              than 128 keys at 4 rows and more (the default: triton_decode.MIN_SPLIT_KEYS, MIN_SPLIT_ROWS) against
#              the old rule of one 64-key chunk (min_split=64) and the rule at 1 row too (min_split_rows=1), and the
#              default again; ~4 minutes; not in the default list
#   rotary     the 0.6B shape's compiled step at batches 4 and 8 with one rotary cos and sin for every layer (the
#              default: model/fresh.py's operator with a layout rule of its own) against a copy computed per layer
#              (rotary=0: fresh.ONE_ROTARY), and the default again; ~3 minutes; not in the default list
#   triton     the 8B workload with --decode-attention triton, and the full floor
#   profile    our device-busy fraction against torch.profiler's kernel timeline (profile_async.py)
#   sweep      model shape x batch size x context, sync against async, against the full floor (sweep.py)
#   host       the host's work per decode step on this machine's CPU (scripts/host_cost.py)
#   online     requests arriving as a Poisson process at the engine, sync against async (scripts/online_bench.py)
#   serving    the HTTP server against transformers serve and the offline engine (serve_bench.sh; needs fastapi,
#              uvicorn, openai, and rich + accelerate for transformers serve: WHEELS=DIR installs them offline)
#   latency    the server's latency: sync and async by default against every step a CUDA graph captured at start-up
#              (--cuda-graphs on --capture-up-to 512), that async server at token budgets 2048, 1024 and 512
#              (serve_bench.sh, ~25 minutes; not in the default list)
# GPU=NAME (optional): run only on a GPU whose name holds NAME (e.g. GPU=H200, where a number is quoted against
# that card), else stop at once with exit status 3, before anything is compiled or timed.
# Needs: a CUDA GPU with ~100 GB free, torch, transformers, matplotlib, triton; about 65 minutes for everything
# (the sweep alone ~10: split it with sweep.py's --models where a run has a time limit).
set -uo pipefail
out=${1:?usage: reproduce.sh OUTDIR [SECTION ...]}
shift
sections=${*:-tests headline eager arrivals compile floor prefill kernels linear small triton profile sweep host online serving}
cd "$(dirname "$0")/../.."
if [ -n "${GPU:-}" ]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case "$card" in *"$GPU"*) ;; *) echo "reproduce.sh: GPU=$GPU asked, this machine has $card: nothing run"; exit 3 ;; esac
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KINETO_LOG_LEVEL=5
mkdir -p "$out"
eightb=(--model llama3-8b-shape --device cuda --num-prompts 32 --prompt-len 256 --max-new-tokens 256
        --max-batch-size 32 --max-batch-tokens 2048 --warmup --no-progress)
for s in $sections; do
  mkdir -p "$out/$s"
  echo "== $s ($(date -u +%H:%M:%S))"
  case $s in
    tests) python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_device.py \
             tests/test_paged_kernel.py tests/test_engine.py > "$out/$s/pytest.log" 2>&1
           tail -3 "$out/$s/pytest.log" ;;
    headline) python3 -m minibatch bench "${eightb[@]}" --modes sync,async --floor --hf all \
                --out "$out/$s" > "$out/$s/bench.log" 2>&1; tail -12 "$out/$s/bench.log" ;;
    eager) python3 -m minibatch bench "${eightb[@]}" --modes sync,async --cuda-graphs off \
             --out "$out/$s" > "$out/$s/bench.log" 2>&1; tail -6 "$out/$s/bench.log" ;;
    arrivals) python3 -m minibatch bench "${eightb[@]}" --modes sync,async --arrivals 128 \
                --out "$out/$s" > "$out/$s/bench.log" 2>&1; tail -6 "$out/$s/bench.log" ;;
    compile) python3 -m minibatch bench "${eightb[@]}" --modes sync,async,sync+compile,async+compile --floor \
               --hf all --out "$out/$s" > "$out/$s/bench.log" 2>&1; tail -16 "$out/$s/bench.log" ;;
    floor) python3 scripts/gpu/floor_matrix.py "$out/$s" --compile --unmerged --kernels > "$out/$s/floor.log" 2>&1
           tail -28 "$out/$s/floor.log" ;;
    prefill) python3 scripts/experiments/prefill_graphs_ab.py "$out/$s" > "$out/$s/prefill.log" 2>&1
             tail -20 "$out/$s/prefill.log" ;;
    kernels) python3 scripts/experiments/decode_attention_ab.py "$out/$s" > "$out/$s/attention_ab.log" 2>&1
             tail -20 "$out/$s/attention_ab.log"
             python3 scripts/experiments/step_ab.py "$out/$s" > "$out/$s/step_ab.log" 2>&1; tail -12 "$out/$s/step_ab.log"
             python3 scripts/experiments/decode_kernel_tune.py "$out/$s" > "$out/$s/decode_kernel_tune.log" 2>&1
             tail -6 "$out/$s/decode_kernel_tune.log" ;;
    linear) python3 scripts/experiments/skinny_mm_ab.py "$out/$s" > "$out/$s/skinny_mm.log" 2>&1
            tail -5 "$out/$s/skinny_mm.log" ;;
    small) for m in qwen3-0.6b-shape llama3-1b-shape; do
             python3 scripts/gpu/floor_matrix.py "$out/$s/$m" --model $m --batches 1,4,8 --contexts 512 --compile \
                 --skinny-ab --kernels --variants "late:triton.enable_pdl=0,early=0" \
                 "separate:combo_kernels=0,benchmark_combo_kernel=0" "one_argmax:argmax=0" > "$out/$s/floor_$m.log" 2>&1
             tail -12 "$out/$s/floor_$m.log"
           done
           python3 scripts/experiments/skinny_gemv_ab.py "$out/$s" --model qwen3-0.6b-shape --rows 1,4,8 \
               > "$out/$s/skinny_gemv.log" 2>&1; tail -4 "$out/$s/skinny_gemv.log" ;;
    switches) wide="widest=1:8192/4:8192/8:8192"
              for b in ${BATCHES:-1 4 8}; do
                python3 scripts/gpu/floor_matrix.py "$out/$s/b$b" --model qwen3-0.6b-shape --batches $b --contexts 512 \
                    --compile --kernels top --variants "nofresh:fresh=0" "wide:$wide" \
                    "all:$wide,carry=1" > "$out/$s/floor_b$b.log" 2>&1
                tail -8 "$out/$s/floor_b$b.log"
              done ;;
    gated) python3 scripts/experiments/skinny_gemv_ab.py "$out/$s" --rows 1,4,8 --grid gated > "$out/$s/gated_ab.log" 2>&1
           tail -5 "$out/$s/gated_ab.log"
           python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 1,4,8 --contexts 512 --compile \
               --kernels top --variants "ungated:gated=0" "few:gated_rows=0" "nofresh:fresh=0" \
               > "$out/$s/floor.log" 2>&1; grep -A6 "^ \+[148] \+512" "$out/$s/floor.log" ;;
    target) python3 scripts/gpu/floor_matrix.py "$out/$s/q06" --model qwen3-0.6b-shape --batches 1,4,8 --contexts 512 \
                --compile --kernels top --variants "nofresh:fresh=0" "cublasqkv:short_k=0" \
                > "$out/$s/floor_q06.log" 2>&1; grep -A5 "^ \+[148] \+512" "$out/$s/floor_q06.log"
            python3 scripts/gpu/floor_matrix.py "$out/$s/l1b" --model llama3-1b-shape --batches 1,4,8 --contexts 512 \
                --compile --variants "nofresh:fresh=0" > "$out/$s/floor_l1b.log" 2>&1; grep "^ \+[148] \+512" "$out/$s/floor_l1b.log" ;;
    qkv) python3 scripts/experiments/skinny_gemv_ab.py "$out/$s" --model qwen3-0.6b-shape --rows 1,4,8 --shapes qkv \
             --grid tiles > "$out/$s/qkv_tiles.log" 2>&1; grep -E "^qkv|^M=" "$out/$s/qkv_tiles.log"
         python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 1,4,8 --contexts 512 --compile \
             --kernels top --skinny-settings "$out/$s/skinny_gemv_qwen3-0.6b-shape.json" \
             --variants "cublasqkv:short_k=0" "timed:skinny_timed=1" > "$out/$s/floor_q06.log" 2>&1
         grep -A5 "^ \+[148] \+512" "$out/$s/floor_q06.log" ;;
    attn) python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 4,8 --contexts 512 --compile \
              --variants "k128w4:attn=128x4x2" "k128w2:attn=128x2x2" "k64w4:attn=64x4x2" "k64s3:attn=64x2x3" \
              > "$out/$s/floor_q06.log" 2>&1; grep -A5 "^ \+[48] \+512" "$out/$s/floor_q06.log" ;;
    down8) python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 8 --contexts 512 --compile \
               --kernels top --variants "down8:tile=8:1024:3072" "o8:tile=8:1024:2048" "both8:tile=8:1024:3072/8:1024:2048" \
               > "$out/$s/floor_q06.log" 2>&1; grep -A6 "^ \+8 \+512" "$out/$s/floor_q06.log" ;;
    outer) python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 1,4,8 --contexts 512 --compile \
             --kernels top --variants "product:outer=0" "again:" > "$out/$s/floor_q06.log" 2>&1
           grep -A4 "^ \+[148] \+512" "$out/$s/floor_q06.log" ;;
    splits) python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 1,4,8 --contexts 512 \
              --compile --kernels top --variants "split64:min_split=64" "split1:min_split_rows=1" "again:" \
              > "$out/$s/floor_q06.log" 2>&1
            grep -A5 "^ \+[148] \+512" "$out/$s/floor_q06.log" ;;
    combo) cache=$(mktemp -d)  # (Inductor's generated kernels: the sources of the step's one-per-step kernels kept)
           TORCHINDUCTOR_CACHE_DIR=$cache python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape \
             --batches 4,8 --contexts 512 --compile --kernels top --variants "nocombo:combo_kernels=0" "again:" \
             > "$out/$s/floor_q06.log" 2>&1; grep -A4 "^ \+[48] \+512" "$out/$s/floor_q06.log"
           mkdir -p "$out/$s/kernels"; grep -rlE "def triton_(poi|red|per)_fused_[0-9]+\(|def triton_poi_fused_.*fresh" "$cache" \
             | while read -r f; do cp "$f" "$out/$s/kernels/"; done; rm -rf "$cache"; ls "$out/$s/kernels" | head -40 ;;
    rotary) python3 scripts/gpu/floor_matrix.py "$out/$s" --model qwen3-0.6b-shape --batches 4,8 --contexts 512 --compile \
              --kernels top --variants "rotary0:rotary=0" "again:" > "$out/$s/floor_q06.log" 2>&1
            grep -A4 "^ \+[48] \+512" "$out/$s/floor_q06.log" ;;
    triton) python3 -m minibatch bench "${eightb[@]}" --modes sync,async --floor --decode-attention triton \
              --out "$out/$s" > "$out/$s/bench.log" 2>&1; tail -14 "$out/$s/bench.log" ;;
    profile) python3 scripts/gpu/profile_async.py "$out/$s" > "$out/$s/profile.log" 2>&1
             tail -6 "$out/$s/profile.log" ;;
    sweep) python3 scripts/sweep.py --device cuda --out "$out/$s" > "$out/$s/sweep.log" 2>&1
           tail -26 "$out/$s/sweep.log" ;;
    host) python3 scripts/host_cost.py "$out/$s" --rows 32,128 --context 1024 > "$out/$s/host.log" 2>&1
          tail -12 "$out/$s/host.log" ;;
    online) python3 scripts/online_bench.py "$out/$s" --model llama3-8b-shape --device cuda --rates 4,8,16,inf \
              --num-prompts 64 --prompt-len 256 --max-new-tokens 256 --max-batch-size 32 > "$out/$s/online.log" 2>&1
            tail -10 "$out/$s/online.log" ;;
    serving) bash scripts/gpu/serve_bench.sh "$out/$s" > "$out/$s/serving.log" 2>&1; tail -30 "$out/$s/serving.log" ;;
    latency) PARTS="sync async" bash scripts/gpu/serve_bench.sh "$out/$s" > "$out/$s/default.log" 2>&1  # (64 prompts,
             # rates 4, 16, 32 and inf: serve_bench.sh's defaults)
             for b in 2048 1024 512; do  # every step a graph captured at start-up, and the token budget
               parts=$([ "$b" = 2048 ] && echo "sync async" || echo async)
               SERVE_FLAGS="--cuda-graphs on --capture-up-to 512" TAG=-allgraphs-capture512-mbt$b MAX_BATCH_TOKENS=$b \
                 PARTS=$parts bash scripts/gpu/serve_bench.sh "$out/$s" > "$out/$s/mbt$b.log" 2>&1
             done
             grep -h "^rate" "$out/$s"/bench-*.log | tail -24 ;;
    *) echo "unknown section $s" >&2; exit 2 ;;
  esac
done
