# %% [markdown]
# # 07 · Does it work?
#
# **What you will learn:** how to measure an inference loop honestly (one process, side by side,
# ratios rather than raw times), what the asynchronous loop gains on a real GPU compared with the
# article, with transformers' own continuous batching and with the hardware's limit; what is still
# left on the table; what asynchrony costs (time to first token); and where production engines
# implement each idea of this workshop.
#
# **Time:** about 20 minutes. The GPU numbers are redrawn from runs recorded on an NVIDIA H200
# (`figures/data/`, `BENCHMARKS.md`); with a GPU present, one cell reruns a small measurement.

# %%
import json
import os
import time

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.tools import bench
from minibatch.core.timeline import Timeline

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
DATA = "../figures/data/"

# %% [markdown]
# ## 1. The experiment
#
# The article ran an 8B model at batch 32 and reported the GPU busy 76.0% of the time with the
# synchronous loop and 99.4% with the asynchronous one, 22% less wall time (ratio 0.78). We ran the
# same shape of experiment, scaled to run in minutes: a Llama-3-8B-shaped model with random
# weights in bfloat16, 32 prompts of 256 tokens, 256 new tokens each, greedy. One process ran every
# mode on the same prompts, each after an untimed warm-up run, so the ratios compare like with like:
#
#     python -m minibatch bench --model llama3-8b-shape --device cuda \
#         --modes sync,async,sync+compile,async+compile --num-prompts 32 --prompt-len 256 \
#         --max-new-tokens 256 --max-batch-tokens 2048 --warmup --hf all --floor
#
# `+compile` runs the decode step through `torch.compile` (section 3 says why); `hf_*` rows are
# transformers' own continuous batching (`generate_batch`) in each of its four modes.

# %%
run = json.load(open(DATA + "gpu_bench_all_llama3-8b-shape_b32_256.json"))
env = run["environment"]
print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, {env['model']} ({env['dtype']})")
print(f"{'mode':16} {'wall s':>7} {'tok/s':>7} {'busy':>6}")
res = {r["mode"]: r for r in run["results"]}
for r in run["results"]:
    busy = "" if r["device_busy"] != r["device_busy"] else f"{r['device_busy']:.0%}"  # NaN: not measured
    print(f"{r['mode']:16} {r['wall_s']:7.2f} {r['tokens_per_s']:7.0f} {busy:>6}")
for plain in ("", "+compile"):
    s_, a_ = res["sync" + plain], res["async" + plain]
    print(f"async{plain} / sync{plain} wall time: {a_['wall_s'] / s_['wall_s']:.2f}   device busy "
          f"{s_['device_busy']:.0%} -> {a_['device_busy']:.0%}   (article: 0.78, 76.0% -> 99.4%)")
ours = max((r for r in run["results"] if not r["mode"].startswith("hf")), key=lambda r: r["tokens_per_s"])
theirs = max((r for r in run["results"] if r["mode"].startswith("hf")), key=lambda r: r["tokens_per_s"])
print(f"fastest: {ours['mode']} {ours['tokens_per_s']:.0f} tok/s vs {theirs['mode']} {theirs['tokens_per_s']:.0f} "
      f"tok/s = {ours['tokens_per_s'] / theirs['tokens_per_s']:.1f}x (both in this one process)")
apart = {r["mode"]: r for r in json.load(open(DATA + "runs/gpu_merged_projections_2026-12-01/bench_8b_b32_256.json"))["results"]}
print(f"each in a process of its own, a later step (2026-12-01): async+compile {apart['async+compile']['tokens_per_s']:.0f} "
      f"tok/s vs hf_sync_graphs {apart['hf_sync_graphs']['tokens_per_s']:.0f} tok/s = "
      f"{apart['async+compile']['tokens_per_s'] / apart['hf_sync_graphs']['tokens_per_s']:.2f}x")

# %% [markdown]
# What to read from it:
#
# * **Asynchrony does what the article says**: the device goes from about 80% busy to 100%, and
#   the same work takes about a fifth less time: in this run the async/sync ratio is 0.81 <!-- from figures/data/headline.json: same_process.ratio -->
#   (0.79 <!-- from figures/data/headline.json: same_process.compile_ratio --> compiled). Why not the article's 0.78? When the async loop keeps the device
#   100% busy, the best it can do is remove the sync loop's idle share, so the ratio is close to the
#   sync loop's busy fraction: 76% in the article, 83% <!-- from figures/data/headline.json: same_process.sync_busy_pct --> here (81% <!-- from figures/data/headline.json: same_process.sync_compile_busy_pct --> compiled). Our
#   sync loop leaves less idle time to win back; we did not slow it down to make async look better.
#   With the faster steps of section 3 (the README's results table) the sync loop is busy 85-88% <!-- from figures/data/headline.json: headline.sdpa_sync_busy_pct, headline.triton_sync_busy_pct -->
#   and the ratios are 0.84 and 0.85 <!-- from figures/data/headline.json: headline.sdpa_ratio, headline.triton_ratio -->: the same rule.
# * **Against transformers' own continuous batching** on the same model and prompts, its fastest
#   mode here was synchronous with CUDA graphs. Run in the same process after our engine, it gets
#   less GPU memory and looks slower than it is; each in a process of its own (the second line), our
#   fastest mode is 6.32x <!-- from figures/data/headline.json: vs_transformers.speedup --> its fastest, the number the README quotes. (Its async modes were slower than its sync modes on
#   this workload, in this version.) Its bf16 tokens differ from ours: random
#   weights give nearly flat logits, and different kernels round differently; in float32 the tokens
#   agree (the tests).
# * The sync and async loops give the **same tokens**, 32/32, with and without compile.
#
# ## 2. The GPU over the whole run
#
# The article drew the GPU's activity over the whole run, one plot per loop. The timelines recorded by
# that run hold one span per stage per step, on the device's clock; for each 50 ms window, here is the
# fraction of time the device was computing:

# %%
def busy_curve(tl, window=0.05):
    t0 = min(s.start for s in tl.spans)
    edges = torch.arange(0, tl.wall + window, window)
    busy = []
    for a in edges[:-1].tolist():
        inside = [s for s in tl.spans if s.lane == "compute" and s.end > t0 + a and s.start < t0 + a + window]
        clipped = sum(min(s.end, t0 + a + window) - max(s.start, t0 + a) for s in inside)
        busy.append(min(clipped / window, 1.0))
    return edges[:-1], busy


timelines = {m: Timeline.load(DATA + f"gpu_{m}_sdpa_llama3-8b-shape_b32_256.json") for m in ("sync", "async")}
fig, axes = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
for ax, (mode, tl) in zip(axes, timelines.items()):
    x, y = busy_curve(tl)
    ax.fill_between(x, y, step="post", alpha=0.6, color="tab:blue" if mode == "sync" else "tab:green")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("busy")
    ax.set_title(f"{mode}: device busy {tl.device_busy():.0%}, {tl.wall:.2f} s", fontsize=10, loc="left")
axes[1].set_xlabel("time since start (s), 50 ms windows")
fig.suptitle("8B shape, batch 32, 256 new tokens, H200 (CUDA graphs, gather + SDPA step, 2026-11-30)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_busy_over_time_gpu.png", dpi=110)

# %% [markdown]
# The sync plot sits near 0.8 for the whole decode phase: every step the GPU waits about 2.5 ms while
# the host reads back the tokens and prepares the next batch. The async plot stays at 1 and ends
# sooner. The article's own experiment ran longer generations; we ran it at 1024 new tokens too:

# %%
long = json.load(open(DATA + "gpu_bench_llama3-8b-shape_b32_1024.json"))
s_, a_ = long["results"]
print(f"1024 new tokens: sync {s_['wall_s']:.1f} s, busy {s_['device_busy']:.0%} | async {a_['wall_s']:.1f} s, "
      f"busy {a_['device_busy']:.0%} | ratio {a_['wall_s'] / s_['wall_s']:.2f}")

# %% [markdown]
# The same picture: 0.81, with the device busy 99% of the time in the async loop.
#
# ## 3. How far from the hardware's limit, and where the time goes
#
# A decode step must at least read every weight once. Pushing a batch of 32 rows through every
# linear layer of the model, all captured in one CUDA graph, is the *weight-streaming floor*
# (`floors.weight_floor_ms`). We measured a decode step in several variants, each captured in a CUDA
# graph (`scripts/experiments/step_ab.py`, 32 rows, 383 tokens of context each):

# %%
variants = []
for line in open(DATA + "gpu_step_ab_8b.txt"):
    if line.startswith("weight floor"):
        floor_ab = float(line.split(":")[1].split()[0])
    if line.startswith("ctx  383"):
        f = line.split()
        variants.append((f"{f[5]}, {'argmax' if f[7] == 'True' else 'full sampler'}, {f[3]} keys",
                         float(line.split("graph")[1].split()[0])))
compiled_ms = float(open(DATA + "gpu_compile_ab_8b.txt").read().split("CUDA graph: ")[1].split()[0])
steps_ab = [variants[0], variants[1], variants[2], variants[5], ("torch.compile, argmax, 512 keys", compiled_ms)]
fig, ax = plt.subplots(figsize=(8, 3))
ax.barh([n for n, _ in steps_ab][::-1], [ms for _, ms in steps_ab][::-1], color="tab:blue")
ax.axvline(floor_ab, color="black", ls="--", lw=1)
ax.text(floor_ab, len(steps_ab) - 0.45, f" weight floor {floor_ab:.2f} ms", fontsize=8)
for i, (_, ms) in enumerate(steps_ab[::-1]):
    ax.text(ms, i, f" {ms:.2f} ms ({ms / floor_ab:.1f}x)", va="center", fontsize=8)
