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
from functools import partial

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.core.batch import build_batch
from minibatch.core.buckets import KEY_BUCKETS, ROW_BUCKETS, TOKEN_BUCKETS, bucket
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.core.slots import IOSlot
from minibatch.devices import get_device
from minibatch.core.graphs import StepRunner
from minibatch.core.launch import forward_step, launch_step
from minibatch.core.timeline import Timeline

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
# ## 2. The same race in a pipelined loop
#
# `minibatch` keeps all the tensors of one step in an `IOSlot` (`minibatch/core/slots.py`):
# host buffers that the device can read, device buffers, and the three events `h2d_done`,
# `compute_done` and `d2h_done`. `slot.load(batch, [])` writes a host batch (notebook 01's
# `build_batch`) into the slot's host buffers (the empty list is notebook 05's carry-over mask:
# nothing to carry here). `launch_step` (`minibatch/core/launch.py`) then enqueues the step
# exactly as notebook 03's pipeline did, and returns at once:
#
# ```
# H2D      copy the inputs ●h2d_done
# compute                  ╎wait  forward + sample ●compute_done
# D2H                                              ╎wait  copy the sampled ids ●d2h_done
# ```
#
# Its last argument, `delays`, makes a stream sleep before the step's work: the `stream.sleep` of
# section 1. The compute work is `forward_step`: notebook 01's forward pass and sampling, reading
# the slot's device buffers. (It also patches in tokens carried over from the step before, which is
# notebook 05's subject; here there are none.)
#
# With these pieces we build a small loop in which the host and the device overlap. To keep it to
# the point, its steps do not depend on each other: step *n* is the prefill of the *n*-th group of
# prompts and samples each prompt's next token, so the host can prepare step *n*+1 without knowing
# step *n*'s tokens (notebook 05 takes on a loop that needs them). Each turn, the host
#
# 1. prepares step *n*: plans it and loads it into slot *n* mod `num_slots`, while step *n*-1 may
#    still be on the device;
# 2. launches it;
# 3. only then waits for step *n*-1's `d2h_done`.
#
# The work: twelve prompts cut to their first 11 characters (the tiny model's tokenizer gives one
# token per byte, after a BOS token), two per group, so that every step has the same shape. The
# reference comes from the model called directly, one group after the other, as in notebook 01: no
# device and no streams, so nothing can overlap.

# %%
texts = ["The for statement", "A class definition", "Exceptions are raised", "The import system",
         "Assignment statements", "A string literal", "The while statement", "Names refer to objects",
         "Built-in functions", "The with statement", "Lambda expressions", "Comparisons yield"]
groups = [[tok.encode(t)[:12] for t in texts[i:i + 2]] for i in range(0, len(texts), 2)]


def plan_prefill(cache, group):
    """One step's plan: the whole prompt of every request in `group`, each sampling its next token."""
    sched = Scheduler(cache.allocator, max_batch_tokens=64, max_batch_size=len(group))
    for i, prompt in enumerate(group):
        sched.add(Request(i, prompt, SamplingParams(max_new_tokens=1)))
    return sched.schedule()


def show(tokens):
    """Each step's prompts (without BOS), each followed by the token sampled for it."""
    for n, (group, next_ids) in enumerate(zip(groups, tokens)):
        pairs = [f"{tok.decode(p[1:])!r} + {tok.decode([t])!r}" for p, t in zip(group, next_ids)]
        print(f"step {n}:  " + "   ".join(pairs))


cache = model.make_cache(num_blocks=32, block_size=8)
reference = [model.next_tokens(build_batch(plan_prefill(cache, g), cache), cache).tolist() for g in groups]
show(reference)

# %% [markdown]
# The loop. Besides the slots, it keeps a table `tokens` with one row per step: right after a
# step's own D2H copy, the D2H stream copies the step's sampled ids into its row as well (the stream
# runs the two copies in the order they were launched). The slot's output buffer is overwritten by
# the next step that uses the slot; the table keeps every step's tokens until the host reads them,
# at the end, so that what we compare is what each step computed.

# %%
def pipelined(groups, num_slots, delays=None, timeline=None):
    """Step n prefills groups[n]; the host prepares and launches step n before waiting for step n-1."""
    cache = model.make_cache(num_blocks=32, block_size=8)
    run = partial(forward_step, model, cache)  # the compute work of every step
    rows = len(groups[0])
    tl = timeline if timeline is not None else Timeline()
    with get_device("cpu", tl, inherit=(model,)) as dev:
        h2d, compute, d2h = streams = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
        slots = [IOSlot(dev, i, 64, cache.num_cells, rows) for i in range(num_slots)]
        tokens = dev.pin(torch.zeros(len(groups), rows, dtype=torch.int64))  # row n: step n's tokens
        for n, group in enumerate(groups):
            slot = slots[n % num_slots]
            with tl.span("CPU", "prepare", n, slot.index):
                slot.load(build_batch(plan_prefill(cache, group), cache), [])  # step n-1 may still run
            launch_step(run, streams, slot, None, n, delays)  # returns at once
            d2h.copy(tokens[n], slot.out_dev[:rows], name="D2H", lane="D2H", step=n, slot=slot.index)
            if n:
                previous = slots[(n - 1) % num_slots]  # with two slots, the one step n+1 will load
                with tl.span("CPU", "wait", n - 1, previous.index):
                    previous.d2h_done.synchronize(timeout=5)
        dev.synchronize(timeout=5)
        return tokens.tolist()


