# %% [markdown]
# # 03 · CUDA events: ordering work without stopping the host
#
# **What you will learn:** the three things you can do with an event (*record* a marker in a
# stream, make another stream *wait* for it, make the host *synchronize* on it); how events turn
# notebook 02's broken pipeline into a correct one, every time; that the host is then free while the
# device works; and why that alone does not make generation faster: the synchronous loop still
# waits for each step's tokens before it can build the next batch, and the GPU sits idle meanwhile.
#
# **Time:** about 10 minutes (CPU); the GPU timeline comes from a recorded H200 run.
#
# Notebook 02 ended with three streams that each ran their work before the work they depended on:
# the compute stream doubled an input that had not arrived, the D2H stream copied a result that did
# not exist yet, and the host read garbage. Streams order work *within* a stream; an **event** orders
# work *across* streams.

# %%
import os
import queue
import threading
import time

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.devices import get_device
from minibatch.core.timeline import Timeline

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer

# %% [markdown]
# ## 1. An event, inline
#
# An event is a marker that a stream *reaches*:
#
# * `stream.record(event)` puts the marker in the stream's queue; the event is reached when the
#   stream gets there, i.e. when all the work launched on that stream before it has run;
# * `other.wait(event)` puts a hold in *another* stream's queue: that stream stops there until the
#   event is reached. The **stream** waits; the host does not, it returns at once;
# * `event.synchronize()` makes the **host** wait until the event is reached (`event.query()` only
#   asks).
#
# Notebook 02's `TinyStream` gets the first two in two lines each, with Python's `threading.Event`
# as the marker:

# %%
class TinyStream:
    """An ordered queue of work and one worker thread that runs it (notebook 02), plus events."""

    def __init__(self):
        self.todo = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def launch(self, fn, *args):
        self.todo.put((fn, args))

    def record(self, event):
        self.launch(event.set)  # reached when the worker gets here

    def wait(self, event):
        self.launch(event.wait)  # the *worker* blocks here until the event is reached; the host does not

    def _work(self):
        while True:
            fn, args = self.todo.get()
            fn(*args)
            self.todo.task_done()


log = []


def kernel(name, seconds):
    """Stand-in for a GPU kernel (notebook 02): keeps the stream busy, then notes that it ran."""
    time.sleep(seconds)
    log.append(f"device: {name} done")


a, b = TinyStream(), TinyStream()
ready, done = threading.Event(), threading.Event()
a.launch(kernel, "produce", 0.2)
a.record(ready)
b.wait(ready)
b.launch(kernel, "consume", 0.05)
b.record(done)
log.append(f"host:   launched everything; done reached yet? {done.is_set()}")
done.wait(5)  # synchronize: now the host waits
log.append(f"host:   synchronized on done; reached? {done.is_set()}")
print("\n".join(log))
inline_log = list(log)

# %% [markdown]
# `consume` was launched on stream b right away, but ran only after `produce` on stream a, and the
# host was back before either ran. (A CUDA event can be recorded again and again, each record
# moving the marker; a `threading.Event` is set once. Enough for one pipeline.)
#
# ### The package version
#
# `dev.event()` makes an event; `stream.record(ev)`, `stream.wait(ev)`, `ev.query()` and
# `ev.synchronize(timeout=...)` do the rest. On a GPU they are `torch.cuda.Event.record`,
# `torch.cuda.Stream.wait_event`, `Event.query` and `Event.synchronize`. Same experiment, same story
# (on `"cpu-threads"`, since `kernel` writes to the host's `log`; notebook 02 says why):

# %%
log = []
with get_device("cpu-threads") as dev:
    a, b = dev.stream("a"), dev.stream("b")
    ready, done = dev.event(), dev.event()
    t0 = time.perf_counter()
    a.launch(kernel, "produce", 0.2)
    a.record(ready)
    b.wait(ready)  # stream b holds here; the host goes on
    b.launch(kernel, "consume", 0.05)
    b.record(done)
    host_back = time.perf_counter() - t0
    log.append(f"host:   launched everything; done reached yet? {done.query()}")
    done.synchronize(timeout=5)
    log.append(f"host:   synchronized on done; reached? {done.query()}")