ax.set_xlim(0, 19)
ax.set_xlabel("decode step, ms (H200, 8B shape, 32 rows)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_decode_step_variants_gpu.png", dpi=110)
for n, ms in steps_ab:
    print(f"{n:36} {ms:6.2f} ms  {ms / floor_ab:.2f}x floor")
sdpa_line = next(line for line in open(DATA + "gpu_step_ab_8b.txt")
                 if line.startswith("ctx  383") and "sdpa   greedy-fast True  bucket 256" in line)
print("the sdpa argmax step's kernels, summed over one replay:", " ".join(sdpa_line.split("graph")[1].split()))

# %% [markdown]
# Read it top to bottom; each of the first four bars is one more change, all measured in one process.
# The last bar comes from a second process (`step_ab.py --compile`, its own floor: 4.64 ms again) and
# pads to 512 keys: compiled with SDPA attention, whose kernels depend on the number of keys, a step
# pads keys to 256-key buckets to keep compilations few (with the Triton kernel below, one
# compilation serves every number of keys):
#
# 1. **Greedy rows need no sort.** The sampler sorts the 128k-token vocabulary of every row (for
#    top-k/top-p) even when every row is greedy. The host knows when a batch is all greedy, so it
#    marks it (`Batch.all_greedy`), and that step takes one argmax: -1.0 ms. Sampled rows need no
#    sort either when no row of the batch uses top-k or top-p (`Batch.unfiltered`): the Gumbel-max
#    picks the same token over the vocabulary in any order (-0.7 ms at 32 sampled rows,
#    `scripts/experiments/sampling_ab.py`; not in this figure, whose rows are greedy).
# 2. **Attention in one fused kernel.** The readable version (`einsum`) writes float32 scores for
#    every head and key to memory and reads them back; `scaled_dot_product_attention` keeps them on
#    chip. The trick: the 4 query heads that share a key/value head are handed to it as 4 query
#    *positions* of one head (`attention._decode_attention_sdpa`): -4.3 ms.
# 3. **Less padding.** Each row's keys are padded to a bucket; 64-key buckets instead of 256 read
#    less padding (more CUDA graphs, one per bucket): -0.4 ms at this context.
# 4. **Fewer kernels** (the last bar, compared with the third). The step is still ~1700 kernels, most of them tiny elementwise operations
#    of RMSNorm, rotary embedding and the MLP, each reading and writing a small tensor. `torch.compile`
#    fuses them into 686 kernels (`generate(..., compile=True)`), at the price of 30-45 s of
#    compilation on the 8B model for every decode shape (now: for every row count, below).
#
# What is left? The kernel table of the step (`gpu_step_ab_8b.txt`) says: the matrix products take
# ~4.7 ms; gathering each row's keys and values out of the paged cache into a contiguous copy
# (`index_select`) takes ~1.0 ms, and attention over that copy ~1.0 ms, at 512 keys per row.
# Production engines remove the gather with attention kernels that read the paged cache in place
# (vLLM's paged attention, FlashInfer, FlashAttention's paged variant). So does
# `minibatch/model/triton_decode.py`, a small Triton kernel you can read next to `_decode_attention_sdpa`:
# one program per (row, key/value head) walks the row's cells through the block table, with an online
# softmax; when there are too few rows to fill the GPU, each row's keys are split over several
# programs and a second kernel combines them. It is the default on a GPU. To `torch.compile` it is
# one opaque custom operator (`minibatch::paged_decode`), so compiled steps use it too.
#
# The "weight floor" above is too kind at large batch and long context: a step must also read every
# row's keys and values. The *full floor* counts both, at the copy bandwidth measured on the same GPU
# (`floors.decode_floor_ms`). `scripts/gpu/floor_matrix.py` builds one decode step at exactly `batch`
# rows of `context` tokens, runs it through the engine's own step runner and CUDA graph, and times
# it, eager (the default) and compiled, next to that floor and to the matrix products alone. The
# compiled step runs twice: as `compile=True` runs it, with q/k/v and gate/up merged into one product
# each (`minibatch/speed/siblings.py`, explained after the next figure), and without that merge:

# %%
RUN = DATA + "runs/gpu_merged_projections_2026-12-01/"
matrix = []
for part in ("floor_matrix_batches_1_32.json", "floor_matrix_batches_8_128.json"):
    for p in json.load(open(RUN + part))["points"]:
        matrix.append({"batch": p["batch"], "context": p["context"], "floor": p["floor_ms"], "linear": p["linear_ms"],
                       "default": p["default"]["ms"], "compile": p["compile"]["ms"], "unmerged": p["unmerged"]["ms"]})
matrix.sort(key=lambda m: (m["batch"], m["context"]))
labels = {"compile": "compiled", "unmerged": "compiled, products not merged", "linear": "matrix products alone",
          "floor": "full floor (bytes / bandwidth)"}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, context in zip(axes, (512, 2048)):
    pts = [m for m in matrix if m["context"] == context]
    x = range(len(pts))
    for key, style in (("default", "o-"), ("unmerged", "s:"), ("compile", "s-"), ("linear", "x:"), ("floor", "k--")):
        ax.plot(x, [m[key] for m in pts], style, label=labels.get(key, key))
    for i, m in enumerate(pts):
        last = i == len(pts) - 1  # its label goes to the left, inside the axes
        ax.annotate(f"{m['compile'] / m['floor']:.2f}x", (i, m["compile"]), textcoords="offset points",
                    xytext=(-6 if last else 6, -4), ha="right" if last else "left", va="top", fontsize=8,
                    color="tab:green", annotation_clip=True,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.3, alpha=0.85))
    ax.set_xticks(list(x), [str(m["batch"]) for m in pts])
    ax.set_xlim(-0.3, len(pts) - 0.7)
    ax.margins(y=0.12)
    ax.set_xlabel(f"batch (rows), context {context}")
    ax.set_title(f"8B shape, context {context}", fontsize=10)
axes[0].set_ylabel("decode step, ms (H200)")
axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_floor_matrix_gpu.png", dpi=110)
print(f"{'batch':>5} {'context':>7} {'floor':>6} {'default':>8} {'x':>5} {'compiled':>8} {'x':>5} {'not merged':>10} {'x':>5}")
for m in matrix:
    print(f"{m['batch']:5d} {m['context']:7d} {m['floor']:6.2f} {m['default']:8.2f} {m['default'] / m['floor']:5.2f}"
          f" {m['compile']:8.2f} {m['compile'] / m['floor']:5.2f} {m['unmerged']:10.2f} {m['unmerged'] / m['floor']:5.2f}")

# %% [markdown]
# How to read it. The compiled step is 1.16-1.41x <!-- from figures/data/headline.json: floor_matrix.compile_min, floor_matrix.compile_max --> its full floor, 1.20-1.51x <!-- from figures/data/headline.json: floor_matrix.unmerged_min, floor_matrix.unmerged_max --> without the merge; the
# eager one 1.44-2.05x <!-- from figures/data/headline.json: floor_matrix.default_min, floor_matrix.default_max -->. Two things keep them above the floor:
#
# * **The matrix products themselves** (dotted line, every Linear layer as the model calls it): at 1
#   to 32 rows cuBLAS streams the weights at about 80% of the copy's bandwidth, so the products alone
#   are ~1.25x the weights' share of the floor. The next figure shows which products lose the time,
#   and what the merge changes.
# * **Small kernels.** A step of 32 layers is ~1500 kernels eagerly: RMSNorm, rotary embedding, the
#   MLP's activation, residual adds, each a few microseconds plus a gap. That is the gap between the
#   eager and the compiled lines, 1.4-2.8 ms; `torch.compile` fuses them (24-41 s of
#   compilation per row count, reported by the script).
#
# Where the context is long and the batch large (128 x 2048: 34 GB of keys and values per step), the
# keys dominate and even the eager step comes within 1.5x: there the attention kernel's bandwidth is
# what counts.

# %% [markdown]
# Which matrix products lose the time? `scripts/experiments/skinny_mm_ab.py` timed every Linear shape of the
# 8B model on its own, 32 copies of each weight in one CUDA graph (as the 32 layers), and divided the
# bytes by the time: the bandwidth each product reaches. Beside them, two products the model does not
# have: q, k and v as one product with their three weights stacked (6144 outputs), and gate and up as
# one (28672 outputs).

# %%
mm = json.load(open(DATA + "gpu_skinny_mm_2026-12-01.json"))
bw = mm["copy_bandwidth"] / 1e9
names = ["q", "k", "v", "o", "gate", "up", "down", "lm_head", "qkv", "gate_up"]
fig, ax = plt.subplots(figsize=(8, 3.2))
for i, rows in enumerate((1, 32)):
    gbs = [mm["shapes"][n][str(rows)]["floor_ms"] * bw / mm["shapes"][n][str(rows)]["cublas_ms"] for n in names]
    ax.bar([j + 0.4 * i for j in range(len(names))], gbs, width=0.4, label=f"{rows} row{'s' * (rows > 1)}")
ax.axhline(bw, color="black", ls="--", lw=1)
ax.text(len(names) - 0.6, bw * 1.02, f"copy {bw:.0f} GB/s", ha="right", fontsize=8)
ax.set_xticks([j + 0.2 for j in range(len(names))],
              [n if n not in ("qkv", "gate_up") else n + "\n(merged)" for n in names], fontsize=8)
ax.set_ylabel("GB/s reached by cuBLAS")
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_linear_bandwidth_gpu.png", dpi=110)
print(f"{'rows':>4} {'floor':>6} {'as the model is':>16} {'q/k/v, gate/up merged':>22}   (ms, all 32 layers + LM head)")
for rows in mm["rows"]:
    t = mm["total"][str(rows)]
    print(f"{rows:4d} {t['floor_ms']:6.2f} {t['cublas_ms']:9.2f} ({t['cublas_ms'] / t['floor_ms']:.2f}x)"
          f" {t['merged_cublas_ms']:14.2f} ({t['merged_cublas_ms'] / t['floor_ms']:.2f}x)")

