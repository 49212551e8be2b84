"""The `cpu-threads` backend: an emulated device whose streams are threads of the host's own
interpreter (notebooks 02, 03), and the engine inside the `cpu` backend's device process.

Each stream is a worker thread that runs the work launched on it, in order, while the host thread
goes on with its own work. Streams run concurrently with each other and with the host, so overlap
and races are real, not drawn:

    host     launch H2D, launch compute, … ──── prepare batch N+1 (Python) ──── sync(d2h_done)
    H2D      █copy█ ●h2d_done
    compute         ╎wait ████ forward (torch, releases the GIL) ████ ●done
    D2H                                                             ╎wait █copy█ ●d2h_done

The streams and events are in thread_streams.py; this module has the device that holds them.
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
from typing import Callable

import torch

from . import settings
from . import lifecycle
from ..core.device import Device, DeviceError, Event, deferred_interrupts, safe_wait, time_left
from .thread_streams import ThreadEvent, ThreadStream

SWITCH_INTERVAL = 0.0002  # seconds; Python's default is 0.005

_open = lifecycle.OpenDevices()
_opener = os.getpid()  # the process whose devices are in _open


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
            safe_wait(self._cv, time_left(deadline, timeout, what))  # (a Ctrl-C comes back as itself)



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
