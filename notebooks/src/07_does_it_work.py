# %% [markdown]
# # 07 · Does it work?
#
# **What you will learn:** how to measure an inference loop honestly (one process, side by side,
# ratios rather than raw times), what the asynchronous loop gains on a real GPU compared with the
# article, with transformers' own continuous batching and with the hardware's limit; what is still
# left on the table; what asynchrony costs (time to first token); and where production engines
# implement each idea of this workshop.
#
# **Time:** about 15 minutes. The GPU numbers are redrawn from runs recorded on an NVIDIA H200
# (`figures/data/`, `BENCHMARKS.md`); with a GPU present, one cell reruns a small measurement.

# %%
import json
import time

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch import bench
from minibatch.timeline import Timeline

torch.manual_seed(0)
DATA = "../figures/data/"

# %% [markdown]
# ## 1. The experiment
#
# The article ran an 8B model at batch 32 and reported the GPU busy 76.0% of the time with the
# synchronous loop and 99.4% with the asynchronous one, 22% less wall time (ratio 0.78). We ran the
# same shape of experiment, scaled to fit a short GPU session: a Llama-3-8B-shaped model with random
# weights in bfloat16, 32 prompts of 256 tokens, 256 new tokens each, greedy, with
# `python -m minibatch bench ... --modes sync,async --hf --floor`. One process runs every mode on
# the same prompts, so the ratios compare like with like.

# %%
run = json.load(open(DATA + "gpu_bench_vs_hf_llama3-8b-shape_b32_256.json"))
env = run["environment"]
print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, {env['model']} ({env['dtype']})")
print(f"{'run':8} {'wall s':>7} {'tok/s':>7} {'busy':>6}")
for r in run["results"]:
    busy = "" if r["device_busy"] != r["device_busy"] else f"{r['device_busy']:.0%}"  # NaN: not measured
    print(f"{r['mode']:8} {r['wall_s']:7.2f} {r['tokens_per_s']:7.0f} {busy:>6}")
sync, asyn, hf = run["results"]
print(f"\nasync / sync wall time: {asyn['wall_s'] / sync['wall_s']:.2f}   (article: 0.78)")
print(f"device busy: sync {sync['device_busy']:.1%} -> async {asyn['device_busy']:.1%}   (article: 76.0% -> 99.4%)")
print(f"minibatch async vs transformers generate_batch (default config): {asyn['tokens_per_s'] / hf['tokens_per_s']:.1f}x")

# %% [markdown]
# Three runs of this workload were recorded (BENCHMARKS.md); the async/sync wall ratio came out 0.80,
# 0.86 and 0.88. The async time was the same each time (4.47 s); the sync time moved. One run is not
# a measurement: look at the spread before believing the second digit.
#
# `generate_batch` ran with its default configuration, warm-up included; measured separately in
# its best configuration (sync + CUDA graphs) it reached 701 tok/s on this workload
# (measured by the project the same day on the same kind of machine, BENCHMARKS.md), so the honest
# comparison is about 2.6x, not the 4.6x of this table.
#
# ## 2. Where the time goes, step by step
#
# The recorded timelines hold one span per stage per step, on the device's clock. The article drew
# the GPU's activity over the whole run; here is the same picture: for each 50 ms window, the
# fraction of time the device was busy (the timelines of the second recorded run, whose sync run took
# 5.60 s).

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


timelines = {m: Timeline.load(DATA + f"gpu_{m}_graphs_llama3-8b-shape_b32_256.json") for m in ("sync", "async")}
fig, ax = plt.subplots(figsize=(9, 3))
for mode, tl in timelines.items():
    x, y = busy_curve(tl)
    ax.plot(x, y, label=f"{mode}: busy {tl.device_busy():.0%}, {tl.wall:.2f} s")
ax.set_xlabel("time since start (s)")
ax.set_ylabel("compute busy (50 ms windows)")
ax.set_ylim(0, 1.05)
ax.legend(loc="lower right")
ax.set_title("8B shape, batch 32, H200: the GPU over the whole run")
fig.tight_layout()
fig.savefig("../figures/07_busy_over_time_gpu.png", dpi=110)

# %% [markdown]
# The sync curve sits at about 0.8 for the whole decode phase: every step the GPU waits about 3.4 ms
# while the host prepares the next batch and reads back the tokens. The async curve stays at 1.
#
# ## 3. How far from the hardware's limit?
#
# A decode step must at least read every weight once. Pushing a batch of 32 rows through every
# linear layer of the model, all captured in one CUDA graph, took 5.17 ms on the H200
# (`bench.weight_floor_ms`). Our decode step:

# %%
floor = run["workload"]["weight_floor_ms"]
steps = [s.duration * 1e3 for s in timelines["async"].spans if s.name == "compute" and s.step > 20]
steps.sort()
step = steps[len(steps) // 2]
print(f"decode step (median compute span): {step:.1f} ms   weight-streaming floor: {floor:.2f} ms   "
      f"ratio {step / floor:.1f}x")

# %% [markdown]
# About 3x the floor. The loop is no longer the problem (the device is busy 100% of the time); the
# step itself is. What it spends the extra time on has not been profiled yet. Likely suspects, from
# the profile of the earlier eager version (`figures/data/gpu_profile_decode_step_8b.txt`): attention
# reads the keys and values through a gathered copy (`index_select`) instead of in place, in float32
# scores; sampling sorts the 128k-token vocabulary for every row even when decoding greedily; and
# dozens of small elementwise kernels per layer. Production engines use fused paged-attention
# kernels for the first and skip the sort for greedy rows.
#
# ## 4. What asynchrony costs: time to first token
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
# tokens come sooner, not later; on this CPU, where the async loop is no faster, they come at about
# the same time:

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
# ## 5. Rerun it on your GPU
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
# ## 6. Where production engines do the same thing
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
# * On an H200 the asynchronous loop keeps the GPU 100% busy and cuts wall time by 12-20% at batch
#   32, the article's effect, with the same tokens as the synchronous loop.
# * What is left is inside the step: about 3x the weight-streaming floor.
# * With a scheduler that plans the same batches in both loops, asynchrony costs no step of time to
#   first token; its known costs come with deeper pipelines and host-side features.
#
# ## Exercise
#
# Write `busy_fraction(spans)` that takes a list of `(start, end)` intervals (device spans, possibly
# overlapping) and returns the fraction of the whole time range, from the earliest start to the latest
# end, covered by at least one interval. This is how `Timeline.device_busy` counts.

# %%
busy_fraction = None  # replace with your function

# %%
import exercises

exercises.check_07(busy_fraction)