# %% [markdown]
# The big products (gate, up, down, the LM head: 112 MB to 1 GB each) stream close to the copy's
# bandwidth. The small ones do not: k and v are 8 MB each, and their product is over before the GPU's
# 132 multiprocessors are all streaming; q and o (32 MB) do better but not well. Stacking q, k and v
# into one weight makes one product big enough, and the Linear layers go from 1.22-1.38x their floor
# to 1.07-1.25x: half a millisecond per step at every batch size. Production engines write it into
# their model code (vLLM's has one `qkv_proj` and one `gate_up_proj` per layer). minibatch keeps
# transformers' modules as they are and does it in two steps instead (`minibatch/speed/siblings.py`): when a
# model is set up on a GPU, the weights of q, k and v (and of gate and up) are moved into one tensor,
# each weight a view of its rows, so nothing the modules compute changes; and the compiled step's graph
# gets a pass, before Inductor sees it, that turns three `linear` calls on the same input and on
# neighbouring weights into one call and a slice of its output for each. In the figure above that is the
# gap between the two compiled lines: 0.46-0.74 ms per step, where the product timings predicted 0.5. The eager
# step cannot have it: its products are the modules' own calls. A hand-written Triton kernel for
# few-row products, the other idea tried, won only 4% at 1 row and lost at 128 on the 8B model
# (BENCHMARKS.md has both); on a small model it is another story, at the end of this section.

# %% [markdown]
# The pass is small enough to watch on a CPU. Below, the small random Llama (two layers) gets its
# weights stacked (on a GPU `load_model` does this), then `torch.compile` captures its forward and hands
# the graph to a backend of our own, which runs `siblings.merge` and then the graph as it is (no
# Inductor, so no compilation to wait for). Each `linear` call is printed by the weight it reads:

# %%
import re

import torch._dynamo

from minibatch.speed import siblings

small = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
print("groups stacked:", siblings.pack(small.hf))


def weight_name(node):
    """q_proj, k_proj, ... from the name torch.compile gave a weight's input; a stacked weight by its rows."""
    if node.target is torch.as_strided:  # the stacked weight, read through the first sibling's
        return f"{weight_name(node.args[0])} + siblings, {list(node.args[1])}"
    found = re.search(r"([a-z]+_proj)", node.name)  # (the naming is torch.compile's: fall back to it whole)
    return (found.group(1) if found else node.name) + f" {list(node.meta['example_value'].shape)}"


def layer0_linear_calls(gm):
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in siblings.LINEAR_TARGETS]
    first = [n for n in calls if "layers_modules_0_" in str(n.args[1].args[0] if n.args[1].target is torch.as_strided
                                                             else n.args[1])]
    return len(calls), [weight_name(n.args[1]) for n in first]


def merge_and_run(gm, example_inputs):
    n, layer0 = layer0_linear_calls(gm)
    print(f"captured: {n} linear calls; layer 0's read", *layer0, sep="\n    ")
    print("merged into a sibling's call:", siblings.merge(gm, example_inputs))
    n, layer0 = layer0_linear_calls(gm)
    print(f"after the pass: {n} linear calls; layer 0's read", *layer0, sep="\n    ")
    return gm.forward


