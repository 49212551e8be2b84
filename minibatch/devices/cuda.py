"""The `cuda` backend of the device layer: thin wrappers over torch.cuda streams and events (notebooks 02, 03).

`launch` calls `fn` at once inside `torch.cuda.stream(s)`: `fn` enqueues kernels and returns. Named
streams come from cudaStreamCreate, *blocking* with respect to the legacy default stream, so the
default stream serializes for real, as in the article (PyTorch's own pool streams are non-blocking).
CUDA loads a kernel on its first launch and that load waits for the GPU: warm kernels up before
racing or timing them. A wait with a timeout polls the event (CUDA has no timed wait).

Timeline spans: timing events around each launch are converted to the host clock through one
reference event (taken at a synchronize when the device opens) and added by `flush_timeline()`,
which every synchronize calls and which never waits, so spans add no sync point.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

import torch

from ..core.device import Device, DeviceError, DeviceTimeoutError, Event, Platform, Stream, register_platform

class CudaPlatform(Platform):
    """A GPU's answers to the core (core/device.py): graphs and compiled steps run, steps are padded
    to bucketed shapes, memory is the GPU's own."""

    graphs = compiles = padded = own_memory = host_launches = True
    kv_bucket, decode_layout, decode_kv_bucket = 256, True, 64  # BENCHMARKS.md compares 64 with 256

    def free_bytes(self, device: torch.device) -> int:
        # memory PyTorch's allocator holds but no tensor uses is free to this process, though not to the driver
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached

    def release_cached(self, device: torch.device) -> None:
        torch.cuda.empty_cache()


register_platform("cuda", CudaPlatform())

# Per GPU, for the whole process: a property of the hardware (its clock), not of a run, so it outlives
# any one device object and is measured once.
_cycles_per_second: dict[int, float] = {}


def _sleep_rate(device: torch.device) -> float:
    """GPU clock cycles per second for torch.cuda._sleep, measured once per GPU."""
    if device.index not in _cycles_per_second:
        with torch.cuda.device(device):
            cycles = 20_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)  # warm-up: the first launch loads the kernel
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _cycles_per_second[device.index] = cycles / (start.elapsed_time(end) / 1e3)
    return _cycles_per_second[device.index]


# Per GPU, for the whole process, as PyTorch's own stream pool is: a stream is never destroyed (see
# _blocking_stream), so it cannot belong to one device object; a closed device hands its streams here.
_free_streams: dict[int, list[torch.cuda.Stream]] = {}  # blocking streams of closed devices, for reuse


