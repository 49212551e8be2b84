# %% [markdown]
# # 04 · Race conditions, double-buffered slots, and CUDA graphs
#
# **What you will learn:** why preparing batch N+1 while the device runs batch N corrupts data when
# both use the same buffers; how two IO *slots* used in turn fix it; and why CUDA graphs then need
# one capture per slot, sharing one memory pool so that memory does not double.
#
# **Time:** about 15 minutes (CPU); the GPU numbers come from a recorded H200 run.

# %%
import json
import os

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.batching.buckets import bucket
from minibatch.devices import get_device
from minibatch.batching.buckets import KEY_BUCKETS, ROW_BUCKETS, TOKEN_BUCKETS
from minibatch.runner.graphs import StepRunner
from minibatch.timeline import Timeline

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer

# %% [markdown]
# ## 1. The race, in five lines
#
# The host fills a (pinned) buffer and launches a copy to the device on the H2D stream. The launch
# returns at once, so the host moves on and fills the same buffer with the *next* batch. If the copy
# has not run yet, it copies the wrong data. A copy normally runs within microseconds, so this bug
# shows up only now and then, when the stream happens to be busy; we make it happen every time by
# putting a delay on the H2D stream before the copy (`stream.sleep`), like a busy GPU would.

# %%
with get_device("cpu") as dev:
    h2d = dev.stream("H2D")
    host = dev.pin(torch.tensor([1, 1, 1, 1]))      # batch N's inputs
    on_device = dev.empty((4,), torch.int64)
    h2d.sleep(0.05)                                  # the stream is busy for a moment
    h2d.copy(on_device, host)                        # enqueue batch N's copy; returns at once
    host.copy_(torch.tensor([2, 2, 2, 2]))           # the host prepares batch N+1 in the same buffer
    h2d.synchronize(timeout=5)
    print("batch N on the device:", on_device.tolist(), "(should be [1, 1, 1, 1])")

# %% [markdown]
# The fix: two buffers, used in turn. Batch N+1 goes into the other one, and the host reuses a
# buffer only after the work that reads it is known to be done (an event, notebook 03).

# %%
with get_device("cpu") as dev:
    h2d = dev.stream("H2D")
    hosts = [dev.pin(torch.zeros(4, dtype=torch.int64)) for _ in range(2)]
    devs = [dev.empty((4,), torch.int64) for _ in range(2)]
    hosts[0].copy_(torch.tensor([1, 1, 1, 1]))
    h2d.sleep(0.05)
    h2d.copy(devs[0], hosts[0])                      # batch N from slot A
    hosts[1].copy_(torch.tensor([2, 2, 2, 2]))       # batch N+1 into slot B: nothing reads it yet
    h2d.copy(devs[1], hosts[1])
    h2d.synchronize(timeout=5)
    print("slot A on the device:", devs[0].tolist(), " slot B:", devs[1].tolist())

# %% [markdown]
# ## 2. The same race in the generation loop
#
# `minibatch` keeps all the tensors of one step in an `IOSlot` (`minibatch/batching/slots.py`): host
# buffers, device buffers, and the three events H2D-done, compute-done and D2H-done. The
# asynchronous loop of notebook 06 prepares batch N+1 while batch N runs; `generate` lets us run it
# with a single slot and an injected delay, to see what happens. Reference first: the synchronous
# loop, which never overlaps anything.

# %%
prompts = [tok.encode(t) for t in ["The for statement", "A class definition", "Exceptions are raised"]]
kw = dict(max_new_tokens=60, temperature=0.7, seed=3, eos_token_id=tok.eos_token_id, max_batch_tokens=64)
reference = minibatch.generate(model, prompts, mode="sync", **kw)
for o in reference:
    print(repr(tok.decode(o)))

# %% [markdown]
# Now one slot, with the H2D stream held up 30 ms before every copy. Each step's copy then runs
# after the host has already written the *next* step's inputs into the same host buffers:

# %%
# NBVAL_IGNORE_OUTPUT
tl_bad = Timeline()
broken = minibatch.generate(model, prompts, mode="async", num_slots=1, allow_races=True,
                            inject_delays={"H2D": 0.03}, timeline=tl_bad, **kw)
for o in broken:
    print(repr(tok.decode(o)))

# %%
print("same as the reference?", broken == reference)

