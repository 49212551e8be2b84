"""The `cpu-threads` backend: an emulated device whose streams are threads of the host's own
interpreter (notebooks 02, 03), and the engine inside the `cpu` backend's device process.

Each stream is a worker thread that runs the work launched on it, in order, while the host thread
goes on with its own work. Streams run concurrently with each other and with the host, so overlap
and races are real, not drawn:

    host     launch H2D, launch compute, … ──── prepare batch N+1 (Python) ──── sync(d2h_done)
    H2D      █copy█ ●h2d_done
    compute         ╎wait ████ forward (torch, releases the GIL) ████ ●done
    D2H                                                             ╎wait █copy█ ●d2h_done

`record(ev)` queues a marker; when the worker reaches it, the event is reached. `wait(ev)` queues a
hold: the worker stops there until the event is reached (the host never waits). The default stream
is the *legacy* default stream: its work starts only after all earlier work on every stream, and
later work on any stream waits for it, so one launch on it serializes everything (notebook 02).

A failure inside device work is kept and raised in the host as `DeviceError` at the next launch,
query or synchronize on that device; like a CUDA error it is sticky (every later call raises, open a
new device), and every worker drops its remaining work, so nothing hangs on an event that will never
come. Every host wait takes a timeout.

Why this is not the default (numbers in notes/device_overlap.md): every worker shares the host's
interpreter, and so its GIL. Torch kernels release it, the Python around them does not. Host Python
beside large matmuls on a stream overlaps well once the interpreter switches threads often (Python's
default switch interval lets one side hold the GIL for milliseconds); beside the tiny model's
forward pass, which is mostly Python, it barely overlaps at any interval: host and device take
turns. So while a device of
this kind is open the interval is 0.2 ms and torch has one intra-op thread per spare core, set in
every worker too (OpenMP/MKL thread counts are per thread), restored when the last one closes. The
`cpu` backend (devices/cpu.py) runs this same engine in a process of its own, where it has a GIL of
its own. What threads do offer: device work can touch any host object, as notebooks 02-03 show.

Interrupts: the host only takes C-level locks in `with` statements (an interrupt cannot land between
taking one and entering the block), close() restores the process settings before it waits for the
workers, and at exit the workers are stopped before the interpreter tears down.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from . import settings
from . import lifecycle
from ..core.device import Device, DeviceError, Event, Stream, deferred_interrupts, time_left

SWITCH_INTERVAL = 0.0002  # seconds; Python's default is 0.005

_open = lifecycle.OpenDevices()
_opener = os.getpid()  # the process whose devices are in _open


class _Work:
    """One queued item: `run` executes outside the device lock, `deps` are checked under it."""

    __slots__ = ("run", "deps", "reaches", "what")

    def __init__(self, run: Callable[[], Any] | None, what: str) -> None:
        self.run, self.what = run, what
        self.deps: list[Callable[[], bool]] = []   # all must be true before the item starts
        self.reaches: tuple[ThreadEvent, int] | None = None  # a record: (event, sequence number)


class ThreadEvent(Event):
    def __init__(self, dev: ThreadDevice) -> None:
        self.dev = dev
        self._recorded = 0  # how many times the event was recorded (the latest record is the one that counts)
        self._reached = 0   # the highest record a worker has passed

    def _done(self, target: int) -> bool:
        return self._reached >= target

    def query(self) -> bool:
        with self.dev._lock:
            self.dev._check()
            return self._done(self._recorded)

    def synchronize(self, timeout: float | None = None) -> None:
        with self.dev._lock:
            target = self._recorded  # like CUDA: wait for the record made before this call
            self.dev._wait_for(lambda: self._done(target), timeout, "an event")


class ThreadStream(Stream):
    def __init__(self, dev: ThreadDevice, name: str, default: bool = False) -> None:
        self.dev, self.name, self.is_default = dev, name, default
        self._queue: deque[_Work] = deque()
        self._enqueued = 0
        self._completed = 0
        # this stream's worker waits here (under the device's lock): woken by work for it, and by work
        # done elsewhere only while it has work waiting (dev._wake), not by every change on the device
        self._cv = threading.Condition(dev._lock)
        dev._workers.append(self)  # before its thread starts: close() must reach every worker there is
        self._thread = threading.Thread(target=self._worker, name=f"minibatch-{name}", daemon=True)
        self._thread.start()

    # --- host side: enqueue and return ---------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], *args: Any, name: str = "compute", lane: str = "compute",
               step: int = -1, slot: int = -1) -> None:
        # grad/inference mode is thread-local; carry the host's into the worker, as a CUDA launch would
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        timeline = self.dev.timeline

        def run() -> None:
            start = timeline.now() if timeline is not None else 0.0
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn(*args)
            if timeline is not None:
                timeline.add(lane, name, start, timeline.now(), step, slot)

        self._enqueue(_Work(run, name))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str = "H2D", lane: str = "H2D",
             step: int = -1, slot: int = -1) -> None:
        self.launch(dst.copy_, src, name=name, lane=lane, step=step, slot=slot)

    def record(self, event: Event) -> None:
        ev = self.dev._own(event)
        work = _Work(None, "record")

        def count() -> None:  # under the device lock, once the record is sure to be queued
            ev._recorded += 1
            work.reaches = (ev, ev._recorded)

        self._enqueue(work, count)

    def wait(self, event: Event) -> None:
        ev = self.dev._own(event)
        work = _Work(None, "wait")

        def hold() -> None:  # a never-recorded event is already reached, as in CUDA
            target = ev._recorded
            work.deps.append(lambda: ev._done(target))

        self._enqueue(work, hold)

    def sleep(self, seconds: float, name: str = "delay", lane: str | None = None, step: int = -1,
              slot: int = -1) -> None:
        stop, timeline = self.dev._stop, self.dev.timeline

        def run() -> None:  # an interruptible sleep, so that close() never waits for a long delay
            start = timeline.now() if timeline is not None else 0.0
            stop.wait(seconds)
            if timeline is not None and lane is not None:
                timeline.add(lane, name, start, timeline.now(), step, slot)

        self._enqueue(_Work(run, f"sleep({seconds})"))

    def synchronize(self, timeout: float | None = None) -> None:
        with self.dev._lock:
            target = self._enqueued
            self.dev._wait_for(lambda: self._completed >= target, timeout, f"stream {self.name!r}")

    def _enqueue(self, work: _Work, under_lock: Callable[[], None] | None = None) -> None:
        dev = self.dev
        with dev._lock:
            dev._check()
            if under_lock is not None:
                under_lock()
            # legacy default stream: it waits for everything before it, everything after waits for it
            if self.is_default:
                for s in dev._streams.values():
                    if s is not self and s._completed < s._enqueued:
                        work.deps.append(lambda s=s, n=s._enqueued: s._completed >= n)
            else:
                d, n = dev.default_stream, dev.default_stream._enqueued
                if d._completed < n:
                    work.deps.append(lambda: d._completed >= n)
            self._queue.append(work)
            self._enqueued += 1
            self._cv.notify()

    # --- device side: the worker -------------------------------------------------------------------
    def _worker(self) -> None:
        dev = self.dev
        # OpenMP/MKL thread counts are per thread: a new thread starts with one per core, whatever the
        # host set, and its matmuls then fight the host thread for the cores (several times slower)
        torch.set_num_threads(dev._torch_threads)
        while True:
            with dev._lock:
                while not dev._closed and dev._error is None and not (
                        self._queue and all(dep() for dep in self._queue[0].deps)):
                    self._cv.wait()
                if dev._closed:
                    return
                if dev._error is not None:  # the device failed: drop our work, nothing will run again
                    self._completed += len(self._queue)
                    self._queue.clear()
                    dev._wake(everyone=True)
                    continue
                work = self._queue[0]
            try:
                if work.run is not None:
                    work.run()
            except BaseException as exc:  # noqa: BLE001 — any failure must reach the host, not kill the thread
                dev.fail(f"device work {work.what!r} on stream {self.name!r} failed: {type(exc).__name__}: {exc}", exc)
                continue
            with dev._lock:
                self._queue.popleft()
                self._completed += 1
                if work.reaches is not None:
                    ev, seq = work.reaches
                    ev._reached = max(ev._reached, seq)
                dev._wake()
            if work.reaches is not None and dev._on_reached is not None:
                dev._on_reached(*work.reaches)


class ThreadDevice(Device):
    """An emulated device: one worker thread per stream, sharing one lock and condition variable."""

    kind = "cpu-threads"

    def __init__(self, timeline=None, switch_interval: float = SWITCH_INTERVAL,
                 torch_threads: int | None = None, on_reached: Callable[[ThreadEvent, int], None] | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        """`on_reached(event, seq)` and `on_error(message, exc)` are called from the workers when an event
        is reached and when the device first fails (the cpu device process reports both to its host)."""
        self.timeline = timeline
        # a C-level lock taken with `with`: a KeyboardInterrupt cannot leave it held (a Condition's
        # __enter__ is Python code, and an interrupt landing just after it took the lock did)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._settings_held = False
        self._on_reached, self._on_error = on_reached, on_error
        self._stop = threading.Event()
        self._closed = False
        self._error: tuple[str, BaseException] | None = None  # (message, the exception raised in the worker)
        self._streams: dict[str, ThreadStream] = {}
        self._workers: list[ThreadStream] = []  # every stream whose worker was started, named or not
        if torch_threads is None:  # leave one core to the host thread
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
            torch_threads = max(1, cores - 1)
        self._torch_threads = torch_threads
        with deferred_interrupts():  # settings held and the first worker started, or neither
            settings.SWITCH.hold(switch_interval)
            settings.TORCH_THREADS.hold(torch_threads)
            self._settings_held = True
            _open.add(self)
            self.default_stream = ThreadStream(self, "default", default=True)
            self._streams["default"] = self.default_stream

    def stream(self, name: str) -> ThreadStream:
        with self._lock:
            self._check()
            if name not in self._streams:
                self._streams[name] = ThreadStream(self, name)
            return self._streams[name]

    def event(self) -> ThreadEvent:
        return ThreadEvent(self)

    def synchronize(self, timeout: float | None = None) -> None:
        with self._lock:
            targets = [(s, s._enqueued) for s in self._streams.values()]
            self._wait_for(lambda: all(s._completed >= n for s, n in targets), timeout, "the device")

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()  # a new host buffer, as on cuda; there is no pinning to do

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def close(self, join_timeout: float = 2.0) -> None:
        with deferred_interrupts():  # a second Ctrl-C waits until the settings are back and the workers gone
            self._close(join_timeout)

    def _close(self, join_timeout: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()  # cut injected delays short
            self._wake(everyone=True)
            # before waiting for the workers: a second interrupt during the wait leaves no setting changed
            if self._settings_held:
                self._settings_held = False
                settings.SWITCH.release()
                settings.TORCH_THREADS.release()
        _open.discard(self)
        for s in list(self._workers):  # every started worker, named or not
            if s._thread is not threading.current_thread():
                s._thread.join(timeout=join_timeout)  # a running fn cannot be interrupted

    def _left_in_fork(self, opener: int) -> None:
        """In a fork of the host: the workers did not come along and the lock may have been held by one of
        them; the device is unusable here (a clear error), closed by nobody here."""
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        for s in self._workers:
            s._cv = threading.Condition(self._lock)
        self._error = (lifecycle.opener_message(opener), None)
        self._closed, self._settings_held = True, False  # (settings.py puts this process's settings back)

    def fail(self, message: str, exc: BaseException) -> None:
        """The device failed (sticky): every wait and launch raises DeviceError from now on. Only the first
        failure is kept and reported to `on_error`."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = (message, exc)
            self._wake(everyone=True)
        if first and self._on_error is not None:
            self._on_error(message, exc)

    # --- helpers, called with self._lock held -------------------------------------------------------
    def _wake(self, everyone: bool = False) -> None:
        """After work completed (or the device failed or closed): wake the host's waits, and the
        workers whose next work may now start. A worker with nothing queued is woken by its next
        launch instead, so a step's bookkeeping does not wake every stream of the device: on the cpu
        device each wake-up takes the device process's core and GIL from the forward pass."""
        self._cv.notify_all()
        for s in self._workers:
            if everyone or s._queue:
                s._cv.notify()

    def _check(self) -> None:
        if self._error is not None:  # a fresh exception each time, so tracebacks do not pile up
            raise DeviceError(self._error[0]) from self._error[1]
        if self._closed:
            raise DeviceError("the device is closed")

    def _own(self, event: Event) -> ThreadEvent:
        if not isinstance(event, ThreadEvent) or event.dev is not self:
            raise ValueError("this event belongs to another device: create it with this device's event()")
        return event

    def _wait_for(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check()
            if done():
                return
            self._cv.wait(time_left(deadline, timeout, what))



def forget_open_devices() -> None:
    """In a forked child: the parent's devices, copied by the fork, are not this process's to close."""
    global _open, _opener
    _open, _opener = lifecycle.OpenDevices(), os.getpid()


def _after_fork_in_child() -> None:
    for dev in list(_open):
        dev._left_in_fork(_opener)
    forget_open_devices()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all() -> None:
    """At exit, stop the workers first: a worker still inside torch while the interpreter tears down
    aborts the process ("terminate called without an active exception")."""
    for dev in list(_open):
        dev.close(join_timeout=30.0)
