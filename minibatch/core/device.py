"""The device interface: what every backend offers (notebooks 02, 03).

Streams, events and a device, as abstract classes, the two errors a device raises, and a `Platform`:
what the hardware behind a torch device type offers (graphs, padded shapes, free memory). Backends
(`devices/cuda.py`, `devices/cpu.py`) implement them; `devices/__init__.py` opens one. This module imports no
backend, so a backend can import it without a cycle.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Any

import torch


_RESIDENT: tuple[type, ...] = (torch.nn.Module,)


def resident(cls: type) -> type:
    """Class decorator: objects of `cls` live on the device side. A device that is a process of its
    own (devices/cpu.py) receives one once (or inherits it at its fork) and names it afterwards, as a
    GPU keeps a model's weights or a KV cache. Each such type says so where it is defined (the KV
    cache, the IO slots' device buffers, the step runner, the model); the devices know only torch
    modules."""
    global _RESIDENT
    if cls not in _RESIDENT:
        _RESIDENT += (cls,)
    return cls


def resident_types() -> tuple[type, ...]:
    """The types marked `@resident`."""
    return _RESIDENT


_OPENER = None  # opens a device by name: set by the backends' front door (devices/__init__.py)
_HOST_FREE = None  # measures the host memory this process may still allocate: set there too


def use_opener(opener) -> None:
    """Install the function `open_device` calls: `opener(kind, timeline, inherit, **options) -> Device`.
    The backends' front door (devices/__init__.py, its get_device) installs itself as it is imported, so
    the engine opens a device without importing any backend."""
    global _OPENER
    _OPENER = opener


def use_host_memory(measure) -> None:
    """Install the function `host_bytes_free` calls: `measure() -> int`, the bytes of host memory this
    process may still allocate (devices/limits.py reads the machine's free memory, `ulimit -v` and a
    container's cgroup limit; how is a platform's business, not the core's)."""
    global _HOST_FREE
    _HOST_FREE = measure


def host_bytes_free() -> int | None:
    """Host memory this process may still allocate, in bytes; None where no backend measures it."""
    return None if _HOST_FREE is None else _HOST_FREE()


def open_device(kind: str, timeline=None, inherit=(), **options) -> "Device":
    """A device of `kind` ("cpu", "cpu-threads", "cuda", "cuda:N") from the installed backends."""
    if _OPENER is None:
        raise DeviceError("no device backend is installed: import minibatch.devices (importing minibatch does)")
    return _OPENER(kind, timeline, inherit, **options)


class Platform:
    """What the engine asks of the hardware behind a torch device type, beyond streams and events:
    whether CUDA graphs and compiled steps run there, whether steps are padded to bucketed shapes, and
    its free memory. This default is a CPU's; devices/cuda.py registers the GPU's. Every question the
    core has about a device's kind goes through here, so a new backend answers them in one place."""

    graphs = False  # CUDA graphs can be captured and replayed (notebook 04)
    compiles = False  # torch.compile's decode step pays for itself (speed/compiled.py)
    padded = False  # steps padded to bucketed shapes (core/buckets.py): few shapes to capture
    own_memory = False  # device memory apart from the host's, counted on its own
    # an eager step's kernels are launched one by one from the loop's own thread, so its launch takes
    # about as long as the step runs (a GPU; a CPU backend computes in workers of its own)
    host_launches = False
    # a model's defaults on this hardware (model/model.py; batch.py says what each does): the
    # attention's key list padded to a multiple of `kv_bucket` keys, decode steps in the [rows, L]
    # key layout, decode rows padded to a multiple of `decode_kv_bucket` keys. A CPU gains nothing by
    # padding; a GPU runs fewer shapes (graphs, kernels' plans) and reads fewer padded keys at 64
    kv_bucket = 1
    decode_layout = False
    decode_kv_bucket = 1

    def free_bytes(self, device: torch.device) -> int | None:
        """Free device memory; None where the device uses host memory (counted as the host's)."""
        return None

    def release_cached(self, device: torch.device) -> None:
        """Give memory the allocator caches back to the driver (after a run's buffers are freed)."""


_PLATFORMS: dict[str, Platform] = {}


def register_platform(device_type: str, answers: Platform) -> None:
    """Answer the core's questions about devices of `device_type` ("cuda"): a backend, as it is imported."""
    _PLATFORMS[device_type] = answers


def platform(device: torch.device | str) -> Platform:
    """The Platform of `device` (a torch device or its name): the registered one, else a CPU's."""
    return _PLATFORMS.get(torch.device(device).type) or _CPU


_CPU = Platform()


class DeviceError(RuntimeError):
    """Work on the device failed, or the device was used wrongly; raised in the host."""


class DeviceTimeoutError(DeviceError, TimeoutError):
    """A host wait (synchronize) ran past its timeout."""


def time_left(deadline: float | None, timeout: float | None, what: str) -> float | None:
    """Seconds a host wait may still block before `deadline` (a time.monotonic() value; None: no limit).
    Raises DeviceTimeoutError once it has passed: the one place the backends' waits time out."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeviceTimeoutError(f"timed out after {timeout:g} s waiting for {what} (a delay longer "
                                 "than the timeout, or a wait on an event recorded after it?)")
    return left


@contextmanager
def deferred_interrupts():
    """Run a block that must not stop half-way (a device opening or closing, process settings): a
    Ctrl-C (or `_thread.interrupt_main`) that arrives meanwhile is raised when the block is done."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives KeyboardInterrupt
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt


WAIT_SLICE = 0.05  # seconds: the longest a Ctrl-C waits in `safe_wait`


def safe_wait(cond: threading.Condition, timeout: float | None = None) -> None:
    """`cond.wait(timeout)` that a Ctrl-C cannot split: the caller holds cond's lock, loops on what it
    waits for (a return may come early, as a spurious wake-up can) and holds the lock again after.

    `threading.Condition.wait` lets go of the lock and takes it back in Python code of its own, outside
    the try that restores it; a Ctrl-C landing just there leaves the caller's `with cond:` releasing a
    lock it no longer holds, and the user gets RuntimeError('release unlocked lock') in place of the
    KeyboardInterrupt. In the main thread (the only one a Ctrl-C reaches) each wait is therefore a
    slice of at most WAIT_SLICE seconds with interrupts deferred: the interrupt is raised when the
    slice ends, with the lock held."""
    if threading.current_thread() is not threading.main_thread():
        cond.wait(timeout)
        return
    with deferred_interrupts():
        cond.wait(WAIT_SLICE if timeout is None else min(WAIT_SLICE, timeout))


def safe_wait_for(cond: threading.Condition, predicate, timeout: float | None = None) -> bool:
    """`cond.wait_for(predicate, timeout)` on `safe_wait`: True once predicate() holds, False if
    `timeout` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not predicate():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        safe_wait(cond, left)
    return True


class Event:
    """A marker recorded in a stream: `query() -> bool` (reached yet?), `synchronize(timeout=None)`."""


class Stream:
    """An ordered queue of device work: `launch`, `copy`, `record`, `wait`, `sleep`, `synchronize`."""

    name: str

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class Device:
    """A device: `stream(name)` (the same name gives the same stream), `default_stream`, `event()`,
    `synchronize(timeout=None)`, `pin(tensor)`, `empty(shape, dtype)`, `close()`; a context manager."""

    kind: str
    default_stream: Stream
    timeline: Any

    def set_timeline(self, timeline) -> None:
        """Send later device spans to `timeline` (a device outlives runs; each run has its own timeline)."""
        self.flush_timeline()
        self.timeline = timeline

    def flush_timeline(self) -> None:
        """Add finished device spans to the timeline (the cpu workers add theirs themselves)."""

    def failure(self) -> str | None:
        """Why this device can do no more work (a device process that died), read from any thread
        without waiting; None while it can. A server's watchdog asks (serving/guard.py)."""
        return None

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} streams={sorted(self._streams)}>"
