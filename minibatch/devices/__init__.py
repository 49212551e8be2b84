"""The device layer: streams, events, launching work, copies, injected delays (notebooks 02, 03).

Everything the loops do on the device goes through one small interface with two backends:

    dev = get_device("cuda" | "cpu", timeline)
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    h2d.copy(dev_in, host_in);  h2d.record(h2d_done)        # enqueue, return at once
    compute.wait(h2d_done);     compute.launch(forward)     # the *stream* holds, not the host
    compute.record(done);       d2h.wait(done);  d2h.copy(host_out, dev_out);  d2h.record(d2h_done)
    d2h_done.synchronize(timeout=5)                         # the host blocks only here

which gives the article's pipeline, the host free while the device works:

    host     launch ×3 ─────── prepare batch N+1 ──────────── sync(d2h_done) ─ update
    H2D      ██copy██ ●h2d_done
    compute           ╎ wait ███████ forward + sample ███████ ●done
    D2H                                                       ╎ wait ██copy██ ●d2h_done

Drop the waits and compute reads its input before the copy has landed (the "broken pipeline" of
notebook 03; `s.sleep(seconds)` on the copying stream makes that happen every time). Launch anything
on `dev.default_stream` (the legacy default stream) and it waits for all earlier work on every stream,
and all later work waits for it: concurrency gone (notebook 02).

  cuda  thin wrappers over torch.cuda streams and events (devices/cuda.py).
  cpu          an emulated device in a process of its own (devices/cpu.py): it computes beside the
               host, on another core, as a GPU does.
  cpu-threads  the same device as worker threads of the host's interpreter (devices/threads.py):
               really concurrent, but sharing the host's GIL; device work may touch host objects.

  thread_streams.py  the cpu-threads device's streams (a worker thread and its queue each) and events.
  cpu_process.py  the cpu device's process: its message loop, running work on its streams.
  cpu_channel.py  the host's end of that process's socket: messages queued and sent, replies read.
  names.py      how work's objects travel to the cpu device process (shared storages, named objects).
  settings.py   process-wide settings the cpu devices hold (GIL switch interval, torch threads).
  lifecycle.py  how the cpu device process ends with its host, what a fork of the host inherits, and
                the registry of open devices (held weakly, with no Python callback).
  limits.py     how much host memory this process may still allocate (free memory, ulimit, cgroup).
  compat.py     the private PyTorch and CPython hooks of the cpu device (an object from its address,
                a storage's shared-memory descriptor).

This module is the front door: it opens a backend, and installs `get_device` as the opener the core's
engine calls (core/device.py `open_device`). The interface the backends implement, and the errors,
are the core's (minibatch/core/device.py): the backends plug into it, the core imports none of them.

Work writes its results into preallocated tensors (`dev.empty`, `dev.pin`); return values are dropped.
A failure in device work is raised in the host as `DeviceError`; a wait past its timeout raises
`DeviceTimeoutError` (a `DeviceError` and a `TimeoutError`).

Timeline spans: each launch/copy becomes a span on its `lane` with `name`, `step`, `slot`, added
without a host sync (each backend's docstring says how).
"""

from __future__ import annotations

import multiprocessing
import os
import warnings

import torch

from .cpu import CpuDevice
from .cuda import CudaDevice
from .threads import ThreadDevice
from . import limits
from ..core.device import Device, DeviceError, DeviceTimeoutError, Event, Stream, use_host_memory, use_opener

BACKENDS = ("cpu", "cpu-threads", "cuda")
CPU_DEVICE_VAR = "MINIBATCH_CPU_DEVICE"  # "cpu-threads": every "cpu" device opens as threads

__all__ = ["get_device", "BACKENDS", "Device", "Stream", "Event", "DeviceError", "DeviceTimeoutError"]


def get_device(kind: str = "cpu", timeline=None, inherit=(), **options) -> Device:
    """Open the device layer: "cpu" (an emulated device process), "cpu-threads" (emulated with threads of
    this process) or "cuda"/"cuda:N" (a GPU).

    "cpu" falls back to "cpu-threads", with a warning, where no device process can run: on a platform
    that cannot fork (Windows), in a daemonic process (a multiprocessing.Pool worker), and in a process
    that has started CUDA. The environment variable
    MINIBATCH_CPU_DEVICE=cpu-threads makes every "cpu" device threads (for a machine where the device
    process fails).

    `timeline` (a minibatch.core.timeline.Timeline or None) receives a span per launch and copy. Options go
    to the backend (cpu, cpu-threads: `switch_interval`, `torch_threads`). `inherit`: objects device work
    will use that exist now (the model): the cpu device's process inherits them when it forks, instead
    of receiving a copy at the first launch; other backends share them with the host anyway.
    Close the device, or use it in a `with`.
    """
    name = str(kind)
    thread_options = {k: v for k, v in options.items() if k in ("switch_interval", "torch_threads")}
    if name == "cpu" and _cpu_backend() == "cpu-threads":
        return ThreadDevice(timeline, **thread_options)
    if name == "cpu" and "fork" not in multiprocessing.get_all_start_methods():
        # (Windows) the device process is a fork that inherits the model, and shared memory travels as
        # file descriptors over a Unix socket: neither exists there
        return _threads_instead("this platform cannot fork, so the cpu device cannot start a device process",
                                timeline, thread_options)
    if name == "cpu" and multiprocessing.current_process().daemon:
        # (a multiprocessing.Pool worker) a daemonic process may not start processes of its own
        return _threads_instead("this is a daemonic process (a multiprocessing.Pool worker, say), which may not "
                                "start one, so the cpu device cannot fork a device process", timeline, thread_options)
    if name == "cpu" and torch.cuda.is_initialized():
        # a forked child of a process that has started CUDA cannot touch CUDA again (it dies with
        # "CUDA error: initialization error" as soon as torch asks for a device): on a GPU machine
        # that has used its GPU, the emulated device runs as threads of this process instead (Python's
        # default warning filter says so once per calling line)
        return _threads_instead("this process has started CUDA, so the cpu device cannot fork a device process",
                                timeline, thread_options)
    if name == "cpu":
        return CpuDevice(timeline, inherit=inherit, **options)
    if name == "cpu-threads":
        return ThreadDevice(timeline, **options)
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} asked for, but this PyTorch build sees no CUDA GPU; use 'cpu'")
        return CudaDevice(torch.device(name), timeline, **options)
    raise ValueError(f"unknown device {kind!r}: use 'cpu', 'cpu-threads' or 'cuda'")


use_opener(get_device)  # what core.device.open_device (the engine's way in) calls
use_host_memory(limits.host_bytes_free)  # what core.device.host_bytes_free (the run's memory check) calls


def _cpu_backend() -> str:
    """Which backend "cpu" opens: the device process, unless MINIBATCH_CPU_DEVICE says otherwise (an
    escape hatch for a machine where the device process cannot work; README, common problems)."""
    choice = os.environ.get(CPU_DEVICE_VAR, "").strip()
    if choice in ("", "cpu", "cpu-threads"):
        return choice or "cpu"
    raise ValueError(f"{CPU_DEVICE_VAR}={choice!r} is not a cpu backend: use 'cpu' (a device process, the "
                     "default) or 'cpu-threads'")


def _threads_instead(why: str, timeline, options: dict) -> ThreadDevice:
    """"cpu" where no device process can run: say why (to get_device's caller), open threads instead."""
    warnings.warn(f"{why}: it runs as cpu-threads (same semantics, no overlap with the host's Python)", stacklevel=3)
    return ThreadDevice(timeline, **options)
