# %% [markdown]
# # 02 · CUDA streams: queues of device work
#
# **What you will learn:** what a *stream* is (an ordered queue of device work that the host fills
# and the device empties); what launching work costs the host (*launch overhead*); why one launch
# on PyTorch's legacy *default stream* kills all concurrency; how an inference loop splits its
# work over three streams (H2D copies, compute, D2H copies) with non-blocking copies; and why
# streams alone give **wrong results**.
#
# **Time:** about 10 minutes (CPU); the GPU numbers come from a recorded H200 run.
#
# In notebook 01 the host did everything in turn: prepare, copy in, compute, copy out, update,
# each stage finished before the next one started. To let the host and the device work at the same
# time, the host must be able to *hand work over* and get on with its own. That is what streams
# are for. We build the idea in a few lines first, then use `minibatch.devices`, the device layer
# every later notebook runs on. Its `cpu` backend emulates a GPU with a second process whose streams
# are worker threads, so what you see below really happens, on any laptop.

# %%
import os
import queue
import re
import threading
import time

import matplotlib.pyplot as plt
import torch

from minibatch.devices import get_device
from minibatch.core.timeline import Timeline

_ = torch.manual_seed(0)  # nothing below is random, but every notebook starts seeded
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)

# %% [markdown]
# ## 1. A stream, in a dozen lines
#
# A stream is a queue with a worker behind it. The host *launches* work: it puts the work in the
# queue and returns at once. The worker takes items out and runs them, one after the other, in the
# order they were launched. The host learns that the work is done only by asking, here by
# `synchronize()`, which blocks until the queue is empty.

# %%
class TinyStream:
    """An ordered queue of work and one worker thread that runs it: the idea of a stream."""

    def __init__(self):
        self.todo = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def launch(self, fn, *args):
        self.todo.put((fn, args))  # enqueue and return: the host does not wait

    def synchronize(self):
        self.todo.join()  # the host blocks until everything launched so far has run

    def _work(self):
        while True:
            fn, args = self.todo.get()
            fn(*args)
            self.todo.task_done()


log = []


def kernel(name, seconds):
    """Stand-in for a GPU kernel: keeps the stream busy for a while, then notes that it ran."""
    time.sleep(seconds)
    log.append(f"device: {name} done")


s = TinyStream()
t0 = time.perf_counter()
for name in ("a", "b", "c"):
    s.launch(kernel, name, 0.1)
log.append("host:   launched a, b, c")
s.synchronize()
log.append("host:   synchronized")
print("\n".join(log))
print("the three kernels ran one after the other:", time.perf_counter() - t0 >= 0.3)
inline_log = list(log)

# %% [markdown]
# The host was back before the first kernel finished, and the kernels ran in launch order. Our
# stand-in for a kernel is a *sleep*: it keeps the stream busy without using the host's processor,
# the way a kernel runs on the GPU's own cores while the CPU does something else. (Real PyTorch
# work on the emulated device would share this machine's CPU cores with the host, which blurs the
# picture: `notes/device_overlap.md` measures it. Sleeps make every picture below the same on
# every machine.)
#
# Two streams are two queues with two workers: work on different streams may run **at the same
# time**. Two kernels of 0.1 s each, one per stream:

# %%
s1, s2 = TinyStream(), TinyStream()
t0 = time.perf_counter()
s1.launch(kernel, "x", 0.1)
s2.launch(kernel, "y", 0.1)
s1.synchronize()
s2.synchronize()
elapsed = time.perf_counter() - t0
# one after the other would take 0.2 s; side by side about 0.1 s, more on a busy machine
assert elapsed < 0.19, f"the two streams did not run side by side ({elapsed:.2f} s)"
print("both done in about the time of one: the two streams ran side by side")