torch._dynamo.reset()
forward = torch.compile(lambda ids: small.hf(input_ids=ids, use_cache=False).logits, backend=merge_and_run)
ids = torch.randint(0, small.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    print("same logits as the modules' own calls:",
          torch.allclose(forward(ids), small.hf(input_ids=ids, use_cache=False).logits, rtol=0, atol=1e-5))

# %% [markdown]
# In layer 0, q/k/v became one call (it reads its stacked weight through q's, whose storage holds all
# three) and gate/up another; o and down stay alone (as does the LM head, after the last layer). The slices of the merged output that
# replace the old calls are views, which Inductor folds into the kernels that read them.

# %% [markdown]
# ### Small models: products too small for cuBLAS
#
# A 0.6B model (Qwen3-0.6B's shape: hidden size 1024, 28 layers) asks the same question with other
# sizes. Its weights are 2-12 MB per product, and the attention output `o` and the MLP's `down` have
# only 1024 output columns: cuBLAS cuts them into too few tiles to keep 132 multiprocessors reading.
# `minibatch/speed/skinny.py` is a short Triton kernel for such products. Each program owns 4 output
# columns (1024 columns make 256 programs) and streams their weights in pieces of 1024 inputs,
# multiplying with plain multiply-adds: with a handful of rows there is too little arithmetic for
# tensor cores to matter. `scripts/experiments/skinny_gemv_ab.py` timed every product of the 0.6B shape
# both ways (28 weight copies in one CUDA graph, cuBLAS against the kernel's best setting):

# %%
SMALL = DATA + "runs/gpu_small_models_skinny_2026-12-04/"
gemv = json.load(open(SMALL + "skinny_gemv_qwen3-0.6b-shape.json"))
copy_gbs = gemv["copy_bandwidth"] / 1e9
products = list(gemv["shapes"])
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
for ax, rows in zip(axes, ("1", "4")):
    for i, (key, label) in enumerate((("cublas_ms", "cuBLAS"), ("triton_ms", "skinny.py's kernel, best setting"))):
        gbs = [gemv["shapes"][n][rows]["floor_ms"] * copy_gbs / gemv["shapes"][n][rows][key] for n in products]
        ax.bar([j + 0.4 * i for j in range(len(products))], gbs, width=0.4, label=label)
    ax.axhline(copy_gbs, color="black", ls="--", lw=1)
    ax.set_xticks([j + 0.2 for j in range(len(products))], products, fontsize=8)
    ax.set_title(f"0.6B shape, {rows} row{'s' * (rows != '1')}", fontsize=10)
axes[0].set_ylabel("GB/s reached (H200)")
axes[0].text(-0.4, copy_gbs * 1.02, f"copy {copy_gbs:.0f} GB/s", ha="left", fontsize=8)
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
fig.tight_layout(rect=(0, 0.08, 1, 1))
fig.savefig(f"{FIGURES}/07_small_model_products_gpu.png", dpi=110)
print(f"{'product':8} {'N x K':>12} {'rows':>4} {'cuBLAS ms':>9} {'kernel ms':>9}   (28 layers, the LM head once; "
      "the kernel at its best setting)")
for n in products:
    for rows in gemv["rows"]:
        shape, r = gemv["shapes"][n], gemv["shapes"][n][str(rows)]
        print(f"{n:8} {shape['N']:>6}x{shape['K']:<5} {rows:4d} {r['cublas_ms']:9.3f} {r['triton_ms']:9.3f}")

# %% [markdown]
# Where cuBLAS is starved the kernel wins big: at its best setting `o` streams 3.8x <!-- from figures/data/headline.json: small_models.q06_o_m1_speedup --> faster with one row, `down` 1.5x <!-- from figures/data/headline.json: small_models.q06_down_m1_speedup -->
# (1.9x <!-- from figures/data/headline.json: small_models.q06_o_m4_speedup --> and 1.1x <!-- from figures/data/headline.json: small_models.q06_down_m4_speedup --> with 4 rows). On the wide products (q/k/v and gate/up merged, the LM head) it only ties,
# and with 8 rows cuBLAS comes within 9% of the kernel's best setting. `skinny.settings` writes that down as a rule
# (one row: up to 2048 output columns; 2-4 rows: up to 1024; otherwise cuBLAS; a later run added products
# whose K is at most 1024 up to 4096 columns, which takes the 0.6B model's merged q/k/v: the kernel, unlike
# cuBLAS, lets the attention kernel after it start early, and the step got a little faster), and the compiled step's
# graph gets one more pass after the sibling merge, `skinny.route`, which hands those `linear` calls to a
# custom operator, `minibatch::skinny_linear`, that picks the kernel or cuBLAS from the real row count.
# Whole decode steps, with the pass and without it, in one process (`floor_matrix.py --skinny-ab`):

# %%
print(f"{'model':17} {'batch':>5} {'floor':>6} {'cuBLAS':>13} {'with the kernel':>16}   (ms per step, x floor)")
for name in ("qwen3-0.6b-shape", "llama3-1b-shape"):
    for p in json.load(open(SMALL + f"floor_matrix_{name}.json"))["points"]:
        print(f"{name:17} {p['batch']:5d} {p['floor_ms']:6.2f} {p['cublas']['ms']:6.2f} ({p['cublas']['over_floor']:.2f}x)"
              f" {p['compile']['ms']:8.2f} ({p['compile']['over_floor']:.2f}x)")

# %% [markdown]
# The 0.6B step goes from 4.48x <!-- from figures/data/headline.json: small_models.q06_b1_cublas_x --> to 3.41x <!-- from figures/data/headline.json: small_models.q06_b1_skinny_x --> its floor at batch 1 and from 4.37x <!-- from figures/data/headline.json: small_models.q06_b4_cublas_x --> to 3.80x <!-- from figures/data/headline.json: small_models.q06_b4_skinny_x --> at batch 4; the 1B step, whose
# products are wider, gains little (1.79x <!-- from figures/data/headline.json: small_models.l1b_b1_cublas_x --> to 1.70x <!-- from figures/data/headline.json: small_models.l1b_b1_skinny_x --> at batch 1). What keeps the 0.6B step above 3x is no
# longer one slow product but the number of kernels: 348 <!-- from figures/data/headline.json: small_models.q06_b1_skinny_kernels --> per step, 12 per layer (two RMSNorms, four products,
# three for the q/k norms, rotary embedding and cache writes, the attention and its combine step, the
# activation), each taking 1.5-5 microseconds however few bytes it reads, against a floor of about 10 microseconds per
# layer. Going further means fewer, larger kernels (a whole layer in one, as the "megakernel" work on
# Llama-1B does), or kernels that overlap.

# %% [markdown]
# ### Kernels that start before the one before them ends
#
# Inside a CUDA graph, a kernel starts once the kernel before it has finished, and it then needs a
# moment to get going: its programs land on the multiprocessors, issue their first loads, wait for
# memory. With 350 kernels in a step those moments add up. Hopper GPUs can start a kernel *early*
# ("programmatic dependent launch"): it is launched while the previous one still runs, does whatever
# does not depend on it, then waits at `gdc_wait()` until the previous kernel's results are visible.
# The previous kernel says when its successor may launch (`gdc_launch_dependents()`).
#
# What can a kernel do before its input exists? Most of what it reads is not written by the kernel
# before it. skinny.py's kernel asks for its weights to be brought into the L2 cache (a `prefetch`
# instruction, one per 128-byte line) and only then waits for `x`; the decode attention does the same
# with the first cached keys and values of its rows (the key table is the step's input, written before the
# graph started). Inductor writes the wait and the launch signal into every kernel it generates when its
# `triton.enable_pdl` option is on, which the compiled step sets on such GPUs
# (`minibatch/speed/early.py`). Ours launch early only inside a compiled step, where the kernel before
# them is Inductor's and lets them: after an eager PyTorch kernel the prefetching would only add time.
# And ours let their successor launch after their main loop, not at their start, so that its waiting
# programs do not take places on the multiprocessors that our last programs still need (a choice made
# by reasoning: where both were timed, at batch 4, they took the same time).
#
# The same compiled step with and without early launches, in one process (`floor_matrix.py --variants
# late:triton.enable_pdl=0,early=0`):

# %%
PDL = DATA + "runs/gpu_small_models_pdl_2026-12-04/"
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for ax, name in zip(axes, ("qwen3-0.6b-shape", "llama3-1b-shape")):
    points = json.load(open(PDL + f"floor_matrix_{name}.json"))["points"]
    xs = range(len(points))
    for i, (path, label) in enumerate((("late", "each kernel after the one before"), ("compile", "launched early"))):
        ax.bar([x + 0.4 * i for x in xs], [p[path]["ms"] for p in points], width=0.4, label=label)
    ax.plot([x + 0.2 for x in xs], [3 * p["floor_ms"] for p in points], "k_", markersize=30, label="3x the floor")
    ax.set_xticks([x + 0.2 for x in xs], [f"batch {p['batch']}" for p in points])
    ax.set_title(f"{name}, context 512 (H200)", fontsize=10)
axes[0].set_ylabel("ms per decode step")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
fig.tight_layout(rect=(0, 0.08, 1, 1))
fig.savefig(f"{FIGURES}/07_small_model_early_launch_gpu.png", dpi=110)
print(f"{'model':17} {'batch':>5} {'floor':>6} {'not early':>14} {'early':>14}   (ms per step, x floor)")
for name in ("qwen3-0.6b-shape", "llama3-1b-shape"):
    for p in json.load(open(PDL + f"floor_matrix_{name}.json"))["points"]:
        print(f"{name:17} {p['batch']:5d} {p['floor_ms']:6.2f} {p['late']['ms']:7.2f} ({p['late']['over_floor']:.2f}x)"
              f" {p['compile']['ms']:7.2f} ({p['compile']['over_floor']:.2f}x)")

# %% [markdown]
# The 0.6B step is 0.12 <!-- from figures/data/headline.json: small_models_pdl.q06_b1_saved_ms --> ms shorter at batch 1 and 0.12 <!-- from figures/data/headline.json: small_models_pdl.q06_b8_saved_ms --> ms at batch 8: 3.40x <!-- from figures/data/headline.json: small_models_pdl.q06_b1_early_x -->, 3.51x <!-- from figures/data/headline.json: small_models_pdl.q06_b4_early_x --> and
# 3.36x <!-- from figures/data/headline.json: small_models_pdl.q06_b8_early_x --> its floor at batches 1, 4 and 8. Read that gain with care. Under the profiler, the step
# without early launches spent 0.12 <!-- from figures/data/headline.json: small_models_pdl.q06_b1_late_gaps_ms --> ms at batch 1 *between* kernels. Other compiles of the same step
# without early launches (BENCHMARKS.md) spent almost nothing there at batches 1 and 4, and ran as
# fast as the early one; at batch 8 every one of them had the gap and was 0.12-0.13 ms slower. So early
# launch takes away time between kernels where a step has it; it does not make the kernels faster, and
# the 0.6B step is still above 3x its floor. Inductor's "combo
# kernels" (small kernels that do not depend on each other, launched as one) took 28 kernels off the
# step and 0.03 ms at batch 1 (0.05 at batch 8), but with them the step at batch 4 took 1.50 ms against
# 1.19-1.20 without, so they stayed off until Inductor could time each combination (next section).

# %% [markdown]
# ### One kernel that ran alone, and kernels that share a launch
#
# The profiler's list of a 0.6B step's kernels (`floor_matrix.py --kernels top`) held one kernel that took
# 33 <!-- from figures/data/headline.json: small_models_combo.q06_b1_one_argmax_us --> microseconds, longer than any other but the LM head's product: the greedy
# step's `argmax` over 151,936 logits. Inductor compiles it into one reduction with one program per row,
# so at batch 1 a single program walks the whole vocabulary while the other 131 multiprocessors wait.
# Cut each row into pieces and the same question has many programs: the largest value of every piece
# and where it sits, then the first piece holding the largest of those. It is the same index, ties and
# NaN included, because `max` and `argmax` both answer with the *first* position of the largest value:

# %%
from minibatch.speed import wide_argmax

logits = torch.randint(-5, 5, (2, 151936), generator=torch.Generator().manual_seed(0)).float()  # many equal values
logits[0, [17, 5000, 90000]] = 9.0  # the largest value three times, in three pieces
logits[1, [151935, 1187]] = float("nan")  # NaN counts as the largest
width = wide_argmax.piece_width(logits.shape[-1])
print(f"pieces of {width}: {logits.shape[-1] // width} per row")
print("argmax:   ", logits.argmax(dim=-1).tolist())
print("two steps:", wide_argmax.two_step_argmax(logits, width).tolist())

# %% [markdown]
# `wide_argmax.split` is one more pass of the compiled step's backend: it rewrites every argmax over a
# last dimension of 16,384 or more that a piece width between 1,024 and 8,192 divides (no padding, so no
# copy of the logits).
#
# The second change is Inductor's own. Its *combo kernels* launch independent small kernels of a graph as
# one (the q and k norms with their rotary embedding, for one), and with `benchmark_combo_kernel` it times
# each combination against its parts and keeps only those that win. Without that timing, one combined
# reduction took 14-17 microseconds where its parts took 4, which is why batch 4 got slower before. With it,
# `CompiledStep` turns them on for static-row compiles on a GPU (`compiled.COMBO`). Each change was timed on
# the H200 against the same step without it, compiled in the same process (`floor_matrix.py --variants
# one_argmax:argmax=0`, and `separate:combo_kernels=0,benchmark_combo_kernel=0`):

# %%
COMBO = DATA + "runs/gpu_small_models_combo_2026-12-04/"
steps = [p for f in ("", "_b8") for p in json.load(open(COMBO + f"floor_matrix_qwen3-0.6b-shape{f}.json"))["points"]]
argmax_run = json.load(open(COMBO + "2_argmax_combo_bench_qwen3-0.6b-shape.json"))["points"]


def argmax_us(path, part):
    return 1e3 * sum(ms for name, ms, _ in path["kernels"]["top"] if part in name and name.startswith("other:"))


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
xs = range(len(steps))
for i, (path, label) in enumerate((("separate", "each kernel its own launch"), ("compile", "combined where faster"))):
    ax1.bar([x + 0.4 * i for x in xs], [p[path]["ms"] for p in steps], width=0.4, label=label)
ax1.hlines([3 * p["floor_ms"] for p in steps], [x - 0.2 for x in xs], [x + 0.6 for x in xs], colors="black",
           label="3x the floor")
ax1.set_xticks([x + 0.2 for x in xs], [f"batch {p['batch']}" for p in steps])
ax1.set_ylabel("ms per decode step")
ax1.set_title("qwen3-0.6b-shape step, context 512 (H200)", fontsize=10)
ax1.set_ylim(0, 1.25 * max(p["separate"]["ms"] for p in steps))
ax1.legend(fontsize=7, loc="upper left", ncol=2)
one = [argmax_us(p["one_argmax"], "argmax") for p in argmax_run]
two = [argmax_us(p["compile"], "_max_") + argmax_us(p["compile"], "argmax") for p in argmax_run]
for i, (values, label) in enumerate(((one, "one reduction"), (two, "two steps"))):
    ax2.bar([x + 0.4 * i for x in range(len(argmax_run))], values, width=0.4, label=label)
ax2.set_xticks([x + 0.2 for x in range(len(argmax_run))], [f"batch {p['batch']}" for p in argmax_run])
ax2.set_ylabel("microseconds per step")
ax2.set_title("the argmax over 151,936 logits", fontsize=10)
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_small_model_combined_kernels_gpu.png", dpi=110)
print(f"{'batch':>5} {'floor':>6} {'separate':>14} {'combined':>14} {'argmax: one':>12} {'two steps':>10}")
for p, a, b in zip(steps, one, two):
    print(f"{p['batch']:5d} {p['floor_ms']:6.2f} {p['separate']['ms']:7.2f} ({p['separate']['over_floor']:.2f}x)"
          f" {p['compile']['ms']:7.2f} ({p['compile']['over_floor']:.2f}x) {a:9.1f} us {b:7.1f} us")

# %% [markdown]
# The argmax drops from 33 <!-- from figures/data/headline.json: small_models_combo.q06_b1_one_argmax_us --> to 4.6 <!-- from figures/data/headline.json: small_models_combo.q06_b1_two_step_argmax_us --> microseconds at batch 1 (0.03 <!-- from figures/data/headline.json: small_models_combo.q06_b1_argmax_saved_ms --> ms off the step), and the combined
# launches take 28 <!-- from figures/data/headline.json: small_models_combo.q06_b1_kernels_fewer --> kernels and 0.05 <!-- from figures/data/headline.json: small_models_combo.q06_b1_saved_ms --> ms more off at batch 1. The step is now 3.17x <!-- from figures/data/headline.json: small_models_combo.q06_b1_combined_x -->, 3.37x <!-- from figures/data/headline.json: small_models_combo.q06_b4_combined_x --> and
# 3.18x <!-- from figures/data/headline.json: small_models_combo.q06_b8_combined_x --> its floor at batches 1, 4 and 8: closer, still not 3x. Timing each combination has a price,
# paid once per shape: the first call (compilation) took 39 <!-- from figures/data/headline.json: small_models_combo.q06_b1_compile_s --> s at batch 1 and 67 <!-- from figures/data/headline.json: small_models_combo.q06_b4_compile_s --> s at batch 4, against
# about 30 without. What is left is spread thin: the merged q/k/v and gate/up products take about 5
# microseconds each where their bytes would take 2-3, the attention and its combine step about 6 per layer
# for a few kilobytes of keys, and a dozen norms, rotary embeddings and cache writes 1-2 each. Each is
# a kernel that spends most of its life starting and finishing; fewer of them, each doing a whole layer's
# share, is where the rest would come from.

# %% [markdown]
# ### Half the threads for the attention, and four ideas that did not pay
#
# The attention kernel had run with Triton's default launch: 4 warps (128 threads) per program and a
# 3-deep pipeline of key chunks. At 4 to 64 rows each program reads only a few chunks of keys, so a deep
# pipeline has little to overlap, and a smaller program leaves room for one more on each multiprocessor
# (5 instead of 4, `scripts/experiments/kernel_resources.py`). That it is faster is a measurement, not a
# derivation: `scripts/experiments/decode_kernel_tune.py` times the kernel alone (every layer in one CUDA graph) at
# every launch setting; 2 warps and 2 stages came out ahead of the defaults at every point from 4 to 64
# rows, so that is what `triton_decode.warps_stages` now picks there (`triton_decode.LEAN`). Four other
# changes were built and timed the same way, each against the same compiled step in one process
# (`floor_matrix.py --variants`): the merged q/k/v and gate/up products on our few-row kernel
# (`widest=...`), the attention's split combined by its own last program instead of a second kernel
# (`fold=1`, since taken out of the code), and the 2048-input product in one piece with the carry-over as one compiled kernel
# (`one_piece=1, carry=1`, measured together with the first):

# %%
SWITCHES = DATA + "runs/gpu_small_models_switches_2026-12-05/"
tune = json.load(open(SWITCHES + "4_decode_kernel_tune_llama3-8b-shape.json"))["points"]


def lean_ms(p):
    """The kernel's time with 2 warps and 2 stages (per_sm 2, 64 keys a loop step) at one tuned point."""
    if p["shipped"]["warps"] == 2:
        return p["shipped_ms"]
    return next(t["ms"] for t in p["top5"] if (t["block_n"], t["warps"], t["stages"], t["per_sm"]) == (64, 2, 2, 2))


points = [p for p in tune if 4 <= p["rows"] <= 64]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
xs = range(len(points))
ax1.bar([x for x in xs], [p["defaults_ms"] for p in points], width=0.4, label="4 warps, 3 stages (Triton's defaults)")
ax1.bar([x + 0.4 for x in xs], [lean_ms(p) for p in points], width=0.4, label="2 warps, 2 stages")
ax1.set_xticks([x + 0.2 for x in xs], [f"{p['rows']} x {p['context']}" for p in points], fontsize=8)
ax1.set_xlabel("rows x keys")
ax1.set_ylabel("ms, 32 layers")
ax1.set_title("8B shape's decode attention alone (H200)", fontsize=10)
ax1.legend(fontsize=7)
runs = {p["batch"]: p for f in ("1_floor_matrix_qwen3-0.6b-shape_b1", "2_floor_matrix_qwen3-0.6b-shape_b4",
                                "2_floor_matrix_qwen3-0.6b-shape_b8")
        for p in json.load(open(SWITCHES + f + ".json"))["points"]}
lean = {p["batch"]: p for p in json.load(open(SWITCHES + "4_floor_matrix_qwen3-0.6b-shape_lean.json"))["points"]}
changes = [("merged products on our kernel", lambda b: runs[b]["wide"]["ms"] - runs[b]["compile"]["ms"]),
           ("combine folded in", lambda b: runs[b]["fold"]["ms"] - runs[b]["compile"]["ms"]),
           ("merged + one piece + carry-over (+ fold at batch 1)", lambda b: runs[b]["nofold" if b > 1 else "all"]["ms"] - runs[b]["compile"]["ms"]),
           ("2 warps, 2 stages", lambda b: lean[b]["compile"]["ms"] - lean[b]["defaults"]["ms"] if b in lean else 0.0)]
for i, (label, delta) in enumerate(changes):
    ax2.bar([x + 0.2 * i for x in range(3)], [1e3 * delta(b) for b in (1, 4, 8)], width=0.2, label=label)
ax2.axhline(0, color="black", linewidth=0.8)
ax2.set_ylim(-50, 175)  # (room for the legend above the bars)
ax2.set_xticks([0.3, 1.3, 2.3], ["batch 1", "batch 4", "batch 8"])
ax2.set_ylabel("microseconds per step (+ slower)")
ax2.set_title("qwen3-0.6b-shape compiled step, each change", fontsize=10)
ax2.legend(fontsize=7)
fig.tight_layout()
fig.savefig(f"{FIGURES}/07_small_model_switches_gpu.png", dpi=110)
print(f"{'batch':>5} " + " ".join(f"{label[:30]:>30}" for label, _ in changes) + "   (us per step against the same step without it)")
for b in (1, 4, 8):
    print(f"{b:5d} " + " ".join(f"{1e3 * delta(b):30.1f}" for _, delta in changes))

# %% [markdown]
# Two warps and two stages take the 0.6B step from 1.13 to 1.11 <!-- from figures/data/headline.json: small_models_switches.q06_b4_lean_defaults_ms, small_models_switches.q06_b4_lean_compile_ms --> ms at batch 4,
# and at batch 8 from 1.26 to 1.22 <!-- from figures/data/headline.json: small_models_switches.q06_b8_lean_defaults_ms, small_models_switches.q06_b8_lean_compile_ms --> ms: 3.21x <!-- from figures/data/headline.json: small_models_switches.q06_b4_lean_compile_x --> and 3.04x <!-- from figures/data/headline.json: small_models_switches.q06_b8_lean_compile_x --> its floor. At batch 1 the
# launch stays as it was; there the defaults were as fast. Of the other four, three stayed off behind
# their switches then and the fourth is gone from the code: folding the combine into the attention kernel made every step slower (at batch 4, 1.15 to 1.24 <!-- from figures/data/headline.json: small_models_switches.q06_b4_switches_compile_ms, small_models_switches.q06_b4_switches_fold_ms --> ms), and the kernel
# alone was slower wherever it splits the keys. The merged products on our own kernel saved 0.02 ms
# at batch 1 and cost as much at batch 8 (their products took longer there; why was not looked into);
# the product in one piece and the carry-over as one kernel moved the step by less than two compiles
# of the same step differ. What stands between the step and 3x its floor is the count of kernels,
# about 300 a step, each a few microseconds long.

# %% [markdown]
# ### Fewer kernels: the attention's small neighbours inside the attention kernel
#
# Between each layer's q/k/v product and its attention, a compiled step still runs two kernels of its
# own: one applies Qwen3's RMSNorm to every query and key head and then the rotary embedding, one
# writes the new key and value into the paged cache. Each moves a few hundred bytes per head, and
# each costs a launch: two of every layer's ten or so. The attention kernel already loads the row's
# query heads and walks its keys, so it can take q, k and v as their projections left them and do
# that work itself (`minibatch/model/fresh.py`): every program norms and rotates the query heads it
# serves; the cached keys are read as before, this step's cell left out; and one program per row and
# head computes the new key, writes it and the new value into the cache, and adds them to its running
# softmax sums like one more key. No program reads what another program of the same launch writes,
# and each product is rounded where the model's own ops round it, so on the CPU (where the operator
# runs the same steps as PyTorch ops) the logits and the cache are the layers' own, bit for bit:

# %%
from minibatch.core.batch import build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.model import fresh

qwen = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.bfloat16)
print("attention layers given the fresh forward:", fresh.install(qwen.hf))