def prepared_early(tl):
    """The steps the host had prepared before the step launched just before them had computed."""
    prepared = {s.step: s for s in tl.spans if s.name == "prepare"}
    computed = {s.step: s for s in tl.spans if s.name == "compute"}
    return [n for n in sorted(prepared) if n - 1 in computed and prepared[n].end < computed[n - 1].end]

# %% [markdown]
# One slot, with the H2D stream held up 50 ms before every copy. What should the printout show? If
# the loop were right, the same next characters as the reference.

# %%
# NBVAL_IGNORE_OUTPUT
tl_bad = Timeline()
broken = pipelined(groups, 1, {"H2D": 0.05}, tl_bad)
show(broken)

# %%
print("same as the reference?", broken == reference)
print("steps whose tokens are wrong:", [n for n in range(len(groups)) if broken[n] != reference[n]])
print("step 0 came out with group 1's tokens:", broken[0] == reference[1])
print("steps prepared before the previous step had computed:", prepared_early(tl_bad))

# %% [markdown]
# Step 0 answered for the prompts of group 1: its forward pass ran on step 1's inputs. The timeline
# shows how. Step 0's copy waits 50 ms on the H2D stream; `launch_step` returned at once, so the host
# went on and prepared step 1 into the same slot, and when the copy finally ran it carried step 1's
# inputs (red label). Every later step is right, but only because the loop stopped overlapping: the
# slot has a single `d2h_done`, and launching step 1 recorded it again, so the host's wait "for step
# 0" ended only when step 1 was done. From then on the host prepares step *n*+1 only after step *n*
# has finished (the last line above: only step 1 was prepared early, and that is the step that did
# the damage). With one slot the loop is either wrong or no faster than the synchronous loop.

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
            title="one slot, H2D delayed 50 ms (numbers: steps; labels: whose inputs each copy carried)")
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
# Two slots, same delay: step *n*+1 goes into the other slot. And the slot the host loads next is
# always the one step *n*-1 used, whose `d2h_done` it has just waited for: the host comes back to a
# slot only after that slot's previous step is done with it, so nothing reads it any more. Right
# every time, and now the host prepares every step while the one before it is still on the device:

# %%
tl_ok = Timeline()
fixed = pipelined(groups, 2, {"H2D": 0.05}, tl_ok)
print("same as the reference?", fixed == reference)
print("steps prepared before the previous step had computed:", prepared_early(tl_ok))

# %% [markdown]
# The device side has the same hazard: with one slot, step *n*+1's H2D copy can overwrite the
# device buffers that step *n*'s forward pass has not read yet. A delay on the compute stream makes
# that happen every time (the copies are not delayed now: step 1's lands while step 0's forward pass
# is still held up); two slots fix it too:

# %%
compute_bad = pipelined(groups, 1, {"compute": 0.05})
compute_ok = pipelined(groups, 2, {"compute": 0.05})
print("one slot correct?", compute_bad == reference,
      " (step 0 came out with group 1's tokens:", str(compute_bad[0] == reference[1]) + ")")
print("two slots correct?", compute_ok == reference)

# %% [markdown]
# The asynchronous loop of notebook 06 uses the same two slots in the same order: prepare and launch
# step *N*+1, then wait for step *N*. Its steps do depend on each other, since step *N*+1 continues
# the requests of step *N* with the tokens step *N* samples; notebook 05 shows how the device fills
# those in. `tests/test_races.py` checks both races, and both fixes, in that loop, on the CPU and on
# a GPU.
#
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
#   it comes up (`minibatch/core/graphs.py`). A finer bucket pads less but needs more graphs;
#   notebook 07 measures what 64 instead of 256 saves. Prefill and mixed steps are padded too: their
#   tokens to a size from `TOKEN_BUCKETS`, the keys they read to one from `KEY_BUCKETS`, with
#   padding tokens that see only padding keys (`graphs.pad_flat`). Their shapes repeat less than
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
# eager and with graphs, from runs recorded with `python -m minibatch bench` on 2026-11-29
# (`notes/benchmarks_history_2026-11-29_to_2026-12-02.md`).

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
#   With one slot a pipelined loop is either wrong or, once it waits, no faster than the synchronous
#   loop.
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