print("\n".join(log))
assert log == inline_log
print("same order of events as the inline version ✓")
print("the host got back before produce had finished:", host_back < 0.2)

# %% [markdown]
# ## 2. The pipeline of notebook 02, with events
#
# The article's recipe: the H2D stream copies the input and records `h2d_done`; the compute stream
# waits for `h2d_done`, computes and records `compute_done`; the D2H stream waits for
# `compute_done`, copies and records `d2h_done`; the host synchronizes on `d2h_done`, and only when
# it needs the result.
#
# ```
# host     launch ×3, returns ──────────────────────────────── sync(d2h_done) ─ read
# H2D      ██copy██ ●h2d_done
# compute           ╎wait ███ compute ███ ●compute_done
# D2H                                    ╎wait ██copy██ ●d2h_done
# ```
#
# One function runs it with or without the events, with the streams as busy as in notebook 02
# (injected delays: D2H 0.1 s, compute 0.2 s, H2D 0.3 s) and the same stale buffers:

# %%
expected = [2 * i for i in range(1, 9)]


def run_pipeline(dev, with_events):
    """Copy 1..8 in, double it, copy it out; each stream busy with earlier work first."""
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    h2d_done, compute_done, d2h_done = dev.event(), dev.event(), dev.event()
    host_in, host_out = dev.pin(torch.arange(1, 9)), dev.pin(torch.full((8,), -1))
    dev_in, dev_out = dev.empty((8,), torch.int64), dev.empty((8,), torch.int64)
    dev_in.fill_(0)  # left over from an earlier batch
    dev_out.fill_(99)
    for stream, delay in ((d2h, 0.1), (compute, 0.2), (h2d, 0.3)):
        stream.sleep(delay, lane=stream.name)  # busy with earlier work
    h2d.copy(dev_in, host_in, name="H2D", lane="H2D")
    h2d.record(h2d_done)
    if with_events:
        compute.wait(h2d_done)  # the input must have landed
    compute.launch(lambda: torch.mul(dev_in, 2, out=dev_out), name="compute", lane="compute")
    compute.record(compute_done)
    if with_events:
        d2h.wait(compute_done)  # the result must exist
    d2h.copy(host_out, dev_out, name="D2H", lane="D2H")
    d2h.record(d2h_done)
    if with_events:
        d2h_done.synchronize(timeout=5)  # the host waits here, and only here
    result = host_out.tolist()
    dev.synchronize(timeout=5)  # (so that the next run starts on an idle device)
    return result


with get_device("cpu") as dev:
    print("expected         ", expected)
    print("without events   ", run_pipeline(dev, with_events=False))
    for run in range(5):
        print(f"with events, run {run}", run_pipeline(dev, with_events=True))

# %% [markdown]
# Right, five times out of five, with the streams as busy as when it failed. The timelines of one
# run each way:

# %%
timelines = {}
for with_events in (False, True):
    timelines[with_events] = Timeline()
    with get_device("cpu", timelines[with_events]) as dev:
        run_pipeline(dev, with_events)
    order = [sp.name for sp in sorted(timelines[with_events].spans, key=lambda sp: sp.start) if sp.name != "delay"]
    print(f"{'with' if with_events else 'without'} events, the device ran:", " → ".join(order))



def mark_work(ax, tl):
    """Timeline.plot draws spans to scale; copies and a doubling of 8 numbers take microseconds: mark them."""
    t0 = min(sp.start for sp in tl.spans)
    rows = {"H2D": 0, "compute": 1, "D2H": 2}
    labels = {"H2D": "copy in", "compute": "double", "D2H": "copy out"}
    for sp in tl.spans:
        if sp.name != "delay":
            ax.plot([sp.start - t0], [rows[sp.lane]], marker="v", color="black")
            ax.annotate(labels[sp.name], (sp.start - t0, rows[sp.lane]), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=8)


fig, axes = plt.subplots(2, 1, figsize=(9, 3.8), sharex=True)
for ax, with_events, title in ((axes[0], False, "without events (notebook 02): each stage runs before its input exists"),
                               (axes[1], True, "with events: compute waits for h2d_done, D2H for compute_done")):
    tl = timelines[with_events]
    tl.plot(ax=ax, end=max(sp.end for sp in tl.spans) + 0.06, title=title)
    mark_work(ax, tl)
