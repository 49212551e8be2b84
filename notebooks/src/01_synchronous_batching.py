# %% [markdown]
# # 01 · Synchronous continuous batching
#
# **What you will learn:** how an inference server serves many requests with one model: requests
# and their states, the paged KV cache, the scheduler's token budget and chunked prefill, ragged
# batches, and the synchronous loop *prepare → H2D → forward + sample → D2H → update*. Then we
# record a timeline of that loop and see where the device sits idle.
#
# **Time:** about 15 minutes (CPU or GPU).

# %%
import os

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.core.batch import build_batch
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.core.timeline import Timeline

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer

# %% [markdown]
# ## 1. Why batch at all?
#
# Generating one token means pushing *all* the model's weights through the processor once. On a
# GPU that costs about the same for 1 request as for 32, because reading the weights from memory,
# not the arithmetic, is the slow part. So a server runs many requests together.
#
# The catch: requests arrive at different times, have prompts of different lengths and stop after
# different numbers of tokens. *Static* batching waits for the whole batch to finish; **continuous
# batching** re-forms the batch at every step: finished requests leave, waiting requests join.
#
# ## 2. Requests and their states
#
# A request moves WAITING → PREFILLING → DECODING → FINISHED. *Prefill* processes the prompt (many
# tokens in one go); *decode* makes one new token per step. How a request is continued (how many
# new tokens at most, which token ends it, greedy or sampled) is its `SamplingParams`: the one
# place those options are listed and checked, whether they come from `generate`, `submit` or an
# HTTP request (notebook 08).

# %%
texts = ["The for statement", "A class definition is an executable statement", "Names", "The import system"]
params = SamplingParams(max_new_tokens=12, eos_token_id=tok.eos_token_id)  # greedy: temperature 0
requests = [Request(i, tok.encode(t), params) for i, t in enumerate(texts)]
for r in requests:
    print(f"request {r.rid}: {len(r.prompt):2} prompt tokens, state {r.state.value}")

# %% [markdown]
# ## 3. The paged KV cache
#
# Each layer of the model stores a *key* and a *value* vector for every token it has seen, so that
# the next step does not recompute them. We keep them in one pool of fixed-size **blocks**; each
# request owns a list of blocks, its **block table**. Token `t` of a request lives in cell
# `block_table[t // block_size] * block_size + t % block_size`. No padding, no copying when a
# request grows.

# %%
cache = model.make_cache(num_blocks=24, block_size=8)
print(f"{cache.allocator.num_blocks} blocks of {cache.block_size} cells, "
      f"{len(cache.keys)} layers, {cache.nbytes / 1e6:.2f} MB")
sched = Scheduler(cache.allocator, max_batch_tokens=16, max_batch_size=3)
for r in requests:
    sched.add(r)

# %% [markdown]
# ## 4. The scheduler: one step's plan
#
# Every step the scheduler gives each decoding request one token, continues prefilling requests,
# and admits waiting ones, under two limits: a **token budget** (here 16 tokens per step) and a
# maximum number of running requests (here 3). A prompt longer than what is left of the budget
# is cut into chunks: **chunked prefill**.

# %%
def show(plan):
    parts = [f"r{c.request.rid}[{c.start}:{c.end}]{'→sample' if c.sample else ''}" for c in plan.chunks]
    print(f"step {plan.step}: {plan.num_tokens:2} tokens  " + "  ".join(parts))


plan = sched.schedule()
show(plan)
for r in requests:
    print(f"  request {r.rid}: {r.state.value:10} blocks {r.blocks}")

# %% [markdown]
# Request 0 (18 tokens with BOS) does not fit the 16-token budget: it gets its first 16 tokens now
# and the rest next step. The other requests wait, since the budget is spent. Request 0 already
# owns 4 blocks of 8 cells: room for its 18 prompt tokens and the 12 it may generate (`minibatch`
# reserves a request's whole need when it admits it, so it never runs out half-way).
#
# ## 5. A ragged batch
#
# The device sees one flat sequence: all chunks end to end, no padding. Besides the token ids it
# needs each token's position (for the rotary embeddings), the cache cell its key/value goes to,
# and which tokens' logits to sample from.

# %%
host = build_batch(plan, cache)
print("input_ids     ", host.input_ids.tolist())
print("positions     ", host.positions.tolist())
print("cell_mapping  ", host.cell_mapping.tolist())
print("logits_indices", host.logits_indices.tolist(), "(tokens that produce a new token)")
print("keys read     ", len(host.kv_indices), "cache cells")