# %% [markdown]
# ### The package version
#
# `minibatch.devices.get_device(...)` opens a device; `dev.stream(name)` gives a named stream (the
# same name gives the same stream); `launch(fn, *args)` enqueues, `sleep(seconds)` enqueues a delay,
# `synchronize(timeout=...)` blocks the host. Without a GPU there are two emulated devices:
#
# * `"cpu"` (the default, and what the loops use) is a **process of its own**, like a GPU a second
#   processor beside the host: launched work is pickled and sent to it, it computes on another core
#   while the host runs on, and it can only touch device memory (`dev.empty`) and pinned host memory
#   (`dev.pin`), both shared memory. A launched function that appends to a host list would append to
#   the device process's own copy of it. (The process is started by forking this one. Windows cannot
#   fork: there `"cpu"` opens `"cpu-threads"` instead and says so in a warning; the README's common
#   problems tell how to choose threads yourself.)
# * `"cpu-threads"` runs each stream as a thread of *this* interpreter: launched work may touch any
#   host object, like our `TinyStream`. Its catch comes in section 4.
#
# The `kernel` above writes to the host's `log`, so it runs on `"cpu-threads"`. The same experiment
# must tell the same story:

# %%
log = []
with get_device("cpu-threads") as dev:
    s = dev.stream("compute")
    for name in ("a", "b", "c"):
        s.launch(kernel, name, 0.1)
    log.append("host:   launched a, b, c")
    s.synchronize(timeout=5)  # every host wait in minibatch takes a timeout: a bug fails, it does not hang
    log.append("host:   synchronized")
print("\n".join(log))
assert log == inline_log
print("same order of events as TinyStream ✓")

# %% [markdown]
# On a GPU (`get_device("cuda")`) the very same calls are thin wrappers over `torch.cuda` streams:
# `launch(fn)` runs `fn` at once on the host inside `with torch.cuda.stream(s):`, every PyTorch
# operation in it *enqueues* a kernel on that stream instead of running it, and `synchronize` waits
# for the GPU. The queue lives in the GPU driver, the worker is the GPU itself.
#
# ## 2. Recording what the streams do
#
# Give the device a `Timeline` (notebook 01) and each piece of device work becomes a span on a
# lane of your choice. Two streams, A and B, each running one 0.1 s kernel:

# %%
COLOURS = {"a": "#4C72B0", "b": "#DD8452", "small op": "#C44E52"}


def draw(tl, lanes, ax, title):
    """Gantt chart of a timeline on the given lanes, each span's name written on its bar."""
    t0 = min(sp.start for sp in tl.spans)
    for row, lane in enumerate(lanes):
        for sp in tl.spans:
            if sp.lane == lane:
                ax.broken_barh([(sp.start - t0, sp.duration)], (row - 0.4, 0.8),
                               facecolors=COLOURS.get(sp.name, "#999999"), edgecolor="white")
                ax.text(sp.start - t0 + sp.duration / 2, row, sp.name, ha="center", va="center",
                        fontsize=8, color="white")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10)


def overlap(tl, x, y):
    """Did the spans named x and y run at the same time?"""
    sx, sy = [next(sp for sp in tl.spans if sp.name == n) for n in (x, y)]
    return min(sx.end, sy.end) > max(sx.start, sy.start)


tl_named = Timeline()
with get_device("cpu", tl_named) as dev:
    a, b = dev.stream("A"), dev.stream("B")
    a.sleep(0.1, name="a", lane="stream A")
    b.sleep(0.1, name="b", lane="stream B")
    dev.synchronize(timeout=5)
print("a and b ran at the same time:", overlap(tl_named, "a", "b"))

# %% [markdown]
# ## 3. The legacy default stream
#
# Every CUDA program has a **default stream**: where work goes when you do not name a stream. In
# PyTorch, any operation outside a `with torch.cuda.stream(...)` block runs there. The *legacy*
# default stream has a special rule, kept from the days before streams: a launch on it waits for
# **all** earlier work on every (blocking) stream, and all later work on every (blocking) stream
# waits for it. One small operation on it in the middle of a pipeline, and everything runs in turn.
#
# `dev.default_stream` behaves that way. The same two kernels, with one tiny (20 ms) operation on
# the default stream launched between them:

# %%
tl_default = Timeline()
with get_device("cpu", tl_default) as dev:
    a, b = dev.stream("A"), dev.stream("B")
    a.sleep(0.1, name="a", lane="stream A")
    dev.default_stream.sleep(0.02, name="small op", lane="default")
    b.sleep(0.1, name="b", lane="stream B")
    dev.synchronize(timeout=5)
print("a and b ran at the same time:", overlap(tl_default, "a", "b"))
print("order on the device:", " → ".join(sp.name for sp in sorted(tl_default.spans, key=lambda sp: sp.start)))

fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
lanes = ["stream A", "stream B", "default"]
draw(tl_named, lanes, axes[0], "two named streams: a and b overlap")
draw(tl_default, lanes, axes[1], "one small op on the legacy default stream in between: everything in turn")
axes[1].set_xlabel("time (s)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_default_stream_cpu.png", dpi=110)

# %% [markdown]
# The small op waited for `a`, and `b`, although launched on its own stream, waited for the small
# op. On a GPU the classic culprits are a stray operation in the loop that forgot its `with
# torch.cuda.stream(...)`, and a host read of a device value (`.item()`, `.tolist()`, `.cpu()`,
# `print(tensor)`): the copy runs on the current stream, the default one unless you named another,
# *and* the host waits for it, so the CPU waits for all the GPU work launched before.
#
# A detail that matters on real hardware: the rule only binds **blocking** streams. PyTorch's own
# side streams (`torch.cuda.Stream()`) are created *non-blocking*, so with them default-stream work
# may run beside theirs. `minibatch`'s `cuda` backend creates its named streams as blocking ones
# (`cudaStreamCreate`), so that the default stream serializes as described here and in the
# Hugging Face article (measured on an H200: `notes/device_overlap.md`). Either way, the cure is
# the same: keep every operation of the loop on a named stream, and read device values on the host
# only where you mean to wait.
#
# ## 4. Launch overhead
#
# Launching is not free. Every launch costs the host some work: here, pickling the call and sending
# it to the device process; on a GPU, Python, PyTorch's dispatcher and a call into the
# CUDA driver. Add 1 to a tensor 2,000 times with 2,000 tiny launches, then the same with one
# launch that adds 2,000:

# %%
# NBVAL_IGNORE_OUTPUT
n = 2000
with get_device("cpu") as dev:
    s = dev.stream("compute")
    x = dev.empty((16,))
    x.zero_()
    t = time.perf_counter()
    for _ in range(n):
        s.launch(x.add_, 1.0)  # n tiny launches
    host_many = time.perf_counter() - t
    s.synchronize(timeout=30)
    done_many, result_many = time.perf_counter() - t, x[0].item()
    x.zero_()
    t = time.perf_counter()
    s.launch(x.add_, float(n))  # one launch, the same result
    host_one = time.perf_counter() - t
    s.synchronize(timeout=30)
    done_one, result_one = time.perf_counter() - t, x[0].item()
print(f"{n} launches: the host spent {host_many * 1e3:5.1f} ms launching ({host_many / n * 1e6:.1f} µs each); "
      f"all done after {done_many * 1e3:5.1f} ms")
print(f"   1 launch:  the host spent {host_one * 1e3:5.2f} ms launching; done after {done_one * 1e3:5.2f} ms")

# %%
print("same result:", result_many == result_one == n)
print("one launch cost the host less than", n, "launches:", host_one < host_many)

# %% [markdown]
# What does the `"cpu"` device's launch cost, being a process? Each launch pickles the function and
# its arguments (tensors in shared memory travel as a reference, a few bytes) and writes one message
# to a socket; a host wait is a message back. Three numbers: one launch, one *event round trip*
# (record an event, wait until the device says it is reached) and the device's start-up (a fork of
# this process, like creating a CUDA context):

# %%
# NBVAL_IGNORE_OUTPUT
t = time.perf_counter()
dev = get_device("cpu")
startup = time.perf_counter() - t
s, ev, x = dev.stream("compute"), dev.event(), dev.empty((16,))
costs = {}
for what in ("launch", "event round trip"):
    t = time.perf_counter()
    for _ in range(500):
        if what == "launch":
            s.launch(x.add_, 1.0)
        else:
            s.record(ev)
            ev.synchronize(timeout=5)
    costs[what] = (time.perf_counter() - t) / 500
