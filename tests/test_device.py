"""The device layer's semantics, one suite for every backend (cuda runs only where a GPU is present).

These are semantics tests, not benchmarks: delays are injected on the streams and the timing margins
are wide, so they hold on a loaded 2-core machine. Every host wait passes a timeout, so a bug shows up
as a failure, never as a hang.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from minibatch.devices import DeviceError, DeviceTimeoutError, get_device
from minibatch.core.timeline import Timeline

X = 0.3  # seconds: an injected delay, long against thread wake-ups and kernel launches
T = 10.0  # timeout for waits that should succeed

BACKENDS = ["cpu", "cpu-threads", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.fixture(params=BACKENDS)
def dev(request):
    d = get_device(request.param)
    yield d
    if d.kind == "cuda":  # drain delays left on the GPU so they do not spill into the next test
        torch.cuda.synchronize()
    d.close()


def host_view(t: torch.Tensor) -> list:
    return t.cpu().tolist()


def test_order_within_a_stream(dev):
    s = dev.stream("a")
    x = dev.empty((1,), torch.int64)
    x.fill_(1)
    dev.synchronize(timeout=T)
    for i in range(10):  # x = 3x + i is not commutative: any reordering changes the result
        s.launch(lambda i=i: x.mul_(3).add_(i))
        if i == 4:
            s.sleep(0.05)  # a later launch must not overtake a slow one
    s.synchronize(timeout=T)
    want = 1
    for i in range(10):
        want = 3 * want + i
    assert host_view(x) == [want]


def test_two_streams_overlap(dev):
    a, b = dev.stream("a"), dev.stream("b")
    t0 = time.perf_counter()
    a.sleep(X)
    b.sleep(X)
    dev.synchronize(timeout=T)
    assert time.perf_counter() - t0 < 1.6 * X  # sequential would be 2X


def test_wait_holds_the_stream_not_the_host(dev):
    a, b = dev.stream("a"), dev.stream("b")
    ready, done = dev.event(), dev.event()
    flag = dev.empty((1,), torch.int64)
    flag.zero_()
    dev.synchronize(timeout=T)
    t0 = time.perf_counter()
    a.sleep(2 * X)
    a.record(ready)
    b.wait(ready)
    b.launch(flag.fill_, 7)
    b.record(done)
    assert time.perf_counter() - t0 < X  # the host was not held
    assert not done.query()  # but stream b is
    done.synchronize(timeout=T)
    assert time.perf_counter() - t0 >= 1.7 * X
    assert ready.query() and done.query()
    assert host_view(flag) == [7]


@pytest.mark.parametrize("how", ["event", "stream", "device"])
def test_synchronize_blocks_the_host(dev, how):
    s, ev = dev.stream("a"), dev.event()
    t0 = time.perf_counter()
    s.sleep(X)
    s.record(ev)
    {"event": ev, "stream": s, "device": dev}[how].synchronize(timeout=T)
    assert time.perf_counter() - t0 >= 0.8 * X
    assert ev.query()


def test_unrecorded_event_counts_as_reached(dev):
    ev = dev.event()  # as in CUDA: waiting on it, or for it, returns at once
    assert ev.query()
    ev.synchronize(timeout=T)
    dev.stream("a").wait(ev)
    dev.synchronize(timeout=T)


@pytest.mark.parametrize("first", ["default", "named"])
def test_default_stream_serializes(dev, first):
    a, d = dev.stream("a"), dev.default_stream
    t0 = time.perf_counter()
    (d if first == "default" else a).sleep(X)
    (a if first == "default" else d).sleep(X)
    dev.synchronize(timeout=T)
    assert time.perf_counter() - t0 >= 1.8 * X  # what overlapped on two named streams now runs in turn


def test_default_stream_sees_earlier_work(dev):
    a = dev.stream("a")
    x, y = dev.empty((4,)), dev.empty((4,))
    x.zero_()
    y.zero_()
    dev.synchronize(timeout=T)
    a.sleep(X)
    a.launch(x.fill_, 5.0)
    dev.default_stream.launch(lambda: y.copy_(x + 1))  # no event: the default stream waits anyway
    dev.synchronize(timeout=T)
    assert host_view(y) == [6.0] * 4


def run_pipeline(dev, with_event: bool) -> list:
    """H2D copies the input on one stream, compute doubles it on another; the copy is delayed."""
    h2d, compute, copied = dev.stream("H2D"), dev.stream("compute"), dev.event()
    host_in = dev.pin(torch.arange(1.0, 9.0))
    dev_in, dev_out = dev.empty((8,)), dev.empty((8,))
    double = lambda: torch.mul(dev_in, 2, out=dev_out)  # noqa: E731
    compute.launch(double)  # warm-up: CUDA loads a kernel on first use, and that load waits for the GPU
    dev_in.zero_()  # the stale contents compute will find if it does not wait
    dev_out.zero_()
    dev.synchronize(timeout=T)
    h2d.sleep(X)  # the copy lands late, every time
    h2d.copy(dev_in, host_in)
    h2d.record(copied)
    if with_event:
        compute.wait(copied)
    compute.launch(double)
    dev.synchronize(timeout=T)
    return host_view(dev_out)


def test_broken_pipeline_is_wrong_every_time(dev):
    for _ in range(5):
        assert run_pipeline(dev, with_event=False) == [0.0] * 8  # compute read the unwritten buffer


def test_pipeline_with_events_is_right_every_time(dev):
    for _ in range(5):
        assert run_pipeline(dev, with_event=True) == [2.0 * i for i in range(1, 9)]


class Boom(Exception):
    pass


def boom() -> None:
    raise Boom("injected failure")


def test_failure_in_device_work_raises_in_the_host(dev):
    a, b, ev = dev.stream("a"), dev.stream("b"), dev.event()
    t0 = time.perf_counter()
    with pytest.raises(DeviceError) as info:
        a.launch(boom)
        a.record(ev)
        b.wait(ev)  # b waits for an event that a will never reach: must not hang
        b.sleep(0.01)
        dev.synchronize(timeout=T)
    assert isinstance(info.value.__cause__, Boom)
    assert time.perf_counter() - t0 < T / 2


def test_failure_surfaces_at_the_next_launch(dev):
    a, b = dev.stream("a"), dev.stream("b")
    with pytest.raises(DeviceError):
        a.launch(boom)
        for _ in range(500):  # the cpu backend learns of the failure a moment later
            b.launch(lambda: None)
            time.sleep(0.01)


@pytest.mark.parametrize("how", ["event", "stream", "device"])
def test_wait_times_out(dev, how):
    s, ev = dev.stream("a"), dev.event()
    s.sleep(4 * X)
    s.record(ev)
    t0 = time.perf_counter()
    with pytest.raises(DeviceTimeoutError):
        {"event": ev, "stream": s, "device": dev}[how].synchronize(timeout=0.05)
    assert time.perf_counter() - t0 < 2 * X
    assert issubclass(DeviceTimeoutError, DeviceError) and issubclass(DeviceTimeoutError, TimeoutError)


def test_spans_land_in_the_timeline(dev):
    tl = Timeline()
    with get_device(dev.kind, timeline=tl) as d:
        s = d.stream("compute")
        src, dst = d.pin(torch.ones(4)), d.empty((4,))
        s.copy(dst, src, name="H2D", lane="H2D", step=3, slot=1)
        s.sleep(X, name="delay", lane="compute", step=3, slot=1)
        s.launch(dst.mul_, 2.0, name="compute", lane="compute", step=3, slot=1)
        d.synchronize(timeout=T)
        assert host_view(dst) == [2.0] * 4
    spans = {sp.name: sp for sp in tl.spans}
    assert set(spans) == {"H2D", "delay", "compute"}
    assert all(sp.step == 3 and sp.slot == 1 for sp in spans.values())
    assert spans["H2D"].lane == "H2D" and spans["compute"].lane == "compute"
    assert spans["delay"].duration >= 0.8 * X
    assert spans["H2D"].end <= spans["delay"].start + 1e-3 <= spans["compute"].start + 2e-3  # stream order
    assert 0 <= spans["H2D"].start and spans["compute"].end <= tl.now()


def test_launch_keeps_the_hosts_inference_mode(dev):
    seen = dev.empty((2,), torch.int64)
    seen.fill_(-1)
    dev.synchronize(timeout=T)
    with torch.inference_mode():
        dev.stream("a").launch(lambda: seen[0].fill_(int(torch.is_inference_mode_enabled())))
    dev.stream("a").launch(lambda: seen[1].fill_(int(torch.is_inference_mode_enabled())))
    dev.synchronize(timeout=T)
    assert host_view(seen) == [1, 0]


def test_closures_over_host_objects_run_on_the_threads_backend():
    seen = []  # device work in the host's interpreter may touch host objects (notebooks 02, 03)
    with get_device("cpu-threads") as d:
        d.stream("a").launch(lambda: seen.append(1))
        d.synchronize(timeout=T)
    assert seen == [1]


def test_the_cpu_device_refuses_plain_host_tensors():
    if torch.cuda.is_initialized():
        pytest.skip("this process has started CUDA: get_device('cpu') runs the emulated device as threads")
    with get_device("cpu") as d:
        with pytest.raises(DeviceError, match="dev.empty"):
            d.stream("a").launch(torch.Tensor.add_, torch.zeros(2), 1)
        d.stream("a").launch(lambda: None)  # refused before it was sent: the device is fine
        d.synchronize(timeout=T)


def test_the_cpu_device_is_a_process_of_its_own():
    import os

    if torch.cuda.is_initialized():
        pytest.skip("this process has started CUDA: get_device('cpu') runs the emulated device as threads")

    with get_device("cpu") as d:
        device_pid = d._proc.pid
        pid = d.empty((1,), torch.int64)
        d.stream("a").launch(lambda: pid.fill_(os.getpid()))
        d.synchronize(timeout=T)
        assert host_view(pid)[0] not in (0, os.getpid())
        assert d.startup_seconds < 3.0
        if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2:
            mine = sorted(os.sched_getaffinity(0))  # the host keeps its first core; the device gets the rest
            assert sorted(os.sched_getaffinity(d._proc.pid)) == mine[1:]
            assert sorted(os.sched_getaffinity(0)) == mine  # the host's own setting is left alone
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(device_pid, 0)


def test_memory_helpers(dev):
    h = torch.arange(6, dtype=torch.int32)
    p = dev.pin(h)
    assert p.device.type == "cpu" and p.tolist() == h.tolist() and p.data_ptr() != h.data_ptr()
    assert p.is_pinned() == (dev.kind == "cuda")
    e = dev.empty((2, 3), torch.int64)
    assert e.shape == (2, 3) and e.dtype == torch.int64 and e.device.type == ("cuda" if dev.kind == "cuda" else "cpu")


@pytest.mark.parametrize("kind", ["cpu", "cpu-threads"])
def test_close_is_idempotent_and_refuses_new_work(kind):
    before = sys.getswitchinterval()
    t0 = time.perf_counter()
    with get_device(kind) as d:
        if d.kind == "cpu-threads":
            assert sys.getswitchinterval() < before  # short GIL slices while the threads share the GIL
        else:
            assert sys.getswitchinterval() == before  # a process of its own changes nothing here
        d.stream("a").sleep(5.0)  # close() must cut it short
    d.close()
    assert time.perf_counter() - t0 < 3.0
    assert sys.getswitchinterval() == before
    with pytest.raises(DeviceError):
        d.stream("a").launch(lambda: None)


def test_named_streams_are_reused(dev):
    assert dev.stream("x") is dev.stream("x") and dev.stream("x") is not dev.stream("y")
    assert dev.stream("default") is dev.default_stream


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            get_device("cuda")


def runs_as_threads(d) -> None:
    """d is the threads backend, and works."""
    with d:
        assert d.kind == "cpu-threads"
        x = d.empty((1,), torch.int64).fill_(1)
        d.stream("a").launch(x.add_, 2)
        d.synchronize(timeout=T)
        assert x.tolist() == [3]


def test_cpu_device_falls_back_to_threads_where_the_platform_cannot_fork(monkeypatch):
    """On Windows there is no fork (and no file descriptors over a Unix socket): the cpu device opens as
    threads and says so, instead of failing in the first cell of every notebook."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.warns(UserWarning, match="cannot fork.*runs as cpu-threads"):
        d = get_device("cpu", switch_interval=0.001)  # a cpu device's options go to the threads
    runs_as_threads(d)