# %% [markdown]
# Wrong text: the continuations changed and drift into nonsense words, because a step computed
# with the inputs (token ids, positions, cache cells) of another step. The timeline shows where.
# Step 0's copy waits 30 ms on the H2D stream; the host, free at once, prepares step 1 into the same
# slot, so when the copy finally runs it carries step 1's inputs (red label): step 0's forward pass
# reads step 1's token ids, positions and cache cells in the rows step 1 filled, the prompts' keys
# land in the wrong places of the KV cache, and every later token is sampled from that wrong cache. (With one slot the host also waits
# on the slot's one D2H-done event, which each launch records again; that keeps the later copies in
# step with their own inputs, but the damage of step 0 is done.) Which wrong tokens come out depends
# on timing; that they are wrong does not.

# %%
# NBVAL_IGNORE_OUTPUT
# which step's inputs did each copy carry? those of the last prepare that had finished writing the slot
prepares = sorted((s for s in tl_bad.spans if s.name == "prepare"), key=lambda s: s.end)
copies = sorted((s for s in tl_bad.spans if s.name == "H2D"), key=lambda s: s.start)
carried = {c.step: [p.step for p in prepares if p.end <= c.start][-1] for c in copies}
print("copies that carried another step's inputs:",
      {f"step {n}": f"step {k}'s inputs" for n, k in carried.items() if k != n})
t0 = prepares[0].start
t1 = [s for s in tl_bad.spans if s.name == "compute" and s.step == 2][0].end
t1 += 0.08 * (t1 - t0)
fig, ax = plt.subplots(figsize=(10, 3.0))
tl_bad.plot(ax=ax, start=t0, end=t1, step_labels=True,
            title="one slot, H2D delayed 30 ms (numbers: steps; labels: whose inputs each copy carried)")