def _blocking_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream that the legacy default stream synchronizes with (cudaStreamCreate, flags 0).

    PyTorch's pool streams are created non-blocking, which would let default-stream work run beside
    them. Like PyTorch's pool, we never destroy a stream (the caching allocator keeps per-stream state
    that outlives us): a closed device's streams go back to `_free_streams` for the next device.
    """
    free = _free_streams.setdefault(device.index, [])
    if free:
        return free.pop()
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = torch.cuda.cudart().cudaStreamCreate(ctypes.addressof(handle))
    if int(err) != 0 or not handle.value:
        raise DeviceError(f"cudaStreamCreate failed with CUDA error {int(err)}")
    return torch.cuda.ExternalStream(handle.value, device=device)


def _wrap(what: str, call: Callable[[], Any]) -> Any:
    """Run a torch.cuda call; a CUDA failure (RuntimeError from torch) becomes a DeviceError."""
    try:
        return call()
    except RuntimeError as exc:
        raise DeviceError(f"{what} failed: {exc}") from exc


class CudaEvent(Event):
    def __init__(self, dev: "CudaDevice") -> None:
        self.dev, self.event = dev, torch.cuda.Event()

    def query(self) -> bool:
        return _wrap("event query", self.event.query)

    def synchronize(self, timeout: float | None = None) -> None:
        if timeout is None:
            _wrap("event synchronize", self.event.synchronize)
            return
        deadline = time.monotonic() + timeout  # CUDA has no timed wait: poll, backing off to 0.2 ms
        pause = 1e-5
        while not self.query():
            if time.monotonic() > deadline:
                raise DeviceTimeoutError(f"timed out after {timeout:g} s waiting for a cuda event")
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)  # wake within ~0.2 ms of the event


class CudaStream(Stream):
    def __init__(self, dev: "CudaDevice", name: str, stream: torch.cuda.Stream) -> None:
        self.dev, self.name, self.stream = dev, name, stream

    def launch(self, fn: Callable[..., Any], *args: Any, name: str = "compute", lane: str = "compute",
               step: int = -1, slot: int = -1) -> None:
        self.dev._check()
        with torch.cuda.stream(self.stream):
            start = self.dev._span_start()
            try:
                fn(*args)
            except Exception as exc:  # fn failed while enqueueing (bad shapes, ...): nothing more to run
                raise DeviceError(f"device work {name!r} on stream {self.name!r} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            self.dev._span_end(start, lane, name, step, slot)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str = "H2D", lane: str = "H2D",
             step: int = -1, slot: int = -1) -> None:
        # non_blocking: returns at once when the host side is pinned memory (dev.pin)
        self.launch(lambda: dst.copy_(src, non_blocking=True), name=name, lane=lane, step=step, slot=slot)

    def record(self, event: Event) -> None:
        self.dev._check()
        event.event.record(self.stream)

    def wait(self, event: Event) -> None:
        self.dev._check()
        self.stream.wait_event(event.event)

    def sleep(self, seconds: float, name: str = "delay", lane: str | None = None, step: int = -1,
              slot: int = -1) -> None:
        cycles = int(seconds * _sleep_rate(self.dev.device))
        with torch.cuda.stream(self.stream):
            start = self.dev._span_start() if lane is not None else None
            torch.cuda._sleep(cycles)
            if lane is not None:
                self.dev._span_end(start, lane, name, step, slot)

    def synchronize(self, timeout: float | None = None) -> None:
        ev = self.dev.event()
        self.record(ev)
        ev.synchronize(timeout)
        self.dev.flush_timeline()


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, device: torch.device, timeline=None) -> None:
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.timeline = None
        self.default_stream = CudaStream(self, "default", torch.cuda.default_stream(self.device))
        self._streams: dict[str, CudaStream] = {"default": self.default_stream}
        self._pending: list[tuple] = []  # (start event, end event, lane, name, step, slot)
        self._closed = False
        self._ref: tuple[torch.cuda.Event, float] | None = None
        self.set_timeline(timeline)

    def set_timeline(self, timeline) -> None:
        self.flush_timeline()
        self.timeline, self._pending, self._ref = timeline, [], None
        if timeline is not None:  # pair a GPU timestamp with the host clock, once, with the GPU idle
            torch.cuda.synchronize(self.device)
            ref, host = torch.cuda.Event(enable_timing=True), timeline.now()
            ref.record(self.default_stream.stream)
            ref.synchronize()
            self._ref = (ref, host)

    def _span_start(self) -> torch.cuda.Event | None:
        if self.timeline is None:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # on the current stream, i.e. the one inside `with torch.cuda.stream(...)`
        return ev

    def _span_end(self, start, lane: str, name: str, step: int, slot: int) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, lane, name, step, slot))
        if len(self._pending) > 256:  # keep the list short without ever waiting
            self.flush_timeline()

    def flush_timeline(self) -> None:
        if self._ref is None:
            return
        ref, host = self._ref
        still = []
        for start, end, lane, name, step, slot in self._pending:
            if end.query():
                self.timeline.add(lane, name, host + ref.elapsed_time(start) / 1e3,
                                  host + ref.elapsed_time(end) / 1e3, step, slot)
            else:
                still.append((start, end, lane, name, step, slot))
        self._pending = still

    def stream(self, name: str) -> CudaStream:
        self._check()
        if name not in self._streams:
            self._streams[name] = CudaStream(self, name, _blocking_stream(self.device))
        return self._streams[name]

    def event(self) -> CudaEvent:
        return CudaEvent(self)

    def synchronize(self, timeout: float | None = None) -> None:
        self._check()
        if timeout is None:
            _wrap("device synchronize", lambda: torch.cuda.synchronize(self.device))
        else:
            events = [self.event() for _ in self._streams]
            for s, ev in zip(self._streams.values(), events):
                s.record(ev)
            deadline = time.monotonic() + timeout
            for ev in events:
                ev.synchronize(max(0.0, deadline - time.monotonic()))
        self.flush_timeline()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush_timeline()
        # no waiting: work already enqueued still runs; the streams serve the next device after it
        named = [s.stream for s in self._streams.values() if s is not self.default_stream]
        _free_streams.setdefault(self.device.index, []).extend(named)

    def _check(self) -> None:
        if self._closed:
            raise DeviceError("the device is closed")
