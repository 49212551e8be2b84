"""The host's end of the cpu device's channel: messages out, replies in (devices/cpu.py).

The host talks to its device process (devices/cpu_process.py) over one socket pair. Messages are
queued and go out as one write when work is launched (`_post`, `_flush`: a record or a wait rides with
the next launch), and with them, as one more write, the file descriptors of new shared-memory
storages. Replies come back on the same socket: an event reached, a timeline span, a failure in
device work. They are read whenever the host looks (`_drain`) or waits (`_wait_for`), so the reply
channel never fills up while the host only launches.

A message cut in half (an interrupt mid-send or mid-receive) or a device process that died leaves the
channel unusable: the failure is sticky (`_fail_channel`) and every later call raises it, as a GPU
error is. `CpuChannel` is the message half of `CpuDevice`, which holds its state (the socket pair,
the queue, the events and timelines the replies update) and mixes it in.
"""

from __future__ import annotations

import pickle
import signal
import time
from multiprocessing import reduction  # its sendfds exists only where Unix sockets carry descriptors

from .compat import share_fd
from . import cpu_process as device_process
from ..core.device import DeviceError, time_left


class RemoteError(Exception):
    """A failure inside device work that could not be rebuilt in the host: its traceback as text."""


class CpuChannel:
    """Messages between a CpuDevice (which mixes this in and holds the state) and its device process."""

    def _send_work(self, msg, what: str) -> None:
        pending: list = []
        try:
            data = device_process.dumps(msg, self._names, pending=pending)
        except DeviceError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DeviceError(f"{what}: its work or arguments cannot be sent to the device process: "
                              f"{type(exc).__name__}: {exc}") from exc
        self._post(data, flush=True)
        for obj, key in pending:  # sent: from now on the device knows them by key
            self._names.remember(obj, key)

    def _send(self, msg, storage=None, flush: bool = False) -> None:
        self._check()
        self._post(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), flush, storage)

    def _post(self, item: bytes, flush: bool, storage=None) -> None:
        """Queue a message (and a storage whose file descriptor goes with it); with `flush`, send the queue."""
        dropped = self._names.take_dropped()
        if dropped is not None:
            self._queue.append(pickle.dumps(("F", *dropped)))
        self._queue.append(item)
        if storage is not None:
            self._fds.append(storage)
        if flush:
            self._flush()

    def _flush(self) -> None:
        """Send the queued messages as one write, then their file descriptors as one more."""
        if not self._queue or self._broken:
            return
        batch, storages, self._queue, self._fds = self._queue, self._fds, [], []
        try:
            self._conn.send_bytes(pickle.dumps((batch, len(storages)), protocol=pickle.HIGHEST_PROTOCOL))
            if storages:
                reduction.sendfds(self._sock, [share_fd(st)[0] for st in storages])
        except BaseException as exc:
            self._fail_channel(exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise DeviceError(self._error[0]) from exc  # (a dead process: a broken pipe)
        self._drain()  # keep the reply channel from filling up while the host only launches

    def _fail_channel(self, exc: BaseException) -> None:
        """A message cut in half (an interrupt mid-send or mid-receive) or a dead process: sticky."""
        self._broken = True
        if self._error is not None:
            return
        # the error keeps no traceback: its frames would keep the run's buffers alive
        if isinstance(exc, KeyboardInterrupt):
            self._error = (_unreachable("interrupted in the middle of a message"), None)
            return
        self._error = (_unreachable(f"{type(exc).__name__}: {exc}", hint=True), None)  # first: an interrupt
        if self._closed:
            return  # (the process is gone and its handle closed)
        self._proc.join(0.2)  # a process that died closed its end first: let it be reaped, for its exit code
        code = self._proc.exitcode
        if code is not None:
            how = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
            self._error = (_unreachable(f"it died: {how}", hint=True), None)

    def failure(self) -> str | None:
        if self._error is not None:
            return self._error[0]
        code = None if self._closed else self._proc.exitcode  # (polls the process: never waits)
        if code is None:
            return None
        how = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        return f"the cpu device's process (pid {self._proc.pid}) died: {how}"

    def _recv(self) -> None:
        try:
            msg = pickle.loads(self._conn.recv_bytes())
        except BaseException as exc:
            self._fail_channel(exc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise DeviceError(self._error[0]) from exc
        op = msg[0]
        if op == "r":
            ev = self._events.get(msg[1])
            if ev is not None and msg[2] > ev._reached:
                ev._reached = msg[2]
        elif op == "p":
            tl = self._timelines.get(msg[1])
            if tl is not None:
                _, _, lane, name, start, end, step, slot = msg
                tl.add(lane, name, start - tl.t0, end - tl.t0, step, slot)
        elif op == "e" and self._error is None:
            _, message, blob, text = msg
            cause = pickle.loads(blob) if blob is not None else RemoteError(text)
            self._error = (message, cause)

    def _drain(self) -> None:
        if self._broken or self._closed:
            return
        if self._queue:
            self._flush()  # _flush drains after sending
        while self._conn.poll(0):
            self._recv()

    def _wait_for(self, done, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._drain()
            self._check()
            if done():
                return
            left = time_left(deadline, timeout, what)
            try:
                ready = self._conn.poll(left)
            except BaseException as exc:
                if not isinstance(exc, KeyboardInterrupt):  # an interrupt in poll cuts no message
                    self._fail_channel(exc)
                raise
            if ready:
                self._recv()


def _unreachable(why: str, hint: bool = False) -> str:
    tail = (" If it dies every time on this machine, MINIBATCH_CPU_DEVICE=cpu-threads runs the device as "
            "threads of this process instead (README, common problems)") if hint else ""
    return f"the device process cannot be reached any more ({why}); open a new device.{tail}"


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)
