"""The `cpu-threads` device's streams and events (threads.py has the device and says how it works).

A `ThreadStream` is a worker thread with a queue: the host's launch, copy, record, wait and sleep
append an item and return; the worker runs the items in order, each once its dependencies (waits on
events, the legacy default stream's ordering) hold, under the device's one lock. A `ThreadEvent` counts
its records and the highest record a worker has passed, so that a wait or synchronize made now waits
for the record made before it, as CUDA's do. Their `dev` is a threads.ThreadDevice (its lock, its
workers' wake-ups and its sticky failure); this module does not import it, so that the two form no cycle.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import torch

from ..core.device import Device, Event, Stream


class _Work:
    """One queued item: `run` executes outside the device lock, `deps` are checked under it."""

    __slots__ = ("run", "deps", "reaches", "what")

    def __init__(self, run: Callable[[], Any] | None, what: str) -> None:
        self.run, self.what = run, what
        self.deps: list[Callable[[], bool]] = []   # all must be true before the item starts
        self.reaches: tuple[ThreadEvent, int] | None = None  # a record: (event, sequence number)


class ThreadEvent(Event):
    def __init__(self, dev: Device) -> None:
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
    def __init__(self, dev: Device, name: str, default: bool = False) -> None:
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