def one_decode_step(enabled):
    """Three prompts through the layers' own forward, then one decode step with fresh.ENABLED on or off."""
    cache = qwen.make_cache(num_blocks=32, block_size=4)
    sched = Scheduler(cache.allocator, 256, 8)
    for i, n in enumerate((5, 11, 3)):
        sched.add(Request(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=4)))
    plan = sched.schedule()
    qwen.logits(build_batch(plan, cache), cache)
    sched.update(plan, [7, 8, 9])
    batch = build_batch(sched.schedule(), cache, 8, True, ROW_BUCKETS)  # the decode layout, as on a GPU
    fresh.ENABLED = enabled
    try:
        return qwen.logits(batch, cache), cache
    finally:
        fresh.ENABLED = False


own, own_cache = one_decode_step(False)
new, new_cache = one_decode_step(True)
print("decode rows:", new.shape[0], "| same logits, bit for bit:", torch.equal(own, new))
print("same cache, bit for bit:", all(torch.equal(a, b) for a, b in zip((*own_cache.keys, *own_cache.values),
                                                                      (*new_cache.keys, *new_cache.values))))

# %% [markdown]
# On a GPU the operator runs the Triton kernel instead (`tests/test_fresh.py` compares the two, and
# runs the kernel on the CPU too with Triton's interpreter). Timed on the H200 in the 0.6B compiled
# step (`scripts/gpu/floor_matrix.py --variants`, every path in one process), it removes 22-49 of
# the step's ~300 kernels, yet the attention kernel grows by about 4 microseconds a layer: every program
# now norms and rotates its query heads before walking the keys, and one program per row and head does
# the new key after. At 4 and 8 rows the step got 5% faster (1.19 to 1.13 ms, 1.32 to 1.26 <!-- from figures/data/headline.json: small_models_fresh.q06_b4_run1_compile_ms, small_models_fresh.q06_b4_run1_fresh_ms, small_models_fresh.q06_b8_run1_compile_ms, small_models_fresh.q06_b8_run1_fresh_ms -->), at one
# row 3% slower (0.95 to 0.98 <!-- from figures/data/headline.json: small_models_fresh.q06_b1_run1_compile_ms, small_models_fresh.q06_b1_run1_fresh_ms -->), in two runs each. A faster path at some batch sizes and a slower one
# at others is a common outcome of fusing: the work moved into one kernel now sits on its critical
# path. The way out is to take it off that path: when the keys are split over several programs, give
# the new key and value a program of their own, one more split with no cached keys to walk, so their
# chain of loads runs beside the loops instead of after the first one (`triton_decode.NEW_KEY_APART`).
# Timed the same way on a later day, that took the fresh step from 0.97 to 0.93 ms at one row and from
# 1.13 to 1.09 and 1.27 to 1.21 ms <!-- from figures/data/headline.json: small_models_apart.q06_b1_run2_fresh_ms, small_models_apart.q06_b1_run2_apart_ms, small_models_apart.q06_b4_run4_fresh_ms, small_models_apart.q06_b4_run4_apart_ms, small_models_apart.q06_b8_run4_fresh_ms, small_models_apart.q06_b8_run4_apart_ms --> at 4 and 8 rows, now a little faster than the default
# compiled step at every batch (0.94, 1.11 and 1.24 ms <!-- from figures/data/headline.json: small_models_apart.q06_b1_run2_compile_ms, small_models_apart.q06_b4_run4_compile_ms, small_models_apart.q06_b8_run4_compile_ms --> in the same runs). The same idea pushed further
# failed: letting the last program of each row and head combine the splits, instead of a second small
# kernel, made the step slower (0.93 to 0.97 ms <!-- from figures/data/headline.json: small_models_apart.q06_b1_run6_apart_ms, small_models_apart.q06_b1_run6_one_ms --> at one row), because that combine now waits for the
# slowest split and runs after it on one program. Timed once more beside the default step at every
# batch, with the 1B model too, it stayed 1-2% faster, and at four rows it showed a second reason to
# want it: the default compile's combined norm-and-rotary kernel, whose shape Inductor picks by timing
# it while compiling, came out at 5.6 instead of 2.2 microseconds a layer, and that step lost 0.09 ms
# (1.25 against fresh's 1.15 ms <!-- from figures/data/headline.json: small_models_gated_tiles.q06_b4_run7_compile_ms, small_models_gated_tiles.q06_b4_run7_fresh_ms -->). A kernel that is not there cannot be compiled badly. So the fresh
# path is on in the compiled steps of small models on a GPU (`fresh.IN_SMALL_COMPILES`: static rows,
# hidden size up to 2048, where it was timed); eager steps, the server's compile for any batch size
# and the 8B model keep the layers' own forward until it is timed there (`fresh.ENABLED` turns it on
# anywhere).
#
# A second experiment goes after the other small kernel of every half-layer: the residual add and
# RMSNorm before the q/k/v and gate/up products (`speed/prenorm.py`, since removed). Every program of our
# few-row product kernel reads the whole normalized row anyway, so it can add the two inputs, take the
# row's root mean square and scale each piece as it streams the weight; a graph pass finds the norm's
# eight ops in the compiled step and hands them to the kernel. It needs those wide products on our
# kernel, which its rule keeps on cuBLAS by default, so it is timed together with a wider rule, and
# that is what sank it: the norm kernels went, but at 4 and 8 rows the wide products ran 0.2-0.3 ms
# slower on our kernel than on cuBLAS, the whole step 1.20 and 1.43 ms <!-- from figures/data/headline.json: small_models_fresh.q06_b4_run1_prenorm_ms, small_models_fresh.q06_b8_run1_prenorm_ms -->.
#
# A third experiment asked the memory for weights before the products need them. The merged q/k/v and
# gate/up products on cuBLAS take about twice the time their bytes need, while the attention kernel
# before them waits on chains of small loads and leaves the memory idle. So each attention asked (PTX's
# `prefetch.global.L2`, a hint that returns nothing) for the weights of every product up to the next
# attention to be brought into the GPU's 50 MB L2 cache. The products did get faster, from 0.72 to 0.66 <!-- from figures/data/headline.json: small_models_prefetch.q06_b1_run3_apart_matmul, small_models_prefetch.q06_b1_run3_attn_matmul -->
# ms of matrix products a step at one row on an H100, but the attention kernel grew from 0.23 to 0.42 ms <!-- from figures/data/headline.json: small_models_prefetch.q06_b1_run3_apart_attention, small_models_prefetch.q06_b1_run3_attn_attention -->,
# and the step from 1.04 to 1.08 ms <!-- from figures/data/headline.json: small_models_prefetch.q06_b1_run3_apart_ms, small_models_prefetch.q06_b1_run3_attn_ms -->: the kernel that asked ran longer by nearly the time those
# bytes take to arrive at full bandwidth, so the wait moved instead of vanishing. Asking from a kernel of its own on a second stream, forked and
# joined inside the step's CUDA graph at every layer, lost too (0.93 to 1.05 ms <!-- from figures/data/headline.json: small_models_prefetch.q06_b1_run5_apart_ms, small_models_prefetch.q06_b1_run5_side_ms --> on the H200). Both
# are recorded in BENCHMARKS.md and their code removed.
#
# A later try took away the asking cost itself. Hopper has a bulk prefetch (PTX's
# `cp.async.bulk.prefetch.L2`): one instruction asks for a whole range of memory and returns at once, so
# each program of the attention asked for its share of the layer's output projection and MLP weights with
# a few instructions, before its own wait. The products barely noticed, 0.706 to 0.696 ms <!-- from figures/data/headline.json: small_models_l2_bulk.q06_b4_run4_compile_skinny_ms, small_models_l2_bulk.q06_b4_run4_l2_skinny_ms --> a step
# at 4 rows on an H100, while the attention grew from 0.246 to 0.308 ms <!-- from figures/data/headline.json: small_models_l2_bulk.q06_b4_run4_compile_decode_ms, small_models_l2_bulk.q06_b4_run4_l2_decode_ms -->: its own loads of keys and
# values now queued behind 23 MB of weights, and the step went from 1.13 to 1.19 ms <!-- from figures/data/headline.json: small_models_l2_bulk.q06_b4_run1_compile_ms, small_models_l2_bulk.q06_b4_run1_l2_ms -->. With its weights
# already in L2 a small product is hardly faster: its few microseconds are not the trip to memory, they are
# the cost of being a kernel of its own.
#
# Reading the compiler's output turned up a smaller waste. Every layer's call of the fresh operator reads
# the same rotary cos and sin, which the model computes once a step. But Inductor hands an operator each
# input in the strides it had when traced, and an input that is not yet a buffer gets a copy made for that
# call alone: the compiled 0.6B step computed cos and sin 28 times, in 7 kernels. Letting Inductor lay the
# inputs out as it liked made one buffer of each, but column by column, and the kernel read those more
# slowly than the copies had cost. What works is a layout rule of the operator's own
# (`fresh._shared_rotary`): make cos and sin buffers first, then ask every input for its traced order. At
# 8 rows the step went from 1.315 to 1.303 ms <!-- from figures/data/headline.json: small_models_rotary.q06_b8_run6_rotary0_ms, small_models_rotary.q06_b8_run6_compile_ms --> on an H100; at 4 rows the change was within the noise.
#
# The same reading found two more. The rotary angles themselves come from a matrix product with one term
# in its sum, positions times frequencies, which Inductor hands to cuBLAS as a kernel of its own that never
# starts early; as a plain multiply (`fx_edits.outer_products`: one rounding either way, so the same bits)
# it joins the kernel next to it, a few microseconds a step. And the first RMSNorm reads the token embedding
# through a gather, which hides from Inductor that the row it sums is contiguous; so that one norm, alone of
# all, was a looped kernel whose block sizes Inductor chose by timing while compiling: fast in one compile,
# three times as slow in another. Told to keep a few rows in registers whatever it knows
# (`compat.persistent_rows`), it is fast every time, and the 8-row step went from 1.296 to 1.292 ms <!-- from figures/data/headline.json: small_models_outer_splits.q06_b8_run5_compile_ms, small_models_outer_splits.q06_b8_run5_persistent_ms -->. A kernel whose speed depends on
# a measurement taken while compiling is a source of noise between runs as much as a cost.
#
# Smaller gains came from the product kernel's own settings. With four rows it took longer per product
# than with one; a likely reason is that every piece of K ends in a sum across the program's threads,
# and with four rows that sum has four times as many outputs. Keeping the products apart in registers
# and summing once after the loop (`skinny.DEFER`, for the down product's 3072 inputs), together with
# reading the attention output's 2048 inputs in one piece (`skinny.ONE_PIECE`), took fresh's step at 4
# rows from 1.20 to 1.16 ms <!-- from figures/data/headline.json: small_models_defer.q06_b4_run2_apart_ms, small_models_defer.q06_b4_run2_defer_ms --> on an H100, in one process. Both are on by default now.
#
# The last small kernel between two products is the MLP's activation, silu(gate) * up. Moving it into
# the down product had failed (every program had to compute all of it again), so it goes the other way:
# into the gate/up product (`minibatch/speed/gated.py`). Each program of our kernel reads the same output
# columns from the gate's rows and from the up projection's rows of the merged weight, keeps both sums,
# and writes only silu(gate) * up, rounded the way PyTorch's own two ops round it. Alone, the 28 gated
# products of a one-row step took 0.18 ms against 0.26 ms <!-- from figures/data/headline.json: small_models_gated.ab_gated_m1_kernel_ms, small_models_gated.ab_gated_m1_cublas_ms --> for cuBLAS's products plus the activation;
# in the default compiled step one row went from 1.04 to 1.00 ms <!-- from figures/data/headline.json: small_models_gated.q06_b1_run8_ungated_ms, small_models_gated.q06_b1_run8_compile_ms --> on an H100. With four rows the gated
# kernel (on tensor cores) was slower than cuBLAS's product inside the step and won only the kernel it
# removed (1.19 to 1.17 ms <!-- from figures/data/headline.json: small_models_gated.q06_b4_run8_ungated_ms, small_models_gated.q06_b4_run8_compile_ms -->). A step that is faster is still faster: by default it
# takes 1-8 rows (timed again on another H100: 1.19 to 1.17 ms <!-- from figures/data/headline.json: small_models_many_rows.q06_b4_run2_few_ms, small_models_many_rows.q06_b4_run2_compile_ms --> at four rows, 1.39 to 1.36 ms <!-- from figures/data/headline.json: small_models_many_rows.q06_b8_run3_few_ms, small_models_many_rows.q06_b8_run3_compile_ms --> at
# eight). That reopens the residual-add-and-norm experiment above: with the gate/up product on our
# kernel by default, the norm before it can go inside the gated product without moving any product off
# cuBLAS, so the pass learned to do that too. Timed, it lost again: the
# 28 norm kernels went, and the gated products, now reading two more inputs a piece, took longer than
# they saved (1.16 to 1.18 ms <!-- from figures/data/headline.json: small_models_gated_tiles.q06_b4_run2_compile_ms, small_models_gated_tiles.q06_b4_run2_norm_ms --> at four rows), and its code was removed. The gated kernel's own tiles did better: a wider search of
# its settings (128 inputs a piece, five pipeline stages) made the four-row product alone as fast as
# cuBLAS's (0.192 against 0.191 ms <!-- from figures/data/headline.json: small_models_gated_tiles.gated_b4_ms, small_models_gated_tiles.gated_b4_cublas_product_ms --> for 28), and it is the default now. What is left is the number of
# kernels itself.