def test_the_package_imports_and_generates_where_unix_only_pieces_are_missing(tmp_path):
    """What Windows lacks, taken away in a fresh interpreter: no fork, no passing of file descriptors
    (multiprocessing.reduction.sendfds/recvfds), no CPU affinity. `import minibatch` must still work,
    and generate must run (on threads, with the warning)."""
    import subprocess
    from pathlib import Path

    code = """
import multiprocessing, multiprocessing.reduction as r, os, warnings
for name in ("sendfds", "recvfds", "DupFd"):
    delattr(r, name)
for name in ("fork", "sched_getaffinity", "sched_setaffinity"):
    if hasattr(os, name):
        delattr(os, name)
multiprocessing.get_all_start_methods = lambda: ["spawn"]
import minibatch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = minibatch.load_model("random-llama", device="cpu")
    out = minibatch.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, mode="async")
assert [len(o) for o in out] == [3, 3], out
assert any("cannot fork" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_an_environment_variable_makes_every_cpu_device_threads(monkeypatch):
    import warnings

    monkeypatch.setenv("MINIBATCH_CPU_DEVICE", "cpu-threads")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        with get_device("cpu") as d:
            assert d.kind == "cpu-threads"
    monkeypatch.setenv("MINIBATCH_CPU_DEVICE", "gpu")
    with pytest.raises(ValueError, match="MINIBATCH_CPU_DEVICE='gpu' is not a cpu backend"):
        get_device("cpu")
    monkeypatch.setenv("MINIBATCH_CPU_DEVICE", "cpu")
    if not torch.cuda.is_initialized():
        with get_device("cpu") as d:
            assert d.kind == "cpu"


def test_cpu_device_falls_back_to_threads_where_cuda_has_started(monkeypatch):
    """A forked child cannot touch CUDA again, so once this process has started CUDA the cpu device runs
    as threads, and says so (on a GPU machine, tests/test_gpu.py checks it with CUDA really started)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="runs as cpu-threads"):
        d = get_device("cpu")
    runs_as_threads(d)