for c in copies:
    if c.start <= t1:
        wrong = carried[c.step] != c.step
        ax.annotate(f"copy {c.step} carries step {carried[c.step]}", xy=(c.start - t0, 1.3), xytext=(-4, 0),
                    textcoords="offset points", ha="right", va="center", fontsize=8,
                    color="#C44E52" if wrong else "black", fontweight="bold" if wrong else "normal",
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"))
fig.tight_layout()
fig.savefig(f"{FIGURES}/04_one_slot_race_cpu.png", dpi=110)

# %% [markdown]
# Two slots, same delay: batch N+1 goes into the other slot, and the host comes back to a slot only
# after waiting for that slot's previous D2H-done event. Correct every time:

# %%
fixed = minibatch.generate(model, prompts, mode="async", num_slots=2, inject_delays={"H2D": 0.03}, **kw)
print("same as the reference?", fixed == reference)

# %% [markdown]
# The device side has the same hazard: with one slot, batch N+1's H2D copy can overwrite the
# device buffers that batch N's forward pass has not read yet. A delay on the compute stream makes
# that happen every time; two slots fix it too (`tests/test_races.py` checks both, on the CPU and
# on a GPU).

# %%
compute_bad = minibatch.generate(model, prompts, mode="async", num_slots=1, allow_races=True,
                                 inject_delays={"compute": 0.03}, **kw)
compute_ok = minibatch.generate(model, prompts, mode="async", num_slots=2, inject_delays={"compute": 0.03}, **kw)
print("one slot correct?", compute_bad == reference, "  two slots correct?", compute_ok == reference)

# %% [markdown]
# The price of two slots is double memory for the IO tensors, which is small: for 32 requests it is
# a few hundred kilobytes of indices, against gigabytes of weights and KV cache.
#
# ## 3. CUDA graphs, one per slot, in one memory pool
#
# On a GPU, an eager forward pass launches every kernel from Python, one by one. For an 8B model at
# batch 32 the H200 runs a decode step's kernels faster than the CPU can launch them
# (`BENCHMARKS.md`). A **CUDA graph** records the whole step once and replays it with one launch.
#
# A graph replays fixed kernels on fixed addresses with fixed shapes, so:
#
# * the step reads and writes only its slot's preallocated buffers: **one graph per slot**;
# * shapes come from **buckets**: decode steps are padded to a row count from `ROW_BUCKETS` and a
#   key length that is a multiple of a bucket (`model.decode_kv_bucket`: 64 keys on a GPU, 256 when
#   the step is compiled), and each (slot, rows, keys) gets its own graph, captured the first time
#   it comes up (`minibatch/runner/graphs.py`). A finer bucket pads less but needs more graphs;
#   notebook 07 measures what 64 instead of 256 saves. Prefill and mixed steps are padded too: their
#   tokens to a size from `TOKEN_BUCKETS`, the keys they read to one from `KEY_BUCKETS`, with
#   padding tokens that see only padding keys (`batch.pad_flat`). Their shapes repeat less than
#   decode steps' do, so a short first run can pay more for captures than it saves (`BENCHMARKS.md`);
# * all graphs share **one memory pool**: they never run at the same time, so the scratch memory of
#   one can be reused by the next.
#
# Which graph would a decode step of 13 requests, the longest at 700 tokens, use? And a prefill step?

# %%
rows, context, kv_bucket = 13, 700, 64
print("rows padded to", bucket(rows, ROW_BUCKETS), "| keys per row padded to",
      -(-(context + 1) // kv_bucket) * kv_bucket)
# and a prefill step of 1100 tokens that reads 5000 keys (at least one padding key is always added)
print("tokens padded to", bucket(1100, TOKEN_BUCKETS), "| keys padded to", bucket(5000 + 1, KEY_BUCKETS))

# %% [markdown]
# On the CPU there are no graphs: the same runner calls the step eagerly.

# %%
cache = model.make_cache(num_blocks=8, block_size=16)
print("CUDA graphs on this device:", StepRunner(model, cache).use_graphs)

# %% [markdown]
# ### Recorded on an H200
#
# The 8B-shaped model (bf16), 32 prompts of 256 tokens, 256 new tokens each, synchronous loop,
# eager and with graphs, from runs recorded with `python -m minibatch bench` (`BENCHMARKS.md`).

# %%
runs = {g: json.load(open(f"../figures/data/gpu_bench_{g}_llama3-8b-shape_b32_256.json")) for g in ("eager", "graphs")}
for g, run in runs.items():
    for r in run["results"]:
        print(f"{g:7} {r['mode']:6} {r['wall_s']:6.2f} s  {r['tokens_per_s']:6.0f} tok/s  busy {r['device_busy']:.0%}")
speed = runs["eager"]["results"][0]["wall_s"] / runs["graphs"]["results"][0]["wall_s"]
print(f"graphs make the sync loop {speed:.1f}x faster")

# %% [markdown]
# And the memory: reserved GPU memory grew by this much while capturing slot A's decode graph and
# then slot B's (`llama3-1b-shape`, 16 rows, 256-token contexts), with one shared pool and with a
# pool per graph:

# %%
pool = json.load(open("../figures/data/gpu_pool_memory.json"))
shared, separate = pool["shared_pool_bytes"], pool["separate_pools_bytes"]
print(f"shared pool:   slot A {shared[0] / 2**20:6.1f} MiB, slot B {shared[1] / 2**20:6.1f} MiB")
print(f"separate pools: slot B {separate[1] / 2**20:6.1f} MiB")
fig, ax = plt.subplots(figsize=(5, 2.6))
ax.bar(["slot A", "slot B\n(shared pool)", "slot B\n(own pool)"],
       [shared[0] / 2**20, shared[1] / 2**20, separate[1] / 2**20], color=["#8172B2", "#55A868", "#C44E52"])
ax.set_ylabel("MiB added by the capture")
ax.set_title("two slots' graphs in one pool cost about one")
fig.tight_layout()
fig.savefig(f"{FIGURES}/04_graph_pool_memory_gpu.png", dpi=110)

# %% [markdown]
# ## Summary
#
# * Overlapping host and device work creates two hazards on shared buffers: the host overwrites
#   inputs a pending copy has not read (host side), and a new copy overwrites inputs the device
#   has not used (device side). Injected delays make both happen every time.
# * Two IO slots used in turn, and a host that reuses a slot only after its D2H-done event, fix both.
# * CUDA graphs remove launch overhead; each slot needs its own graphs, and one shared pool keeps
#   their memory at about one graph's.
#
# ## Exercise
#
# A server runs decode steps one after the other, from slot A, slot B, slot A, ... Write
# `count_graphs(steps, kv_bucket)` that returns how many CUDA graphs a run captures, where `steps`
# lists each decode step's `(rows, longest_context)` in order. A graph is captured the first time
# its slot meets a shape, and replayed after that; the shape is the rows padded with
# `bucket(rows, ROW_BUCKETS)` and the keys per row (context plus the new token) rounded up to a
# multiple of `kv_bucket`.

# %%
count_graphs = None  # replace with your function

# %%
import exercises

exercises.check_04(globals().get("count_graphs"))
