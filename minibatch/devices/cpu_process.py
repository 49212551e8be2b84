"""The device side of the `cpu` backend: a process that runs launched work on its own streams.

The host (devices/cpu.py) sends messages over a socket pair; this process owns what a GPU would own:
the model's weights (inherited when it was forked), the KV cache and the device side of the IO
slots (shared memory), and the objects device work keeps using (sent once, then named). It runs
the work on the thread engine of devices/threads.py, one worker per stream, and answers with events
reached, spans and errors.

Messages, host -> device (tuples, pickled with `Pickler` below; the host queues them and sends the
queue as one write at each launch, synchronize or query, then the file descriptors of the queued
storages as one more):

    ("L", stream, fn, args, opts, grad, inference, timeline)   launch fn(*args)
    ("S", stream, seconds, opts, timeline)                     sleep (an injected delay)
    ("R" | "W", stream, event)                                 record / wait
    ("s", key, nbytes)                                         a new shared-memory storage
    ("F", storage keys, object keys)                           the host dropped these
    ("X",)                                                     exit now

device -> host: ("k",) ready, ("r", event, seq) reached, ("p", timeline, lane, name, start, end,
step, slot) a span (time.perf_counter, which is CLOCK_MONOTONIC, shared by both processes),
("e", message, exception or None, traceback text) the device failed (sticky).

Pickling. Work and arguments are pickled at launch (bound then, as a kernel's are): functions of a
module by reference, lambdas and closures by value (cloudpickle); a tensor in shared memory as
(storage key, offset, shape, stride, dtype); an object that stays on the device (a torch module,
the model, the KV cache, the step runner) as a reference: its address when it existed at fork time
(the child has a copy of it at the same address), else by value the first time and by key after.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import socket
import threading
import time
import traceback

import cloudpickle
import torch
from multiprocessing import reduction  # its recvfds exists only where Unix sockets carry descriptors

from .compat import object_at
from ..core.device import DeviceError
from . import lifecycle
_SIDE: "DeviceSide | None" = None  # the device process's state, for the rebuild functions below


class Pickler(cloudpickle.Pickler):
    """Pickles device work for the device process; `names` (the host proxy) decides what is a reference.

    `reducer_override` is called only for objects that are not ints, strings, tuples, lists or dicts,
    so the cost per launch is a few Python calls, not one per pickled object.
    """

    def __init__(self, file, names, top=None, inside_resident: bool = False, pending: list | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names, self.top, self.inside_resident = names, top, inside_resident
        self.pending = [] if pending is None else pending  # objects sent by value: named once delivered

    def reducer_override(self, obj):
        if obj is not self.top:
            ref = self.names.reference(obj, self)
            if ref is not None:
                return ref
        return super().reducer_override(obj)


def dumps(obj, names, top=None, inside_resident: bool = False, pending: list | None = None) -> bytes:
    buf = io.BytesIO()
    Pickler(buf, names, top, inside_resident, pending).dump(obj)
    return buf.getvalue()


# rebuild functions, called while the device process unpickles a message
def view(key: int, offset: int, shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in a registered shared-memory storage (views are cached: a step reuses the same ones)."""
    pid = (key, offset, shape, stride, dtype)
    t = _SIDE.views.get(pid)
    if t is None:
        t = _SIDE.views[pid] = torch.empty(0, dtype=dtype).set_(_SIDE.storages[key], offset, shape, stride)
    return t


def forked(address: int):
    """An object that existed when this process was forked: its copy sits at the same address here."""
    return object_at(address)


def named(key: int):
    return _SIDE.objects[key]


def named_new(key: int, data: bytes):
    obj = _SIDE.objects[key] = pickle.loads(data)
    return obj


class _SpanSink:
    """The thread engine's timeline inside the device process: spans go back to the host."""

    def __init__(self, side: "DeviceSide", key: int) -> None:
        self.side, self.key = side, key

    def now(self) -> float:
        return time.perf_counter()

    def add(self, lane, name, start, end, step=-1, slot=-1) -> None:
        self.side.reply(("p", self.key, lane, name, start, end, step, slot))


