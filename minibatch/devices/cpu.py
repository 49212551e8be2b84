"""The `cpu` backend: an emulated device that is a process of its own, beside the host (notebooks 02, 03).

A GPU is a second processor: once work is launched it needs nothing from the host. A thread of the
host's own interpreter is not one: it shares the GIL, and the tiny model's forward pass (mostly
Python) and the host's scheduling (all Python) then take turns (notes/device_overlap.md; that
backend is still there, as `get_device("cpu-threads")`). So this device is a process, started
(forked) when the device opens and kept until it closes, as a CUDA context is:

    host process                              device process (devices/cpu_process.py)
    launch(fn, *args) ── pickled message ──▶  stream workers (devices/threads.py): fn(*args)
    record / wait     ── message ──────────▶  events, the legacy default stream
    event.synchronize ◀── reached, spans ────  (its own GIL, its own core)

It owns what a GPU would own: the model's weights (inherited at fork), the KV cache and the device
side of the IO slots. `dev.empty` and `dev.pin` allocate in shared memory, so an H2D copy is a
real copy done by the device side, and a host that rewrites a slot too early still corrupts the
device's input: the races of notebook 04 stay real. Work and its arguments are pickled at launch
(devices/names.py says how); a plain host tensor in device work is refused, as a GPU kernel cannot
touch pageable host memory either. So are effects on host objects: a launched function that
appends to a host list appends to the device process's copy of it.

What it costs (numbers in BENCHMARKS.md): the start-up, a fork; a launch, host time to pickle the
work and one write to a socket (records and waits are queued and go with the next launch); an event,
a round trip over the socket. A decode step of the tiny model (three launches, one round trip) pays
that instead of a GIL shared with the device:
on two cores the async loop then wins back most of the host's share of a step. The host keeps one
torch thread while the device is open: a second one waits for the core the device is using. The
device process is pinned to every core but the host's first one (where the platform allows it).
Needs the `fork` start method (Linux, macOS): constructed where there is none it raises, and
`get_device("cpu")` opens "cpu-threads" there instead (devices/__init__.py).

The messages themselves (queued, sent as one write, replies read while the host waits) are
devices/cpu_channel.py's; this module opens, feeds and closes the process.

Shutdown: close() sends "exit", waits a short grace period, then terminates the process; open
devices are closed at exit. A KeyboardInterrupt in the middle of a message leaves the channel
unusable: the device then counts as failed (sticky, like any device error) and is closed.

Lifecycle guarantees (devices/lifecycle.py says how):
- the device process ends within a moment of its host, however the host ends (SIGKILL, SIGTERM,
  `os._exit`, a crash): it watches a pipe only the host holds, and on Linux the kernel also signals it;
- a fork of the host (`os.fork`, a `multiprocessing` worker) inherits the device marked as the
  parent's: using it there raises DeviceError ("open a new Engine in this process"), and the child's
  exit closes nothing of the parent's; the parent is never affected;
- a shared-memory allocation that does not fit (a memory limit) is a ValueError and leaves nothing
  in /dev/shm.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import socket
import time

import torch

from .compat import share_fd
from . import cpu_process as device_process
from . import lifecycle
from . import limits
from ..core.device import Device, DeviceError, Event, Stream, deferred_interrupts
from .cpu_channel import CpuChannel
from .names import Names
from . import settings
from .threads import SWITCH_INTERVAL

START_TIMEOUT = 30.0  # seconds for the device process to report ready
GRACE = 0.5  # seconds a busy device process gets to exit before it is terminated

_open = lifecycle.OpenDevices()


class CpuEvent(Event):
    def __init__(self, dev: CpuDevice, key: int) -> None:
        self.dev, self.key = dev, key
        self._recorded = 0  # records sent; the device answers with the highest one reached
        self._reached = 0

    def query(self) -> bool:
        self.dev._drain()
        self.dev._check()
        return self._reached >= self._recorded

    def synchronize(self, timeout: float | None = None) -> None:
        target = self._recorded  # like CUDA: wait for the record made before this call
        self.dev._wait_for(lambda: self._reached >= target, timeout, "an event")


class CpuStream(Stream):
    def __init__(self, dev: CpuDevice, name: str) -> None:
        self.dev, self.name = dev, name
        self._sync_event = dev.event()

    def launch(self, fn, *args, name: str = "compute", lane: str = "compute", step: int = -1,
               slot: int = -1) -> None:
        dev = self.dev
        dev._check()
        opts = dict(name=name, lane=lane, step=step, slot=slot)
        msg = ("L", self.name, fn, args, opts, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               dev._timeline_key)
        dev._send_work(msg, f"launch of {getattr(fn, '__qualname__', fn)!s}")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str = "H2D", lane: str = "H2D",
             step: int = -1, slot: int = -1) -> None:
        self.launch(dst.copy_, src, name=name, lane=lane, step=step, slot=slot)

    def record(self, event: Event) -> None:
        ev = self.dev._own(event)
        self.dev._check()
        ev._recorded += 1  # counted before it is queued: an interrupt between the two cannot lose a record
        self.dev._send(("R", self.name, ev.key))

    def wait(self, event: Event) -> None:
        ev = self.dev._own(event)
        self.dev._send(("W", self.name, ev.key))

    def sleep(self, seconds: float, name: str = "delay", lane: str | None = None, step: int = -1,
              slot: int = -1) -> None:
        self.dev._send(("S", self.name, float(seconds), dict(name=name, lane=lane, step=step, slot=slot),
                        self.dev._timeline_key), flush=True)

    def synchronize(self, timeout: float | None = None) -> None:
        self.record(self._sync_event)
        self._sync_event.synchronize(timeout)


class CpuDevice(CpuChannel, Device):
    """The host's handle on a device process: streams, events and shared memory by message."""

    kind = "cpu"

    def __init__(self, timeline=None, switch_interval: float = SWITCH_INTERVAL,
                 torch_threads: int | None = None, inherit=()) -> None:
        if "fork" not in multiprocessing.get_all_start_methods():
            raise DeviceError("the 'cpu' device forks a device process, and this platform cannot fork; "
                              "use get_device('cpu-threads') (threads of this interpreter, no overlap of Python work)")
        # The host keeps one core, the device process is pinned to the others (where the platform can
        # pin), as a GPU is a processor of its own. Unpinned, the OS scheduler may put the device's
        # forward pass on the core the host is using, and the async loop's compute spans grow
        # (BENCHMARKS.md, the cpu device as a process).
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        device_cores = cores[1:] if cores and len(cores) >= 2 else None
        if torch_threads is None:
            n = len(cores) if cores else os.cpu_count() or 2
            torch_threads = max(1, n - 1)
        self._closed, self._error, self._broken, self._holds_threads = False, None, False, False
        self._streams: dict[str, CpuStream] = {}
        self._events: dict[int, CpuEvent] = {}
        self._timelines: dict[int, object] = {}
        self._timeline_key = None
        self._queue: list[bytes] = []  # messages not sent yet
        self._fds: list = []  # the queued storages, whose file descriptors follow the queue
        t0 = time.perf_counter()
        self._names = Names(inherit)  # what the device process holds, and how work's objects travel
        ctx = multiprocessing.get_context("fork")
        self._opener = os.getpid()
        self._conn, child = ctx.Pipe(duplex=True)  # a socket pair: it also carries file descriptors
        self._sock = socket.socket(fileno=os.dup(self._conn.fileno()))  # for sending file descriptors
        # the device reads end-of-file here once the host is gone; forks close their copies of the
        # write end (_left_in_fork), so that only this process holds it
        alive_r, self._alive_w = os.pipe()
        watch = (os.getpid(), alive_r, lifecycle.parent_death_signal_possible())
        self._proc = ctx.Process(target=device_process.serve, name="minibatch-device", daemon=True,
                                 args=(child, self._conn, switch_interval, torch_threads, device_cores, watch))
        try:  # from here on, whatever happens, close() leaves nothing behind
            with deferred_interrupts():  # a half-opened device could not be closed cleanly
                self._start(child, alive_r)
        except BaseException:
            child.close()
            _close_fd(alive_r)
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        self.default_stream = self.stream("default")
        self.set_timeline(timeline)

    def _start(self, child, alive_r: int) -> None:
        _open.add(self)
        self._proc.start()
        child.close()
        os.close(alive_r)
        # the host's torch work (building batches) gets one thread: a second one would wait for a core
        # the device process is using, and even a tiny op then waits for the OS to schedule it
        settings.TORCH_THREADS.hold(1)
        self._holds_threads = True
        if not self._conn.poll(START_TIMEOUT):
            raise DeviceError(f"the device process did not start within {START_TIMEOUT:g} s")
        self._recv()

    # --- the interface --------------------------------------------------------------------------------
    def stream(self, name: str) -> CpuStream:
        self._check()
        if name not in self._streams:
            self._streams[name] = CpuStream(self, name)
        return self._streams[name]

    def event(self) -> CpuEvent:
        key = self._names.new_key()
        ev = self._events[key] = CpuEvent(self, key)
        return ev

    def synchronize(self, timeout: float | None = None) -> None:
        targets = []
        for s in list(self._streams.values()):
            s.record(s._sync_event)
            targets.append((s._sync_event, s._sync_event._recorded))
        self._wait_for(lambda: all(ev._reached >= n for ev, n in targets), timeout, "the device")

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer the device process can reach (shared memory), holding a copy of `tensor`."""
        out = self.empty(tuple(tensor.shape), tensor.dtype)
        return out.copy_(tensor)

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Device memory: shared memory, registered with the device process once."""
        self._check()
        try:
            t = torch.empty(shape, dtype=dtype)
            if t.numel() == 0:
                return t
            t.share_memory_()
        except RuntimeError as exc:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            raise limits.shared_memory_error(nbytes, exc) from None
        storage = t.untyped_storage()
        _, nbytes = share_fd(storage)
        key = self._names.new_key()
        # the queue keeps the storage (and so its file descriptor) alive until it is sent; no duplicate
        # descriptor that an interrupt could leave open
        self._send(("s", key, nbytes), storage)
        self._names.add_storage(t, key)
        return t

    def set_timeline(self, timeline) -> None:
        self.flush_timeline()
        self.timeline = timeline
        self._timeline_key = None
        if timeline is not None:
            self._timeline_key = self._names.new_key()
            self._timelines = {k: v for k, v in self._timelines.items() if v is not None}
            self._timelines[self._timeline_key] = timeline

    def flush_timeline(self) -> None:
        if not self._closed:
            self._drain()

    def close(self) -> None:
        with deferred_interrupts():  # a second Ctrl-C waits until nothing is left running
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        if self._holds_threads:  # first: a second interrupt during the grace period changes nothing
            self._holds_threads = False
            settings.TORCH_THREADS.release()
        proc = self._proc
        if proc.pid is None:  # never started
            self._conn.close()
            self._sock.close()
            self._alive_w = _close_fd(self._alive_w)
            return
        try:
            if not self._broken:
                try:
                    self._conn.send_bytes(pickle.dumps(([pickle.dumps(("X",))], 0)))
                except OSError:
                    pass
            proc.join(GRACE)
        finally:  # even when a second interrupt lands in the grace period: nothing is left running
            if proc.is_alive():
                proc.terminate()
                proc.join(GRACE)
            if proc.is_alive():
                proc.kill()
                proc.join()
            # its pipe's finalizer runs now, while interrupts wait, instead of whenever the Process is
            # collected: a Ctrl-C landing in that finalizer left a descriptor open and the interrupt's
            # traceback holding the run's buffers
            proc.close()
            self._conn.close()
            self._sock.close()
            self._alive_w = _close_fd(self._alive_w)
            self._fds = []

    def _left_in_fork(self) -> None:
        """In a fork of the host: this device is the parent's. Unusable here, closed by nobody here;
        our copies of the host's ends are closed, so that only the parent keeps the device alive."""
        self._error = (lifecycle.opener_message(self._opener), None)
        self._broken = self._closed = True
        self._holds_threads = False  # (settings.py puts this process's settings back)
        for end in (self._conn, self._sock):
            try:
                end.close()
            except OSError:
                pass
        self._alive_w = _close_fd(self._alive_w)
        self._fds, self._queue = [], []
        # multiprocessing would terminate and join the parent's device process at this process's exit
        # ("can only join a child process"): it is not our child
        getattr(multiprocessing.process, "_children", set()).discard(self._proc)

    def _check(self) -> None:
        if self._error is not None:
            raise DeviceError(self._error[0]) from self._error[1]
        if self._closed:
            raise DeviceError("the device is closed")

    def __del__(self) -> None:  # a device dropped unclosed (an interrupt before its owner kept it)
        if not getattr(self, "_closed", True):
            self.close()

    def _own(self, event: Event) -> CpuEvent:
        if not isinstance(event, CpuEvent) or event.dev is not self:
            raise ValueError("this event belongs to another device: create it with this device's event()")
        return event


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    return None


@atexit.register
def _close_all() -> None:
    for dev in list(_open):
        dev.close()


def _after_fork_in_child() -> None:
    for dev in list(_open):
        dev._left_in_fork()
    _open.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