# %% [markdown]
# ## 4. Where asynchrony helps most
#
# The async loop hides the host's work behind the device's. It helps most when the host's share of a
# step is large: small models (short steps) and small batches with short contexts. The sweep ran three
# model shapes x batch 1, 8, 32, 128 x mean context 512 and 2048, 64 new tokens, each point after a
# warm-up run of the same workload (`scripts/sweep.py`, H200, 2026-12-01, recorded in
# `gpu_sweep_2026-12-01.json`):

# %%
sweep = json.load(open(DATA + "gpu_sweep_2026-12-01.json"))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.4))
colors = {}
for (name, ctx) in dict.fromkeys((r["model"], r["context"]) for r in sweep):
    mine = [r for r in sweep if r["model"] == name and r["context"] == ctx]
    x = [r["batch"] for r in mine]
    style = dict(ls="-" if ctx == 512 else "--", marker="o", color=colors.get(name))
    line, = ax1.plot(x, [r["wall_ratio"] for r in mine], label=f"{name}, ctx {ctx}", **style)
    colors[name] = style["color"] = line.get_color()
    ax2.plot(x, [100 * r["async"]["device_busy"] for r in mine], **style)
ax1.axhline(1.0, color="gray", lw=0.8)
ax1.set(xscale="log", xlabel="batch size", ylabel="wall time, async / sync", title="lower is better", ylim=(0.6, 1.05))
ax2.axhline(99, color="gray", lw=0.8, ls=":")
ax2.set(xscale="log", xlabel="batch size", ylabel="device busy, async (%)", title="is the device kept busy?",
        ylim=(97, 100.2))