dev.synchronize(timeout=5)
dev.close()
print(f"one launch        ~{costs['launch'] * 1e6:4.0f} µs of host time")
print(f"event round trip  ~{costs['event round trip'] * 1e6:4.0f} µs")
print(f"start-up          ~{startup:4.2f} s")

# %% [markdown]
# On the order of a hundred microseconds for a launch and for a round trip, a fraction of a second
# to start (more on a busy machine): small beside a decode step of the tiny model (a few milliseconds on the device, about one on the
# host), which is why the loops can afford one round trip per step. (The cells above print this
# machine's timings, so yours will differ; BENCHMARKS.md has the ones this course was written with.)
#
# And the catch of `"cpu-threads"`: its streams share this interpreter's GIL (global interpreter
# lock) with the host. PyTorch kernels let go of it while they compute, the Python around them does
# not. The tiny model's forward pass is mostly Python (module calls), and so is the host's
# scheduling: on two cores they take turns rather than overlap (overlapped / sequential time
# 0.84-1.0, against 0.71 for a separate process; notes/device_overlap.md has the measurements).
# That is why the default `"cpu"` device is a process: on a laptop, too, the async loop of notebook
# 06 then has a second processor to overlap with.
#
# Each launch costs the host microseconds, and a device that runs tiny pieces of work spends much of its time waiting for
# the next one to be launched. On a GPU this is what holds back a model run **eagerly**, one
# PyTorch operation at a time, when its kernels are short. Our profile of one decode step of the 8B-shaped model at batch 32 on
# an H200 (eager, the first version of the step, 2026-11-29: `torch.profiler` around three decode
# steps, its table recorded in `figures/data/gpu_profile_decode_step_8b.txt`):

# %%
prof = open("../figures/data/gpu_profile_decode_step_8b.txt").read()
STEPS = 3  # the profiler recorded three decode steps
cpu_ms = float(re.search(r"Self CPU time total: ([\d.]+)ms", prof).group(1)) / STEPS
gpu_ms = float(re.search(r"Self CUDA time total: ([\d.]+)ms", prof).group(1)) / STEPS
wall_ms = float(re.search(r"default ([\d.]+) ms", prof).group(1))
launch_rows = {}
for line in prof.splitlines():
    cols = line.split()
    if cols and "LaunchKernel" in cols[0]:
        launch_rows[cols[0]] = (int(cols[-1]), float(cols[5].removesuffix("us")))  # (calls, µs per call)
launches = sum(calls for calls, _ in launch_rows.values()) / STEPS
per_launch = launch_rows["cudaLaunchKernel"][1]
print("one eager decode step, 8B shape, batch 32, H200:")
print(f"  kernel launches             {launches:6.0f}  ({per_launch:.1f} µs of CPU each for cudaLaunchKernel)")
print(f"  CPU time (under profiler)   {cpu_ms:6.1f} ms")
print(f"  GPU kernel time             {gpu_ms:6.1f} ms")
print(f"  wall time (no profiler)     {wall_ms:6.1f} ms")

fig, ax = plt.subplots(figsize=(7, 2.0))
bars = {"GPU: running kernels": gpu_ms, "CPU: launching them (profiled)": cpu_ms, "wall time (no profiler)": wall_ms}
ax.barh(list(bars), list(bars.values()), color=["#8172B2", "#4C72B0", "#BBBBBB"])
for row, ms in enumerate(bars.values()):
    ax.text(ms + 0.5, row, f"{ms:.1f} ms", va="center", fontsize=8)
ax.set_xlim(0, 1.15 * max(bars.values()))
ax.invert_yaxis()
ax.set_xlabel("ms per decode step")
ax.set_title("eager decode step, 8B shape, batch 32, one H200 (recorded)", loc="left", fontsize=10)
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_launch_overhead_gpu.png", dpi=110)