axes[0].set_xlabel("")
fig.tight_layout()
fig.savefig(f"{FIGURES}/03_pipeline_with_events_cpu.png", dpi=110)

# %% [markdown]
# With events, compute could have started at 0.2 s but held until the copy landed at 0.3 s, and
# D2H held until compute was done. The price of correctness here is nothing: the stages that had
# to wait would have produced garbage anyway.
#
# ## 3. The host is free while the device works
#
# Between launching the pipeline and synchronizing on `d2h_done`, the host may do anything it
# likes, as long as it does not touch the buffers the device is using. In a server, that is the
# time to **prepare the next batch**. Here the compute stage is a 0.2 s forward pass (as on a GPU,
# it needs no CPU: a sleep), and the host spends 0.15 s on Python work meanwhile. We record the
# host's own spans on the `CPU` lane with `tl.span`:

# %%
def forward(x, out):
    """Stand-in for a forward pass: 0.2 s of device time that needs no CPU, then the result."""
    time.sleep(0.2)
    torch.mul(x, 2, out=out)


def prepare_next_batch(seconds):
    """The host's own work: plain Python, like a scheduler building lists."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        [i * 2 for i in range(100)]


tl = Timeline()
with get_device("cpu", tl) as dev:
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    h2d_done, compute_done, d2h_done = dev.event(), dev.event(), dev.event()
    host_in, host_out = dev.pin(torch.arange(1, 9)), dev.pin(torch.zeros(8, dtype=torch.int64))
    dev_in, dev_out = dev.empty((8,), torch.int64), dev.empty((8,), torch.int64)
    h2d.copy(dev_in, host_in, name="H2D", lane="H2D")
    h2d.record(h2d_done)
    compute.wait(h2d_done)
    compute.launch(forward, dev_in, dev_out, name="compute", lane="compute")
    compute.record(compute_done)
    d2h.wait(compute_done)
    d2h.copy(host_out, dev_out, name="D2H", lane="D2H")
    d2h.record(d2h_done)
    with tl.span("CPU", "prepare"):
        prepare_next_batch(0.15)  # the host works while the device computes
    with tl.span("CPU", "wait"):
        d2h_done.synchronize(timeout=5)
    print("result:", host_out.tolist())

spans = {sp.name: sp for sp in tl.spans}
prep, comp, wait = spans["prepare"], spans["compute"], spans["wait"]
print("the host prepared while the device computed:", min(prep.end, comp.end) > max(prep.start, comp.start))
print("the host then waited less than the forward pass took:", wait.duration < comp.duration)
print("wall time shorter than host work + device work:", tl.wall < prep.duration + comp.duration)

fig, ax = plt.subplots(figsize=(9, 2.4))
tl.plot(ax=ax, title="the host prepares the next batch while the device computes")
fig.tight_layout()
fig.savefig(f"{FIGURES}/03_host_free_cpu.png", dpi=110)

# %% [markdown]
# The host's `wait` is only the part of the forward pass that its own work did not cover. On a
# GPU the copies are microseconds and the forward pass milliseconds, but the shape is the same.
#
# ## 4. Then why is the synchronous loop not faster?
#
# Because in the loop the host has nothing useful to do in that window. `minibatch`'s synchronous
# loop (`minibatch/core/sync_loop.py`) already runs on exactly this machinery: each step it launches
# H2D, compute and D2H on three streams chained by events, then synchronizes on `d2h_done`. But the
# next batch **depends on this step's tokens**: which requests finished, what each one's next input
# token is. So the host waits (grey), updates the requests, and only then prepares the next batch,
# while the device, having finished, waits for it. Let us record it on the tiny model:

# %%
texts = ["The for statement", "A class definition", "Exceptions are raised", "The import system"]
prompts = [tok.encode(t) for t in texts]
tl_sync = Timeline()
outs = minibatch.generate(model, prompts, max_new_tokens=32, mode="sync", timeline=tl_sync,
                          eos_token_id=tok.eos_token_id)
for t, o in zip(texts, outs):
    print(repr(t + tok.decode(o)))

# %%
host = {(sp.name, sp.step): sp for sp in tl_sync.spans if sp.lane == "CPU"}
steps = sorted({step for _, step in host})
device = [sp for sp in tl_sync.spans if sp.lane in ("H2D", "compute", "D2H")]
idle_host_work = [sp for sp in host.values() if sp.name in ("prepare", "update")]
print(f"{len(steps)} steps; the host waited for the device in every step:",
      all(("wait", n) in host for n in steps))
print("every prepare started only after the previous step's wait ended:",
      all(host[("prepare", n + 1)].start >= host[("wait", n)].end for n in steps[:-1]))
print("the device had nothing to do during every prepare and update:",
      not any(min(h.end, d.end) > max(h.start, d.start) for h in idle_host_work for d in device))

# %%
# NBVAL_IGNORE_OUTPUT
totals = tl_sync.totals()
print(f"host time: waiting {totals['wait'] / tl_sync.wall:.0%}, preparing and updating "
      f"{(totals['prepare'] + totals['update']) / tl_sync.wall:.0%}; device busy {tl_sync.device_busy():.0%}")
fig, ax = plt.subplots(figsize=(9, 2.4))
start = host[("prepare", 10)].start
tl_sync.plot(ax=ax, start=start, end=host[("update", 14)].end, title="sync loop, tiny model on this CPU: steps 10 to 14")
fig.tight_layout()
fig.savefig(f"{FIGURES}/03_sync_loop_waits_cpu.png", dpi=110)

# %% [markdown]
# Each step reads the same from left to right: prepare (blue), H2D, compute, D2H on the device
# while the host waits (grey), update (green), and again. The white gap after each prepare, on
# every lane, is the launch: the host hands the step's three pieces of work and their events to the
# device, which on this machine is a process of its own (notebook 02), so each is a message that
# the device must read before it can start; a millisecond or a few, more when the cores are busy.
# On a GPU a launch is microseconds and the gap all but disappears; the turn-taking does not. (So
# the printed shares do not add up to the whole: waiting, preparing and updating are the host's
# spans, launching is not one of them.) The host and the device still take turns,
# exactly as in notebook 01; streams and events changed *how* the host waits, not *whether*.
#
# ## 5. The same on an H200
#
# The recorded timeline of `python -m minibatch bench` in sync mode on one H200, Llama-3-8B shape
# (bf16, random weights), 32 prompts of 256 tokens, 256 new tokens each, decode steps replayed as
# CUDA graphs: the graphs-on run of 2026-11-29 (`python -m minibatch bench --model llama3-8b-shape
# --device cuda --modes sync,async --cuda-graphs on ...`; "Device layer, CUDA graphs, async loop" in
# `notes/benchmarks_history_2026-11-29_to_2026-12-02.md`), made with the
# first version of the decode step (einsum attention, full sampler; notebook 07 shows how a step of
# this workload later came down from 15.5 <!-- from figures/data/headline.json: decode_step.first_graphed_ms --> to 5.4 ms <!-- from figures/data/headline.json: decode_step.merged_ms -->). The device spans are measured with CUDA events on the GPU's own
# clock, so unlike notebook 01's host-clock spans they show when the GPU actually worked. We look at
# the decode steps from step 5 on (steps 0 to 3 prefill the 32 prompts, 2,048 tokens at a time, and
# the first decode step is an outlier):

# %%
gpu = Timeline.load("../figures/data/gpu_sync_graphs_llama3-8b-shape_b32_256.json")
compute = {sp.step: sp for sp in gpu.spans if sp.name == "compute"}
waits = {sp.step: sp for sp in gpu.spans if sp.name == "wait"}
decode = [n for n in sorted(compute) if n >= 5]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


span_ms = 1e3 * median(compute[n].duration for n in decode)
period_ms = 1e3 * median(compute[n + 1].start - compute[n].start for n in decode[:-1])
wait_ms = 1e3 * median(waits[n].duration for n in decode)
print(f"{len(compute)} steps in {gpu.wall:.1f} s, device busy {gpu.device_busy():.0%}")
print(f"median compute span                         {span_ms:5.1f} ms")
print(f"median time from one compute start to next  {period_ms:5.1f} ms")
print(f"GPU idle per step                           {period_ms - span_ms:5.1f} ms ({1 - span_ms / period_ms:.0%})")
print(f"median host wait on d2h_done                {wait_ms:5.1f} ms")

# %%
fig, ax = plt.subplots(figsize=(10, 2.6))
start = waits[100].start - 0.004
tl_window = (start, start + 0.08)
gpu.plot(ax=ax, start=tl_window[0], end=tl_window[1], title="sync loop, 8B shape, H200, CUDA graphs, first decode step (2026-11-29): 80 ms")
row = 2  # lanes drawn: CPU, H2D, compute, D2H
for n in range(100, 104):
    gap_start, gap_end = compute[n].end - start, compute[n + 1].start - start
    if gap_end < tl_window[1] - start:
        ax.annotate("", xy=(gap_start, row), xytext=(gap_end, row),
                    arrowprops=dict(arrowstyle="<->", color="black", linewidth=0.8))
        ax.text((gap_start + gap_end) / 2, row + 0.55, "idle", ha="center", fontsize=7)
fig.tight_layout()
fig.savefig(f"{FIGURES}/03_sync_timeline_gpu_graphs.png", dpi=110)

# %% [markdown]
# A decode step's compute takes 16.2 ms of GPU time, but a new one starts only every 19.7 ms: for
# 3.4 ms per step, about a sixth of the time, the GPU has nothing to do while the host copies the
# tokens back, updates the requests, prepares the next batch and launches it. Meanwhile the host
# spends most of each step waiting on `d2h_done` (grey): the two sides still take turns. (The short
# white gap on the CPU lane after each prepare is the host launching the step: copies, event
# records and waits, and one CUDA graph replay.) The article measured the same effect on its 8B
# setup: the GPU busy 76.0% of the time.
#
# ## 6. What comes next
#
# The host should prepare batch N+1 *while* the device runs batch N, in the window that section 3
# showed is free. Three problems stand in the way, one notebook each:
#
# * **04**: batch N+1's inputs would overwrite the buffers batch N is still reading: a race. Two IO
#   *slots* used in turn fix it (and CUDA graphs, one set per slot, remove launch overhead);
# * **05**: batch N+1 needs the tokens batch N has not produced yet: a placeholder and a
#   *carry-over* done on the device fill them in;
# * **06**: all of it together, the asynchronous loop: in the same H200 run its steps follow each
#   other with no gap, the GPU busy 100% of the time (`notes/benchmarks_history_2026-11-29_to_2026-12-02.md`).
#
# ## Summary
#
# * `record` puts a marker in a stream; `wait` holds *another stream* until the marker is reached
#   (the host does not wait); `synchronize` holds the *host* until it is reached.
# * Chaining H2D → `h2d_done` → compute → `compute_done` → D2H → `d2h_done`, and synchronizing the
#   host on `d2h_done` only, makes the pipeline correct every time, however busy the streams are.
# * Between launch and synchronize the host is free.
# * The synchronous loop does not use that freedom: the next batch depends on this step's tokens,
#   so the host waits, and then the device waits for the host (3.4 ms of every 19.7 ms on the H200).
#
# ## Exercise
#
# Write `pipeline(dev, host_in, fn)` that copies the host tensor `host_in` to a device buffer on
# the stream `dev.stream("H2D")`, launches `fn(dev_in, dev_out)` on `dev.stream("compute")` (`fn`
# writes its result into `dev_out`, a buffer of the same shape and dtype as `host_in`), copies
# `dev_out` back to a host buffer on `dev.stream("D2H")`, and returns the result as a list. Use
# events so that the result is right however busy each stream is, and let the host wait only for
# your D2H copy (the check keeps another stream busy for a second; `dev.synchronize()` would wait
# for it too). The check also counts: compute and D2H must each wait for an event, and the host may
# synchronize once.

# %%
pipeline = None  # replace with your function

# %%
import exercises

exercises.check_03(globals().get("pipeline"))