for ax in (ax1, ax2):
    ax.set_xticks([1, 8, 32, 128], ["1", "8", "32", "128"])
fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, title_fontsize=8,
           title="solid: context 512, dashed: context 2048")
fig.tight_layout(rect=(0, 0.2, 1, 1))
fig.savefig(f"{FIGURES}/07_sweep_gpu.png", dpi=110)
for r in sweep:
    print(f"{r['model']:17} batch {r['batch']:3} ctx {r['context']:4}: ratio {r['wall_ratio']:.2f}, busy "
          f"{r['sync']['device_busy']:.1%} -> {r['async']['device_busy']:.1%}")

# %% [markdown]
# Three things to read in it.
#
# * **The gain shrinks as steps grow.** The 1B shape gains most (0.73-0.76 at batch 1-32 with context
#   512, 0.70 <!-- from figures/data/headline.json: sweep.ratio_min --> at batch 1 with 2048): its steps are the shortest (16 layers, ~2.5 ms), so the host's work is a large share of
#   a synchronous step. Long contexts and large batches make prefill (which is the same in both loops)
#   most of the run, and the ratio goes towards 1.
# * **The async loop keeps the device busy at every point: 99.2-100% <!-- from figures/data/headline.json: sweep.busy_min_pct, sweep.busy_max_pct -->.** That takes prefill
#   steps that are CUDA graphs too (`core/graphs.py`, `graphs.pad_flat`): an eager prefill step of a
#   small model is bound by the host launching its kernels, so the device cannot run ahead of the
#   host and waits while the host prepares the next step (the small shapes are 97.8-98.8% busy with
#   eager prefill steps). Padded to bucketed sizes and replayed, prefill steps are queued like decode
#   steps.
# * **Size in parameters is not what sets a small model's step.** The 0.6B shape's decode step is
#   4-7 ms, longer than the 1B shape's: 28 layers make ~1400 small kernels per step, and their own
#   latency, not the bytes they read, sets the time. (The sweep's file also holds each run's median
#   decode step over a floor at the nominal batch; we do not plot it: where prefill takes many steps,
#   the first requests finish before the last start and decode steps run with fewer rows than the
#   nominal batch, so that ratio can even fall below 1. Section 3 measures steps at a fixed batch.)
#
# ## 5. Can we trust our busy fraction?
#
# Our timeline's "device busy" comes from CUDA events recorded around each stage of each step. A
# profiler sees something finer: each of the ~1700 kernels of a step. We ran the async loop under
# `torch.profiler` (`scripts/gpu/profile_async.py`) and compared:

# %%
print("".join(open(DATA + "gpu_profile_async_8b.txt").readlines()[:3]))

# %% [markdown]
# At the scale of steps they agree (98.8% <!-- from figures/data/headline.json: profile.timeline_busy_pct --> against 98.9% once gaps shorter than 1 ms are counted as
# busy). At the scale of kernels the device is busy 82.9% <!-- from figures/data/headline.json: profile.kernels_busy_pct --> of the time and idle 17% <!-- from figures/data/headline.json: profile.kernels_idle_pct -->, in gaps our events cannot see:
# about 6 points in gaps under 5 µs, the launch gaps between consecutive kernels of a replayed CUDA
# graph (section 3's kernel table: 0.58 ms of gaps in a 10.21 ms step); about 10 in gaps of 5 µs to 1 ms,
# between graph replays, around the copies and inside the eagerly run prefill steps (this profiled
# run is short, 64 new tokens, so its prefill weighs more), with the profiler's own overhead in all
# of them; the last point in a few longer gaps. Two measures, two questions: "does the device wait for the host?" (ours) and "is a
# kernel running?" (the profiler's). Fewer, bigger kernels (`torch.compile`) shrink the first kind
# of gap; the loop cannot.
#
# ## 6. What asynchrony costs: time to first token
#
# Users of async schedulers in production engines report a worse *time to first token* (TTFT). Where
# could it come from? The async loop plans batch N+1 before batch N's tokens are back, from a view of
# the requests one step old. In `minibatch` that view is enough to plan exactly the batches the sync
# loop plans (a finished request's seat is given back when its last token is planned, notebook 06),
# so a newcomer gets its first token from the same step in both loops. We check it on the CPU with
# requests arriving while the loop runs, counting steps (so the comparison does not depend on this
# machine's speed):

# %%
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer
prompts = [tok.encode(t) for t in ["The for statement", "A class definition", "Exceptions are raised",
                                   "The import system", "Assignment statements", "A string literal"] * 2]


def first_tokens(mode):
    """For each request: (steps completed, seconds since start) when its first token reached the host."""
    first, steps, t0 = {}, [], time.perf_counter()

    def on_step(plan, done):
        steps.append(plan.step)
        for c in plan.sampling_chunks:
            first.setdefault(c.request.rid, (len(steps), time.perf_counter() - t0))

    minibatch.generate(model, prompts, mode=mode, max_new_tokens=24, max_batch_size=4, max_batch_tokens=32,
                       arrival_steps=[3 * i for i in range(len(prompts))], on_step=on_step)
    return [first[i] for i in range(len(prompts))]


runs = {mode: first_tokens(mode) for mode in ("sync", "async")}
for mode, ttft in runs.items():
    print(f"{mode:5} first token after step:", [n for n, _ in ttft])