# %% [markdown]
# Let us run this step and a few more, calling the model directly (on the CPU, host tensors are
# already "device" tensors), and watch the batch change: request 0 finishes its prompt and starts
# decoding, newcomers are admitted, their prompts are chunked to fit what is left of the budget,
# and prefill chunks and decode tokens share one batch.

# %%
for _ in range(5):
    tokens = model.next_tokens(build_batch(plan, cache), cache)  # forward + sample
    sched.update(plan, tokens.tolist())
    plan = sched.schedule()
    show(plan)

# %% [markdown]
# ## 6. The synchronous loop, inline
#
# Now the loop itself. Five stages per step; the host waits for each one to finish before starting
# the next. We time each stage with the host clock and keep the spans in a `Timeline`.

# %%
def sync_loop(model, prompts, max_new_tokens, budget=16, seats=3, timeline=None):
    cache = model.make_cache(num_blocks=48, block_size=8)
    sched = Scheduler(cache.allocator, budget, seats)
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id)
    reqs = [Request(i, p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    tl = timeline or Timeline()
    while sched.has_work():
        t = tl.now()
        plan = sched.schedule()                      # CPU: who runs, how many tokens each
        host = build_batch(plan, cache)              # CPU: flat host tensors
        tl.add("CPU", "prepare", t, t := tl.now(), plan.step)
        batch = host.to(model.device)                # H2D: inputs to the device
        tl.add("H2D", "H2D", t, t := tl.now(), plan.step)
        tokens = model.next_tokens(batch, cache)            # device: forward pass + sampling
        tl.add("compute", "compute", t, t := tl.now(), plan.step)
        sampled = tokens.cpu().tolist()              # D2H: new tokens back to the host
        tl.add("D2H", "D2H", t, t := tl.now(), plan.step)
        sched.update(plan, sampled)                  # CPU: append tokens, retire finished requests
        tl.add("CPU", "update", t, tl.now(), plan.step)
    return [r.output for r in reqs], tl


prompts = [tok.encode(t) for t in texts]
inline_out, tl = sync_loop(model, prompts, max_new_tokens=24)
for t, o in zip(texts, inline_out):
    print(f"{t!r:50} -> {tok.decode(o)!r}")

# %% [markdown]
# The package's version is `minibatch.generate(..., mode="sync")` (in `minibatch/core/sync_loop.py`).
# It must give the same tokens as our inline loop, and both must match Hugging Face `generate`
# run on one prompt at a time:

# %%
pkg_out = minibatch.generate(model, prompts, max_new_tokens=24, mode="sync", eos_token_id=tok.eos_token_id,
                             max_batch_tokens=16, max_batch_size=3)
assert pkg_out == inline_out
for p, o in zip(prompts, pkg_out):
    ref = model.hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
    assert o == ref
print("inline loop == minibatch.generate == Hugging Face generate ✓")

# %% [markdown]
# ## 7. Where does the time go?
#
# A bigger workload: 16 prompts, 4 running at once. We draw the recorded timeline as a Gantt chart:
# one lane for the CPU, one for each kind of device work.

# %%
# NBVAL_IGNORE_OUTPUT
work = [tok.encode(t) for t in ["The for statement", "A class definition", "Exceptions are raised",
                                "The import system", "Assignment statements", "A string literal",
                                "The while statement", "Names refer to objects"] * 2]
tl = Timeline()
minibatch.generate(model, work, max_new_tokens=32, timeline=tl, max_batch_tokens=32, max_batch_size=4,
                   eos_token_id=tok.eos_token_id)
totals = tl.totals()
print(f"device busy {tl.device_busy():.0%} of {tl.wall:.2f} s")
for name in ("prepare", "H2D", "compute", "D2H", "update"):
    print(f"  {name:8} {totals[name] / tl.wall:6.1%}")
print(f"  {'the rest':8} {1 - sum(totals[n] for n in ('prepare', 'H2D', 'compute', 'D2H', 'update')) / tl.wall:6.1%}"
      "  (launching, and the device's word coming back)")

# %%
fig, ax = plt.subplots(figsize=(10, 2.4))
mid = tl.spans[len(tl.spans) // 2].start
tl.plot(ax=ax, start=mid, end=mid + 0.25, title="sync loop on the CPU (a 0.25 s window)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/01_sync_timeline_cpu.png", dpi=110)

# %% [markdown]
# How to read it: the CPU lane holds the host's own work, prepare (blue) and update (green), and
# **wait** (grey): the host sitting in `synchronize`, doing nothing until the device says the step's
# tokens are back. The device lanes hold the copies and the forward pass. The five stages do not add
# up to the whole run: the rest, white in the figure, is the host *launching* the step's work (each
# launch is a message to the device, which is a process of its own, notebook 02) and the time the
# device's "done" takes to reach the host. On a GPU these are microseconds; on this emulated device a
# fraction of a millisecond each, and more when other programs share the cores.
#
# On the CPU the "device" runs on the second core of the same machine, and the tiny model's forward
# pass is cheap, so the host's share (prepare and update) is visible but not small.
#
# ## 8. The same loop on a real GPU
#
# We ran `python -m minibatch bench` with a Llama-3-8B-shaped model (random weights, bfloat16) on
# one NVIDIA H200: 32 prompts of 256 tokens, 256 new tokens each. The recorded timeline is
# committed under `figures/data/`, so we can redraw it here without a GPU. It is the project's
# first recording (H200, 2026-11-29; `notes/benchmarks_history_2026-11-29_to_2026-12-02.md`, "The
# first sync loop"): every step eager (no CUDA graphs),
# attention masked over every key of the batch, and each step's compute timed on the host's clock.
# Notebooks 02 to 07 use later recordings of the same workload, whose steps are many times shorter;
# this one is kept because it shows what the host clock hides.

# %%
gpu = Timeline.load("../figures/data/gpu_sync_llama3-8b-shape_b32_256.json")
g = gpu.totals()
print(f"H200, 8B shape, batch 32: {len(set(s.step for s in gpu.spans))} steps in {gpu.wall:.1f} s")
for name in ("prepare", "H2D", "compute", "D2H", "update"):
    print(f"  {name:8} {g[name]:6.2f} s  {g[name] / gpu.wall:6.1%}")
decode = sorted(s.duration for s in gpu.spans if s.name == "compute")
print(f"median compute span {1e3 * decode[len(decode) // 2]:.0f} ms per step")

# %%
fig, ax = plt.subplots(figsize=(10, 2.4))
s0 = [s for s in gpu.spans if s.step == 100 and s.name == "prepare"][0].start
gpu.plot(ax=ax, start=s0, end=s0 + 0.5, title="sync loop, 8B shape on an H200 (a 0.5 s window)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/01_sync_timeline_gpu.png", dpi=110)

# %% [markdown]
# Two things stand out.
#
# * The host's own work (prepare + update) takes about 6% of the time, and during it the GPU
#   does nothing. The article measured 24% idle time on its 8B setup; removing it is the goal of
#   the asynchronous loop (notebook 06).
# * The "compute" span is about 120 ms per step, while just streaming the 8B model's weights
#   through the H200 takes about 5 ms. Our spans are measured on the *host* clock: a compute span
#   covers the time the CPU spends **launching** hundreds of small GPU kernels, one by one, plus
#   the time the GPU runs them. A profile of one decode step of this version, taken on its own
#   (`figures/data/gpu_profile_decode_step_8b.txt`, notebook 02: 38 ms of wall time), shows about
#   50 ms of CPU launch work under the profiler against 21 ms of GPU kernel time. So the GPU is idle
#   far more than 6% of the time; the host clock just cannot see it. Notebooks 02 and 03 add
#   timing on the device's own clock (CUDA events), and notebook 04 removes launch overhead with
#   CUDA graphs.
#
# ## Summary
#
# * Continuous batching re-forms the batch every step: decode tokens first, then prefill chunks,
#   then newcomers, under a token budget.
# * The paged KV cache lets requests of any length share one pool of blocks.
# * The batch is ragged: one flat sequence plus index tensors (positions, cache cells, logits indices).
# * In the synchronous loop the host and the device take turns: whenever one works, the other waits.
#
# ## Exercise
#
# Write `ragged_layout(plan)` that returns two lists for one step's `BatchPlan`: the `positions` of
# every token of the flat batch, and the `logits_indices`, the places in the flat batch of the tokens
# whose logits produce a new token (section 5 printed both for one plan). Use only `plan.chunks`,
# each with `start`, `end` and `sample`. The check compares your lists with `build_batch`'s on every
# step of a run with chunked prefills and decodes.

# %%
ragged_layout = None  # replace with your function

# %%
import exercises

exercises.check_01(globals().get("ragged_layout"))
