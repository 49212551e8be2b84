# %% [markdown]
# # 06 · The full asynchronous loop
#
# **What you will learn:** how the pieces of notebooks 02 to 05 (streams, events, two IO slots,
# carry-over) fit into one loop in which the host prepares batch N+1 while the device runs batch
# N; how to read that loop's timeline, step by step; how to watch it live; and what it buys on
# this machine, measured side by side with the synchronous loop, and why the answer differs
# between a CPU and a GPU.
#
# **Time:** about 10 minutes (CPU or GPU).

# %%
import io
import os
import time
from functools import partial

import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display
from matplotlib.figure import Figure
from matplotlib.patches import Patch

import minibatch
from minibatch.core.batch import build_batch
from minibatch.core.carry_over import carry_over_mask
from minibatch.devices import get_device
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.core.slots import IOSlot
from minibatch.core.launch import forward_step, launch_step
from minibatch.core.timeline import Timeline

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer
EOS = tok.eos_token_id

# %% [markdown]
# ## 1. The loop, inline
#
# The synchronous loop of notebook 01 does, every step: prepare, launch, **wait**, update. The
# asynchronous loop changes the order: it prepares and launches batch N+1 *before* it waits for
# batch N. Everything else comes from the earlier notebooks:
#
# * two IO slots used in turn (notebook 04), so preparing batch N+1 never overwrites batch N's
#   buffers;
# * `launch_step` enqueues H2D, compute and D2H on three streams chained by the slot's events
#   (notebooks 02 and 03) and returns at once;
# * the compute work starts with carry-over (notebook 05): batch N+1 is planned while the host is
#   one step behind, so its decode inputs are placeholders that the device patches from batch N's
#   output;
# * the host blocks in exactly one place per step: `d2h_done.synchronize()` of batch N, right
#   before it hands batch N's tokens to their requests.
#
# The plan, as the docstring of `minibatch/core/async_loop.py` draws it:
#
# ```
# CPU      prep 0 │ prep 1 (B) │ wait 0 │ upd 0 │ prep 2 (A) │ wait 1 │ upd 1 │ prep 3 (B) …
# H2D      █A           █B                           █A
# compute    ███ batch 0 (A) ███ ███ batch 1 (B) ███ ███ batch 2 (A) ███ …
# D2H                           █A                  █B
# ```