# %% [markdown]
# Same steps. In seconds, each step of the async loop is shorter on a GPU (no host gap), so its first
# tokens come sooner, not later. On a CPU the async loop is no faster (notebook 06, section 5), and
# this ratio, measured over a run of a second or so, swings with whatever else the machine does:
# from 0.57 to 1.59 over five back-to-back runs on a shared 2-core machine (the stored output below
# is one more run; `python scripts/ttft_cpu.py --runs 5` repeats it). Steps, not seconds, are the
# comparison that holds here:

# %%
# NBVAL_IGNORE_OUTPUT
ratio = sum(t for _, t in runs["async"]) / sum(t for _, t in runs["sync"])
print(f"mean time to first token, async / sync on this machine: {ratio:.2f}")

# %% [markdown]
# Where TTFT does suffer in production engines, it comes from what our small scheduler does not do:
# deeper pipelines than two batches, prefill deferred to keep decode steps short, or features that
# need a token on the host before the next step (such as structured output) and turn overlap off for
# some requests. Watch for it when you add any of those.
#
# ## 7. Rerun it on your GPU
#
# With a GPU present, this cell measures a small model in both modes, side by side. Without one it
# says so; the recorded results above are what we have.

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    gpu_model = minibatch.load_model("llama3-1b-shape", device="cuda")
    work = bench.random_prompts(32, 128, gpu_model.vocab_size)
    results = []
    for mode in ("sync", "async"):
        bench.run_mode(gpu_model, work, mode, 64)  # warm-up: graph captures
        results.append(bench.run_mode(gpu_model, work, mode, 64)[0])
    print(bench.format_table(results))
else:
    print("no GPU here: the recorded H200 results above are what we have")

# %% [markdown]
# ## 8. Where production engines do the same thing
#
# | idea (notebook) | transformers continuous batching | vLLM | SGLang |
# |---|---|---|---|
# | paged KV cache, block tables (01) | `PagedAttentionCache` | block manager | token-to-KV pool |
# | chunked prefill, mixed batches (01) | yes | yes | yes |
# | streams and events for H2D / compute / D2H (02-03) | `ContinuousBatchingAsyncIOs` | async scheduling | overlap scheduler |
# | two IO slots (04) | two host/device pairs, three events each | a batch queue of depth 2 | keeps the last 2 batches |
# | CUDA graphs, one pool (04) | one set per pair, one pool | yes | yes |
# | carry-over of sampled tokens (05) | placeholder + carry-over mask inside the graph | placeholder count, tokens scattered on the GPU | a slot-indexed future map |
# | the full async loop (06) | `use_async_batching` | `--async-scheduling` (default since 0.14) | default since 0.4 |
#
# (Facts gathered by the project on 2026-11-29 from those projects' code and documentation.) Users of those engines report the same
# trade-offs you met here: features that need the sampled token on the host before the next step
# (some penalties, structured output, speculative decoding) clash with overlap, and small models may
# gain nothing, because the host, not the device, is the bottleneck.
#
# ## Summary
#
# * Measure in one process, side by side, and report ratios with their spread.
# * On an H200 the asynchronous loop keeps the GPU 99-100% busy and cuts wall time by about a fifth
#   at batch 32 (ratio 0.79-0.81 <!-- from figures/data/headline.json: same_process.compile_ratio, same_process.ratio --> in one run, 0.84-0.85 <!-- from figures/data/headline.json: headline.sdpa_ratio, headline.triton_ratio --> with later, faster steps whose
#   sync loop idles less), with the same tokens as the synchronous loop; down to 0.70 <!-- from figures/data/headline.json: sweep.ratio_min --> for a
#   1B-shaped model, where the host's share of a step is larger.
# * A faster loop exposes the step: greedy argmax, fused attention and finer key buckets took the
#   8B decode step from 15.5 to 9.8 ms <!-- from figures/data/headline.json: decode_step.first_graphed_ms, decode_step.argmax_sdpa_64keys_ms -->; an attention kernel that reads the paged cache in place took
#   it to 8.5 ms <!-- from figures/data/headline.json: decode_step.triton_ms -->, torch.compile to 6.1 ms <!-- from figures/data/headline.json: decode_step.compile_ms --> and merging q/k/v and gate/up into one product each inside
#   the compiled graph to 5.4 ms <!-- from figures/data/headline.json: decode_step.merged_ms --> at batch 32 (the last three from whole runs, section 1's command): 1.16-1.41x <!-- from figures/data/headline.json: floor_matrix.compile_min, floor_matrix.compile_max --> the full floor (weights plus keys and values)
#   from 1 to 128 rows, bounded by the matrix products and by kernel count.
# * A small model's step is bound by its count of kernels, not its bytes. A few-row product kernel of our
#   own, early launches, combined kernels, a two-step argmax, the activation inside the gate/up product
#   and the attention's neighbours inside its kernel took the 0.6B compiled step at batch 1 from 4.48x <!-- from figures/data/headline.json: small_models.q06_b1_cublas_x --> its
#   floor (every product on cuBLAS, H200) to 2.26x <!-- from figures/data/headline.json: small_models_shipped.q06_b1_run3_compile_x --> on an H100 (2.34x and 2.33x <!-- from figures/data/headline.json: small_models_shipped.q06_b4_run3_compile_x, small_models_shipped.q06_b8_run3_compile_x --> at 4 and 8 rows); on the
#   H200, with its lower floor and before the last four small cuts, 2.90x <!-- from figures/data/headline.json: small_models_target_h200.q06_b1_run1_compile_x --> at one row, 3.03x <!-- from figures/data/headline.json: small_models_target_h200.q06_b4_run1_compile_x --> at 4 and 3.03x <!-- from figures/data/headline.json: small_models_target_h200.q06_b8_run1_compile_x --> at 8.
#   What is left is ~240 kernels a step, each a few microseconds long.
# * With a scheduler that plans the same batches in both loops, asynchrony costs no step of time to
#   first token; its known costs come with deeper pipelines and host-side features.
#
# ## Exercise
#
# A back-of-the-envelope model of section 1's ratio. Write `async_over_sync(host, device)` that takes
# each step's host time and device time (two lists of the same length) and returns the predicted wall
# time of the async loop divided by the sync loop's. The sync loop takes turns: each step costs host
# plus device. The async loop prepares step 0 on the host alone; from then on, while the device runs
# step n, the host prepares step n+1, and step n+1 starts on the device when both are done. Then try
# it: with the device busy 83% of a sync step, what ratio does it predict, and why can async never
# beat the sync loop's busy fraction?

# %%
async_over_sync = None  # replace with your function

# %%
import exercises

exercises.check_07(globals().get("async_over_sync"))

# %% [markdown]
# ## 9. When the host is slower than the device
#
# Overlap hides the host's work behind the device's; it cannot make it shorter. With perfect overlap a
# step of the asynchronous loop takes max(host, device): if preparing and updating a step takes the
# host longer than the device needs to run it, the device waits for its next batch every step.
#
#     host    ████████ prepare N+1 ████████ ████████ prepare N+2 ████████
#     device  ███ step N ███ ····idle······ ███ step N+1 ███ ····idle······
#
#     device busy <= device / max(host, device)
#
# Small models come close to this case. Their decode steps last a few milliseconds, and the host's
# work per step grows with the batch; an eager prefill step of a small model is as long as the host's
# launching of its kernels, which is why prefill steps are CUDA graphs too (section 4). The host's
# share grows with the batch: every
# running request is planned, its inputs and keys laid out, its token handed back, every step. Here
# is that work alone, without a model (the scheduler, `build_batch` and `update` for decoding
# requests with 256 tokens of context), for growing batches:

# %%
# NBVAL_IGNORE_OUTPUT
from minibatch.core.batch import build_batch
from minibatch.core.kv_cache import PagedKVCache
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler


def host_ms_per_step(rows: int, context: int = 256, steps: int = 20) -> float:
    """Median ms of one decode step's host work (plan, build, update) for `rows` decoding requests."""
    cache = PagedKVCache(1, 1, 1, rows * -(-(context + steps + 2) // 16), 16)  # storage is irrelevant here
    sched = Scheduler(cache.allocator, rows * context, rows)
    for i in range(rows):
        sched.add(Request(i, [1] * context, SamplingParams(max_new_tokens=steps + 2)))
    sched.update(sched.schedule(), [1] * rows)  # every prompt in one step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        build_batch(plan, cache)
        sched.update(plan, [1] * rows)
        times.append(time.perf_counter() - t0)
    return sorted(times)[steps // 2] * 1e3


host_ms = {rows: host_ms_per_step(rows) for rows in (1, 8, 32, 128)}
for rows, ms in host_ms.items():
    print(f"batch {rows:>3}: host work per step {ms / host_ms[1]:5.1f}x that of batch 1")

# %% [markdown]
# What that means for the device, for a device step of 4 ms and a host that needs 1 to 8 ms per
# step (the formula above, with perfect overlap):

# %%
device_ms = 4.0
for h in (1.0, 2.0, 4.0, 6.0, 8.0):
    step = max(h, device_ms)
    print(f"host {h:.0f} ms, device {device_ms:.0f} ms: async step {step:.0f} ms, device busy at most {device_ms / step:.0%}")

# %% [markdown]
# Below the crossing, shaving host time gains nothing; above it, every host millisecond is a device
# millisecond lost. The remedies attack the host's work per step, not the overlap: build each batch
# from what changed since the last one (a decode step moves each request by one token: `decode_keys.py`
# updates its key table by one cell per row instead of rebuilding it), keep per-request facts (the
# cells of its block table) instead of recomputing them, and vectorize what would be Python per row.
# `scripts/host_cost.py` times each part of the host's step; "Host cost per step, 2-core CPU" in
# `notes/benchmarks_history_2026-11-29_to_2026-12-02.md` has its numbers.