class DeviceSide:
    """State of the device process: storages, objects, events, the thread engine."""

    def __init__(self, conn, switch_interval: float, torch_threads: int) -> None:
        from .threads import ThreadDevice

        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))  # file descriptors come over it
        self.fds: list[int] = []
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.views: dict[tuple, torch.Tensor] = {}
        self.objects: dict[int, object] = {}
        self.events: dict[int, object] = {}
        self.sinks: dict[int, _SpanSink] = {}
        self.send_lock = threading.Lock()
        self.dev = ThreadDevice(None, switch_interval, torch_threads,
                                on_reached=lambda ev, seq: self.reply(("r", ev.key, seq)), on_error=self.failed)
        global _SIDE
        _SIDE = self

    def reply(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def failed(self, message: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(exc))
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 — an exception the host cannot rebuild travels as text
            blob = None
        self.reply(("e", message, blob, text))

    def event(self, key: int):
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = self.dev.event()
            ev.key = key
        return ev

    def sink(self, key):
        if key is None:
            return None
        if key not in self.sinks:
            self.sinks[key] = _SpanSink(self, key)
        return self.sinks[key]

    def handle_batch(self, data: bytes) -> bool:
        """Run one batch of messages (the host sends what it queued at each launch); False: exit."""
        items, nfds = pickle.loads(data)
        self.fds = list(reduction.recvfds(self.sock, nfds)) if nfds else []
        for item in items:
            try:
                msg = pickle.loads(item)
            except BaseException as exc:  # noqa: BLE001 — bad work must fail the device, not kill it
                self.dev.fail(f"device work could not be unpacked: {type(exc).__name__}: {exc}", exc)
                continue
            try:
                if not self.handle(msg):
                    return False
            except DeviceError:
                pass  # the device has failed already; the host has been told
        return True

    def handle(self, msg) -> bool:
        op = msg[0]
        if op == "L":
            _, stream, fn, args, opts, grad, inference, tl = msg
            self.dev.timeline = self.sink(tl)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self.dev.stream(stream).launch(fn, *args, **opts)
        elif op == "R":
            self.dev.stream(msg[1]).record(self.event(msg[2]))
        elif op == "W":
            self.dev.stream(msg[1]).wait(self.event(msg[2]))
        elif op == "S":
            _, stream, seconds, opts, tl = msg
            self.dev.timeline = self.sink(tl)
            self.dev.stream(stream).sleep(seconds, **opts)
        elif op == "s":
            fd = self.fds.pop(0)
            try:
                self.storages[msg[1]] = torch.UntypedStorage._new_shared_fd_cpu(fd, msg[2])
            finally:
                os.close(fd)
        elif op == "F":
            dropped = set(msg[1])
            for key in msg[1]:
                self.storages.pop(key, None)
            self.views = {k: v for k, v in self.views.items() if k[0] not in dropped}
            for key in msg[2]:
                self.objects.pop(key, None)
        elif op == "X":
            return False
        return True


def serve(conn, host_conn, switch_interval: float, torch_threads: int, cores=None, watch=None) -> None:
    """The device process's main loop (the target of the forked process); never returns normally.

    `watch`: (the host's pid, the read end of its alive pipe, whether to ask for the parent-death
    signal): this process ends when the host does (devices/lifecycle.py)."""
    code = 0
    try:
        host_conn.close()  # our copy of the host's end: the host's exit must reach us as end-of-file
        if watch is not None:
            lifecycle.die_with_host(*watch)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle; it then closes us
        # SIGTERM ends this process, as it ends any: a handler the host had installed (a server's
        # graceful stop) came along with the fork, and would otherwise swallow it here
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if cores:  # this process and the threads it starts stay off the host's core
            try:
                os.sched_setaffinity(0, cores)
            except OSError:  # (a sandbox that forbids it) pinning is a speed-up, not a requirement
                pass
        torch.set_num_threads(torch_threads)
        from . import settings as process_settings, threads as td  # the host's bookkeeping, copied by the fork, is not ours

        process_settings.start_afresh()
        td.forget_open_devices()
        side = DeviceSide(conn, switch_interval, torch_threads)
        side.reply(("k",))
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the host has gone
            if not side.handle_batch(data):
                break
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no teardown of the workers: the host is done with us