# %% [markdown]
# About 1,700 launches per step. The CPU needs longer to launch a step's kernels than the GPU needs
# to run them (the profiler inflates the CPU side, but even without it a step takes 38 ms of wall
# time for 21 ms of GPU work): the GPU keeps waiting for its next kernel. The fix is the one our
# small experiment shows, one launch instead of many: a **CUDA graph** records the whole step once
# and replays it with a single launch (notebook 04). With graphs the same workload's synchronous
# loop ran twice as fast (39.3 → 19.9 ms per step, 2026-11-29:
# `notes/benchmarks_history_2026-11-29_to_2026-12-02.md`).
#
# ## 5. Three streams and non-blocking copies
#
# A step of the generation loop has three kinds of device work, and the article gives each its own
# stream, so that they can overlap across steps (a copy for one batch while another computes):
#
# * **H2D**: copy the batch's inputs from host memory to device memory;
# * **compute**: forward pass and sampling;
# * **D2H**: copy the sampled tokens back to the host.
#
# `stream.copy(dst, src)` enqueues a copy on a stream. Like a launch it returns at once: the copy
# happens later, when the stream gets to it. Here the H2D stream is still busy with earlier work
# (a 0.1 s delay) when we launch the copy:

# %%
with get_device("cpu") as dev:
    h2d = dev.stream("H2D")
    host_in = dev.pin(torch.arange(1, 9))  # a host buffer (pinned memory on a GPU)
    dev_in = dev.empty((8,), torch.int64)  # a device buffer
    dev_in.zero_()
    h2d.sleep(0.1)  # the stream is busy with earlier work
    h2d.copy(dev_in, host_in)  # enqueue the copy; returns at once
    print("right after the copy call:", dev_in.tolist())
    h2d.synchronize(timeout=5)
    print("after h2d.synchronize():  ", dev_in.tolist())

# %% [markdown]
# On a GPU, the copy is `dst.copy_(src, non_blocking=True)` inside the stream, and "returns at
# once" has a condition: the host side must be **pinned** (page-locked) memory, which the GPU can
# read by DMA while the CPU does something else. From ordinary (pageable) memory the driver first
# stages the data through a pinned buffer of its own, and a device-to-host copy into pageable
# memory makes the host wait until it is done: a hidden synchronization. That is why the loop
# allocates its host buffers once with `dev.pin(...)` (on the emulated device it just makes a new
# host buffer). And the caveat that the rest of this notebook is about: after a non-blocking copy,
# the host may not read the destination until it *knows* the copy ran.
#
# ## 6. The broken pipeline
#
# Now the three streams together, as the article first draws them: copy the input in, double it,
# copy the result out, then read it on the host. Each stream is still busy with earlier work for a
# different time (injected delays: D2H 0.1 s, compute 0.2 s, H2D 0.3 s), as streams of a busy GPU
# are. The device buffers hold what an earlier batch left there: `dev_in` zeros, `dev_out` 99s.
# The host buffer for the result holds -1s.

# %%
expected = [2 * i for i in range(1, 9)]
tl_broken = Timeline()
with get_device("cpu", tl_broken) as dev:
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    host_in = dev.pin(torch.arange(1, 9))
    host_out = dev.pin(torch.full((8,), -1))
    dev_in, dev_out = dev.empty((8,), torch.int64), dev.empty((8,), torch.int64)
    dev_in.fill_(0)  # left over from an earlier batch
    dev_out.fill_(99)
    for stream, delay in ((d2h, 0.1), (compute, 0.2), (h2d, 0.3)):
        stream.sleep(delay, lane=stream.name)  # busy with earlier work
    h2d.copy(dev_in, host_in, name="H2D", lane="H2D")
    compute.launch(lambda: torch.mul(dev_in, 2, out=dev_out), name="compute", lane="compute")
    d2h.copy(host_out, dev_out, name="D2H", lane="D2H")
    got_at_once = host_out.tolist()  # the host reads its result right away
    dev.synchronize(timeout=5)  # (only to look at every buffer afterwards)
    print("expected                         ", expected)
    print("host read right after launching  ", got_at_once)
    print("host_out, once everything ran    ", host_out.tolist())
    print("dev_out, once everything ran     ", dev_out.tolist())
    print("dev_in, once everything ran      ", dev_in.tolist())