# %%
def async_loop(model, prompts, max_new_tokens, budget=32, seats=4, seed=3, timeline=None):
    cache = model.make_cache(num_blocks=64, block_size=8)
    sched = Scheduler(cache.allocator, budget, seats)
    params = SamplingParams(0.7, max_new_tokens=max_new_tokens, eos_token_id=EOS)
    reqs = [Request(i, p, params.replace(seed=seed + i)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    tl = timeline if timeline is not None else Timeline()
    run = partial(forward_step, model, cache)  # device work: carry-over, forward, sample
    with get_device(str(model.device), tl) as dev:
        streams = (dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H"))
        slots = [IOSlot(dev, i, budget, cache.num_cells, seats) for i in (0, 1)]
        in_flight, n = None, 0  # (plan, slot) of the batch the device is running
        while sched.has_work():
            launched = None
            if sched.has_unplanned_work():
                slot = slots[n % 2]  # the slot the device is not using
                with tl.span("CPU", "prepare", sched.step, slot.index):
                    plan = sched.schedule()  # batch N+1: batch N's tokens are not known yet
                    if plan.chunks:
                        slot.load(build_batch(plan, cache), carry_over_mask(in_flight and in_flight[0], plan))
                if plan.chunks:
                    launch_step(run, streams, slot, in_flight and in_flight[1], plan.step)  # returns at once
                    launched, n = (plan, slot), n + 1
            if in_flight is not None:  # only now: wait for batch N, hand its tokens over
                plan_n, slot_n = in_flight
                with tl.span("CPU", "wait", plan_n.step, slot_n.index):
                    slot_n.d2h_done.synchronize(60)
                with tl.span("CPU", "update", plan_n.step, slot_n.index):
                    sched.update(plan_n, slot_n.sampled(len(plan_n.sampling_chunks)))
            in_flight = launched
    return [r.output for r in reqs], tl


texts = ["The for statement", "A class definition", "Exceptions are raised", "The import system",
         "Assignment statements", "A string literal"]
prompts = [tok.encode(t) for t in texts]
inline_out, _ = async_loop(model, prompts, max_new_tokens=40)
for t, o in zip(texts, inline_out):
    print(repr(t + tok.decode(o)))

# %% [markdown]
# `launch_step` returns before the device has done anything, so while the device computes, the
# host goes round the loop: it plans and loads the next batch into the other slot and launches it
# too. The device's compute stream then runs the two batches back to back, with no host round
# trip in between. Two details:
#
# * `has_unplanned_work()` can be false while requests are still running: at the end, when every
#   remaining token is already in flight, there is nothing to plan, and the loop only waits.
# * A request that reaches its length gives back its seat and KV blocks as soon as its last token is
#   *planned* (the scheduler knows the length in advance), so both loops admit newcomers at the same
#   step. A request that stops at EOS is a surprise: its seat comes back at the *update* of the step
#   that produced the EOS, one step later than in the synchronous loop, so a newcomer may wait one
#   more step, and a step can even come out empty.
#
# In the package, one turn of this loop, the body of our `while`, is `async_step` in
# `minibatch/core/async_loop.py`. `Engine.step` (`minibatch/core/engine.py`) runs one turn, and
# `minibatch.generate(..., mode="async")` builds an `Engine` whose `generate` calls `step` until
# every request has finished. Same scheduler, same slots, same carry-over: it must give the same
# tokens as our inline loop, and both the same as the synchronous loop (the sampling is seeded per
# request and per token, so the different batch shapes do not matter).

# %%
kw = dict(max_new_tokens=40, temperature=0.7, seed=3, eos_token_id=EOS, max_batch_tokens=32, max_batch_size=4,
          block_size=8)
pkg_async = minibatch.generate(model, prompts, mode="async", **kw)
pkg_sync = minibatch.generate(model, prompts, mode="sync", **kw)
assert inline_out == pkg_async == pkg_sync
print("inline async loop == minibatch.generate(mode='async') == minibatch.generate(mode='sync') ✓")

# %% [markdown]
# ## 2. The loop, traced step by step
#
# A small run: three prompts, five new tokens each. To make the order of events the same on every
# machine, we slow the emulated device down with an injected delay of 20 ms per step on its
# compute stream (`inject_delays`, which the engine hands to `launch_step` as the `delays` of
# notebook 04), as if it were a GPU running a large model: a device that is busy without needing
# the host's CPU. We record both loops' timelines.

# %%
small = [tok.encode(t) for t in ["The for statement", "A class", "Names"]]
traces = {}
for mode in ("sync", "async"):
    traces[mode] = Timeline()
    minibatch.generate(model, small, max_new_tokens=5, mode=mode, timeline=traces[mode], max_batch_tokens=16,
                       max_batch_size=3, eos_token_id=EOS, inject_delays={"compute": 0.02})

SLOT_NAMES = {0: "A", 1: "B", -1: "-"}


def host_order(tl):
    """The host's own spans, in the order it did them."""
    cpu = sorted((s for s in tl.spans if s.lane == "CPU"), key=lambda s: s.start)
    return " · ".join(f"{s.name} {s.step}" + (f" ({SLOT_NAMES[s.slot]})" if s.name == "prepare" else "")
                      for s in cpu)


def per_step(tl):
    compute = {s.step: s for s in tl.spans if s.name == "compute"}
    prepare = {s.step: s for s in tl.spans if s.name == "prepare"}
    for n, c in sorted(compute.items()):
        nxt = prepare.get(n + 1)
        if nxt is None:
            print(f"  step {n}: slot {SLOT_NAMES[c.slot]}; nothing left to prepare after it")
        else:
            when = "while the device was still on step" if nxt.end < c.end else "after the device finished step"
            print(f"  step {n}: slot {SLOT_NAMES[c.slot]}; host prepared step {n + 1} {when} {n}")


for mode, tl in traces.items():
    print(f"{mode}: host did  {host_order(tl)}")
    per_step(tl)

# %% [markdown]
# Read the host's order of work. The synchronous host does *prepare N · wait N · update N*, then
# starts on N+1: every prepare happens after the device has finished the previous step. The
# asynchronous host does *prepare 0 · prepare 1 · wait 0 · update 0 · prepare 2 · wait 1 · …*: it
# is always one batch ahead, so each prepare happens while the device still runs the step before,
# and the two slots alternate A, B, A, B. At the end there is nothing left to plan (step 5's
# tokens are all in flight), so the host just waits.
#
# ## 3. The timeline, drawn
#
# Now without any injected delay: the tiny model itself, eight prompts, 48 new tokens each. We draw
# both timelines the way the article does, one lane for the host and one per device stream, but
# coloured by **slot** (A blue, B orange) with the step number on each bar, over the same 50 ms
# window from step 20 on.

# %%
SLOT_COLOURS = {0: "#4C72B0", 1: "#DD8452"}
LANES = ("CPU", "H2D", "compute", "D2H")


def draw(spans, ax, start, end, title=""):
    """Gantt chart of spans between start and end (seconds), coloured by slot; grey = host waits, red = draws."""
    spans = [s for s in spans if s.end >= start and s.start <= end]
    for row, lane in enumerate(LANES):
        groups = {}  # one broken_barh call per lane and style: much cheaper than one per span
        for s in spans:
            if s.lane == lane:
                style = (0.35 if s.name == "delay" else 1.0, "///" if s.name == "update" else None)
                colour = {"wait": "#DDDDDD", "draw": "#C44E52"}.get(s.name, SLOT_COLOURS.get(s.slot, "#999999"))
                groups.setdefault(style, []).append(((s.start - start, s.duration), colour))
        for (alpha, hatch), bars in groups.items():
            ax.broken_barh([b for b, _ in bars], (row - 0.4, 0.8), facecolors=[c for _, c in bars], alpha=alpha,
                           hatch=hatch, edgecolor="white", linewidth=0.3)
    for s in spans:
        if s.name in ("prepare", "compute") and s.duration > 0.025 * (end - start):
            ax.text(s.start - start + s.duration / 2, LANES.index(s.lane), str(s.step), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_xlim(0, end - start)
    ax.set_title(title, loc="left", fontsize=10)


LEGEND = [Patch(color=SLOT_COLOURS[0], label="slot A"), Patch(color=SLOT_COLOURS[1], label="slot B"),
          Patch(facecolor="white", edgecolor="black", hatch="///", label="update"),
          Patch(color="#DDDDDD", label="host waits")]

texts8 = texts + ["The while statement", "Names refer to objects"]
work = dict(prompts=[tok.encode(t) for t in texts8], max_new_tokens=48, temperature=0.7, seed=3,
            eos_token_id=EOS, max_batch_tokens=64, max_batch_size=8)
timelines = {}
for mode in ("sync", "async"):
    timelines[mode] = Timeline()
    minibatch.generate(model, mode=mode, timeline=timelines[mode], **work)

fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
for ax, (mode, tl) in zip(axes, timelines.items()):
    t0 = next(s.start for s in tl.spans if s.name == "prepare" and s.step == 20)
    draw(tl.spans, ax, t0, t0 + 0.05, f"{mode} loop, tiny model on this CPU")
axes[1].set_xlabel("time (s)")
fig.legend(handles=LEGEND, loc="upper right", ncol=4, fontsize=8, frameon=False)
fig.tight_layout(rect=(0, 0, 1, 0.95))
fig.savefig(f"{FIGURES}/06_sync_vs_async_timeline_cpu.png", dpi=110)

# %% [markdown]
# (The figure stored with this notebook was drawn on a 2-core CPU; yours will differ in the
# details.) In the synchronous loop, each compute bar is followed by a gap: D2H, the host's
# update, its prepare of the next step and H2D, while the device does nothing. In the
# asynchronous loop the compute bars touch: batch N+1 is already on the device when batch N ends,
# and the host prepares step N+1 (in the other slot's colour) *under* compute N.
#
# Look at the widths, too: on this CPU an async compute bar can be longer than a sync one. The
# emulated device is a process on the same two cores as the host: while the host prepares, the
# device's forward pass gets a core only if nothing else on the machine wants it. More on that in
# section 5.
#
# ## 4. A live timeline
#
# `minibatch.generate(..., on_step=callback)` calls `callback(plan, finished)` on the host after
# each step's tokens are applied. We use it to redraw the timeline while the loop runs: each frame
# shows the last 12 steps. The tiny model's run above lasts a second or two, too short to watch, so
# this run generates 200 tokens per prompt, never stops at EOS, and slows the device down with an
# **injected delay of 40 ms per step** on the compute stream (a sleep, as in notebook 04: it needs no
# core, like a GPU's work): about 10 seconds in all. Drawing is not free (a tenth of a second or so
# here, more on a busy machine), and while the host draws it does not prepare the next batch, so
# after each drawing we wait at least ten times as long as it took (and half a second), which keeps
# drawing near a tenth of the run or less, and record each drawing as a `draw` span (red) on the
# host's lane, with its share of the run in the title. The frames replace each other in one output;
# when the run ends, the last frame stays there (also in the saved notebook).

# %%
DRAW_COLOUR = "#C44E52"
LIVE_LEGEND = LEGEND + [Patch(color=DRAW_COLOUR, label="host draws")]
live_fig = Figure(figsize=(10, 3.0))  # one figure, redrawn: not pyplot, so no figure piles up
live_ax = live_fig.subplots()


def frame(spans, title, last_steps=12):
    """A PNG of the spans of the last `last_steps` steps."""
    live_ax.clear()
    if spans:
        newest = max(s.step for s in spans)
        start = min(s.start for s in spans if s.step >= newest - last_steps)
        draw(spans, live_ax, start, max(s.end for s in spans), title)
    else:
        draw([], live_ax, 0.0, 0.1, title)
    live_ax.legend(handles=LIVE_LEGEND, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    live_fig.subplots_adjust(left=0.08, right=0.84, bottom=0.12, top=0.88)  # fixed layout: cheaper than tight
    buf = io.BytesIO()
    live_fig.savefig(buf, format="png", dpi=80)
    return Image(data=buf.getvalue())


live_tl = Timeline()
shown = display(frame([], "async loop, live: waiting for the first steps"), display_id=True)


def draw_share():
    """The share of the run so far that the host spent drawing."""
    spans = list(live_tl.spans)  # the device threads keep adding spans: a snapshot
    if not spans:
        return 0.0
    return sum(s.duration for s in spans if s.name == "draw") / (live_tl.now() - min(s.start for s in spans))


def on_step(plan, finished):
    start, spans = live_tl.now(), list(live_tl.spans)
    draws = [s for s in spans if s.name == "draw"]
    since = draws[-1].end if draws else min(s.start for s in spans)
    if start - since < max(0.5, 10 * draws[-1].duration if draws else 1.0):
        return  # wait at least 10 times as long as the last drawing took: drawing stays near 1/11 of the run
    shown.update(frame(spans, f"async loop, live: the last 12 steps up to step {plan.step}; "
                              f"drawing took {draw_share():.0%} of the run so far"))
    live_tl.add("CPU", "draw", start, live_tl.now(), plan.step)


longer = {**work, "max_new_tokens": 200, "eos_token_id": None}  # about 10 s with the delay below
live_out = minibatch.generate(model, mode="async", timeline=live_tl, on_step=on_step,
                              inject_delays={"compute": 0.04}, **longer)
assert live_out == minibatch.generate(model, mode="sync", **longer)  # the delay changes timing, not tokens
shown.update(frame(live_tl.spans, f"async loop, the last 12 steps of the run (final frame); "
                                  f"drawing took {draw_share():.0%} of it"))
frames = sum(s.name == "draw" for s in live_tl.spans)
# the rule keeps drawing near 1/11 of the run; a busy machine draws more slowly, so less often
assert live_tl.wall > 8 and frames >= 2 and draw_share() < 0.15, (live_tl.wall, frames, draw_share())
print("a run of ten seconds or so, redrawn every second or few; the final title says drawing's share")

# %% [markdown]
# A closer look at one drawing, from the recorded timeline: 50 ms either side of the last `draw`.

# %%
fig, ax = plt.subplots(figsize=(10, 2.2))
last_draw = [s for s in live_tl.spans if s.name == "draw"][-1]
draw(live_tl.spans, ax, last_draw.start - 0.05, last_draw.end + 0.05,
     f"async loop with a live plot: around the draw after step {last_draw.step}")
ax.legend(handles=LIVE_LEGEND, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
fig.tight_layout()

# %% [markdown]
# While the host draws (red), nothing new reaches the device: it finishes the one batch it had
# been given and then sits idle until the host comes back, prepares the next batch and launches
# it. An observer is never free: a real server records spans (cheap) and draws them somewhere else.
#
# ## 5. Sync and async, side by side, on this machine
#
# Same workload, both loops, in this process, on one engine (one device process). One run of each
# says little on a laptop or a shared machine: whatever else runs there moves the numbers by tens of
# percent. So we alternate them, sync then async, async then sync, five pairs, and look at each
# pair's wall-time ratio (async / sync), their median and their spread. First the tiny model as it
# is; then with the device slowed down by 5 ms per step, a sleep, which needs no core at all.

# %%
# NBVAL_IGNORE_OUTPUT
import statistics


def pairs(engine, n=5, **extra):
    ratios, busy = [], {"sync": [], "async": []}
    for i in range(n):
        runs = {}
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            tl = Timeline()
            t = time.perf_counter()
            out = engine.generate(mode=mode, timeline=tl, **work, **extra)
            runs[mode] = (time.perf_counter() - t, out)
            busy[mode].append(tl.device_busy())
        assert runs["sync"][1] == runs["async"][1]  # same tokens, whatever the timing
        ratios.append(runs["async"][0] / runs["sync"][0])
    return ratios, {m: statistics.median(b) for m, b in busy.items()}


print(f"{'device':30}{'busy sync':>10}{'busy async':>11}{'wall a/s: median':>18}{'spread':>14}")
with minibatch.Engine(model) as engine:
    engine.generate(**work)  # warm-up
    for name, extra in [("tiny model, emulated on CPU", {}),
                        ("+ 5 ms per step off the CPU", {"inject_delays": {"compute": 0.005}})]:
        ratios, busy = pairs(engine, **extra)
        print(f"{name:30}{busy['sync']:>10.0%}{busy['async']:>11.0%}{statistics.median(ratios):>18.2f}"
              f"{min(ratios):>8.2f}-{max(ratios):.2f}")

# %% [markdown]
# What we measured with `scripts/cpu_overlap.py` (seven or fifteen alternating pairs; the tiny model,
# 8 prompts x 48 new tokens; BENCHMARKS.md has the command and the machine) on a 2-core machine with
# nothing else running: medians of the async/sync ratio of 0.71 to 0.92 over eight runs, single pairs
# from 0.51 to 1.17, device busy from 75% (sync) to 96% (async), the same tokens; with other people's
# jobs on the same cores, medians of 0.85 to 1.0. Since the host's work per step became cheaper
# (below), 0.84 to 0.91 over three runs of fifteen pairs, with the sync loop busy 80-84%.
# The asynchronous loop is faster on a CPU,
# without any injected delay, because the emulated device is a **process of its own** (notebook
# 02): its forward pass runs on one core while the host prepares the next batch on the other.
#
# Why not more? The asynchronous loop can only hide what the synchronous loop spends *outside* the
# device's work. If a step keeps the device busy for the same time in both loops, then
#
#     async wall / sync wall  ~  (device busy, sync) / (device busy, async)
#
# Here a decode step costs the device about 4.5 ms (its forward pass), and everything else about 1 ms:
# the host's prepare and update (0.5 ms) plus copies, messages and waking up the other side. The sync
# loop therefore keeps the device busy about 80% of the time, and with the async loop at 96-97% the
# best we can hope for is about 0.8. The cheaper the host's work, the less there is to hide: making
# the host faster makes *both* loops faster, and the async one's advantage smaller. Two more things
# cost a little. The device does its own bookkeeping on its core (unpacking the next step's
# launches, copies, telling the host an event was reached): in the asynchronous loop that happens
# during a forward pass and lengthens it a little. And where the operating system is free to move
# processes between cores, it sometimes put the device's forward pass on the host's core (compute
# spans about 1.2 times longer); the device process is therefore pinned to the cores the host does
# not use first. On a busy machine a third program takes turns with our two processes: overlap pays
# only when there is a free core to overlap into. (With the older emulation, threads of one
# interpreter, the ratio was 0.89-1.05: the device's Python and the host's took turns holding the GIL.)
#
# With 5 ms of device time per step that needs no CPU (the injected delay is a sleep), the host's
# work hides under the device's even on a busy machine. That is the situation on a GPU: the GPU
# computes while the CPU is free to prepare the next batch.
#
# ## 6. On a real GPU
#
# The article measured, on an 8B model with batch 32: the GPU busy 76.0% of the time in the
# synchronous loop and 99.4% in the asynchronous one, 22% less wall time. We recorded
# `python -m minibatch bench --modes sync,async` on one H200 (Llama-3-8B shape with random
# weights, bfloat16, 32 prompts of 256 tokens, 256 new tokens each), once eager and once with CUDA
# graphs (2026-11-29, with the first version of the decode step), and later once more with the
# faster decode step of notebook 07 ("sdpa": gathered keys and SDPA attention, keys padded to 256,
# 2026-11-30); both are in `notes/benchmarks_history_2026-11-29_to_2026-12-02.md` ("Device layer,
# CUDA graphs, async loop" and "Sync vs async, the article's experiment"). None of them is today's default step (the Triton attention of notebook 07, since
# compiled and merged): the README's results table has its numbers, and the timelines' shape is the
# same. The timelines are committed as `figures/data/gpu_sync_*.json` and `gpu_async_*.json`, so the
# cell below redraws them without a GPU. On a GPU the device spans are timed with CUDA events, on
# the GPU's own clock.

# %%
RECORDED = {"eager": "eager, first decode step, 2026-11-29", "graphs": "CUDA graphs, first decode step, 2026-11-29",
            "sdpa": "CUDA graphs, gather + SDPA step, 2026-11-30"}  # (notebook 07 draws the other recordings)
for kind, what in RECORDED.items():
    name = f"{kind}_llama3-8b-shape_b32_256"
    gpu = {mode: Timeline.load(f"../figures/data/gpu_{mode}_{name}.json") for mode in ("async", "sync")}
    for mode, tl in gpu.items():
        steps = len({s.step for s in tl.spans if s.step >= 0})
        print(f"{kind} {mode:5}: device busy {tl.device_busy():.1%}, {steps} steps in {tl.wall:.1f} s")
    print(f"{kind}: async / sync wall time {gpu['async'].wall / gpu['sync'].wall:.2f}")
    fig, axes = plt.subplots(len(gpu), 1, figsize=(10, 2.1 * len(gpu)), sharex=True, squeeze=False)
    for ax, (mode, tl) in zip(axes[:, 0], sorted(gpu.items(), reverse=True)):
        steps = sorted({s.step for s in tl.spans if s.name == "prepare"})
        t0 = next(s.start for s in tl.spans if s.name == "prepare" and s.step == steps[len(steps) // 2])
        draw(tl.spans, ax, t0, t0 + 0.5, f"{mode} loop, 8B shape, b32, H200, {what} (a 0.5 s window)")
    axes[-1, 0].set_xlabel("time (s)")
    fig.legend(handles=LEGEND, loc="upper right", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(f"{FIGURES}/06_sync_vs_async_timeline_gpu_{name}.png", dpi=110)

# %% [markdown]
# With CUDA graphs we find the article's result: the GPU goes from about 80% busy to all but 100%,
# and the asynchronous loop needs about 0.8 of the synchronous loop's wall time (the article: 76.0%
# → 99.4%, 22% faster). With the faster step ("sdpa") both loops are faster and the ratio stays
# about 0.8: the host's gap per step in the sync loop was shorter in that run too (about 2.5 ms
# against 3.5 ms), so its share of a step stayed about the same. In the timeline the compute bars touch, and the host's prepare of step N+1
# sits under compute N.
#
# Eager, the asynchronous loop gains almost nothing, and both loops claim about 95% busy. Both
# come from what notebook 01 found: without graphs, the host launches hundreds of kernels one by
# one every step, and that takes longer than the GPU needs to run them. A compute span runs from
# the step's first kernel to its last, so it includes the GPU's waits between launches: "busy"
# then means "a step is in progress", not "computing". And overlap can only hide host work under
# device work that is longer; here the longest host work is the launching itself, which no
# reordering hides. Graphs remove the launch overhead; the asynchronous loop then hides the rest.

# %% [markdown]
# ## Summary
#
# * The asynchronous loop is the synchronous one with two lines swapped: launch batch N+1, *then*
#   wait for batch N. Two slots keep their buffers apart, events order the three streams, and
#   carry-over feeds batch N's tokens into batch N+1 on the device.
# * The host is one step ahead of the device and one step behind on tokens; the one host sync per
#   step is `d2h_done.synchronize()` of the previous batch.
# * It gives the same tokens as the synchronous loop, greedy or seeded sampling, EOS included.
# * The timeline shows the gain: back-to-back compute on the device lane. Whether that turns into
#   wall time depends on whether host and device compete for the same processor: on this CPU they
#   do; on a GPU they do not, and with CUDA graphs an H200 ran the asynchronous loop in 0.8 of the
#   synchronous loop's time, busy all but 100% of it.
# * Next, in **07**, the measurements: against the article, against transformers' own continuous
#   batching and against the hardware's limit.
#
# ## Exercise
#
# Write `compute_gaps(tl)` that takes a `Timeline` and returns, for each step N ≥ 1 in order, how
# long the device's compute lane sat idle between the end of step N-1's `compute` span and the start
# of step N's (in seconds, 0 if they touch or overlap). Use only spans named `"compute"`; the spans
# are not necessarily sorted. Then try it on `timelines["sync"]` and `timelines["async"]`.

# %%
compute_gaps = None  # replace with your function

# %%
import exercises

exercises.check_06(globals().get("compute_gaps"))