order = [sp.name for sp in sorted(tl_broken.spans, key=lambda sp: sp.start) if sp.name != "delay"]
print("order in which the device ran them:", " → ".join(order))

# %%
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


fig, ax = plt.subplots(figsize=(9, 2.2))
tl_broken.plot(ax=ax, end=max(sp.end for sp in tl_broken.spans) + 0.06,
               title="no synchronization: each stage runs before its input exists (orange: earlier work)")
mark_work(ax, tl_broken)
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_broken_pipeline_cpu.png", dpi=110)

# %% [markdown]
# Every stage ran before the stage it depends on, and each failure shows in a different buffer:
#
# * the **host** read `host_out` before anything came back: -1s, the buffer's old contents;
# * **D2H** copied `dev_out` before compute wrote it: the 99s of an earlier batch;
# * **compute** doubled `dev_in` before the input landed: zeros;
# * the **H2D** copy did arrive, last, when nobody read it any more.
#
# No error, no warning: just wrong numbers. On a GPU the same code usually gives the *right* answer,
# because copies and small kernels are fast and the streams are rarely that busy; it breaks only
# now and then, under load, which is worse. The injected delays make it break every time (on a GPU, `stream.sleep`
# is `torch.cuda._sleep`, a kernel that spins for a given number of clock cycles). Streams give no
# ordering *between* streams: something has to say "compute waits for the copy". That is an
# **event**, notebook 03.
#
# ## 7. What is the same on a real GPU, and what differs
#
# The same, because `get_device("cuda")` offers the same calls over `torch.cuda`:
#
# * a stream runs its work in launch order; different streams may run at the same time;
# * a launch or a copy returns to the host at once; the host knows nothing about when it ran;
# * the legacy default stream serializes everything (with `minibatch`'s blocking streams);
# * without synchronization between streams, results are wrong, and injected delays make that
#   happen every time.
#
# Different:
#
# * On a GPU the device work runs on the GPU's own processors and the CPU is truly free. Here it
#   runs in a second process on the same CPU cores: the host is free only if a core is.
# * Two GPU kernels on two streams overlap only if neither fills the GPU; a big matmul uses every
#   core. What overlaps best are **copies with compute**: the GPU has separate copy engines.
# * The host cost of a launch matters more on a GPU: the recorded decode step's kernels ran for
#   about 12 µs each on average (21 ms over 1,723 launches), hardly longer than launching one
#   takes (section 4). CUDA graphs and kernel fusion remove it.
# * A GPU copy from the host is non-blocking only from pinned memory; CUDA loads a kernel the
#   first time it is launched and that load waits for the GPU, so warm up before racing or timing
#   (`notes/device_overlap.md`).
#
# ## Summary
#
# * A stream is an ordered queue of device work: launch returns at once, the stream runs its work
#   in order, different streams may run at the same time.
# * Every launch costs the host time; an eager 8B decode step makes ~1,700 of them and the GPU
#   waits for the CPU. One launch for many kernels (CUDA graphs, notebook 04) is the cure.
# * The legacy default stream waits for all earlier work and makes all later work wait for it: keep
#   the loop's work on named streams.
# * The loop uses three streams, H2D, compute and D2H, and non-blocking copies from pinned memory.
# * Streams alone give wrong results: nothing orders work across streams. Next, in **03**, events
#   fix the pipeline.
#
# ## Exercise
#
# Write `max_concurrency(tl)` that returns the largest number of spans of a `Timeline` that were
# running at the same moment (any lanes; spans that only touch, one ending exactly when the next
# starts, do not overlap). On `tl_named` it should give 2, on `tl_default` 1. Hint: sort the start
# and end times and walk through them, counting up at a start and down at an end.

# %%
max_concurrency = None  # replace with your function

# %%
import exercises

exercises.check_02(globals().get("max_concurrency"))
