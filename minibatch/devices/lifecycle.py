"""How the `cpu` device process lives and dies with its host, and what a fork of the host inherits.

A CUDA context ends with the process that made it; the emulated device is a second process, so the
host's end has to reach it however the host ends: a clean close sends "exit", but SIGKILL, SIGTERM
or `os._exit` run no Python at all. Two things the kernel does on its own tell the device instead:

    host                                   device process
    alive pipe: write end (held only) ──▶  watcher thread: read() returns b"" (end of file) ─▶ _exit
    the forking thread exits          ──▶  PR_SET_PDEATHSIG (Linux): SIGKILL

End of file comes only when every copy of the write end is closed, so no other process may keep one:
a fork of the host (a later device process, a `multiprocessing` worker, a user's `os.fork`) closes
its copies at once (`after_fork_in_child` hooks in devices/cpu.py and devices/threads.py). The
parent-death signal fires when the *thread* that forked ends, so it is asked for only when the
device is opened from the main thread (which lives as long as the process); the pipe covers the rest,
and every platform that can fork. `OpenDevices` is the registry of a backend's open devices that
those hooks (and the exit hooks) walk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import weakref

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def opener_message(opener: int) -> str:
    """The error of a device (and so of the Engine that holds it) used in a fork of the process that opened it."""
    return (f"this device was opened by process {opener}; this process ({os.getpid()}) is a fork of it and "
            "cannot use it: open a new Engine (or device) in this process")


def parent_death_signal_possible() -> bool:
    """True where the kernel can signal the device when its forking thread ends: Linux, from the main thread."""
    return sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()


def die_with_host(host_pid: int, alive_fd: int, parent_death_signal: bool) -> None:
    """In the device process: end as soon as the host has ended (see the module docstring)."""
    if parent_death_signal:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the pipe alone tells us
            pass
    threading.Thread(target=_watch, args=(alive_fd,), name="minibatch-host-watch", daemon=True).start()
    if os.getppid() != host_pid:  # the host ended before the signal was asked for
        os._exit(0)


def _watch(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 1):
                break  # end of file: the host's write end is closed, so the host is gone (or closed us)
        except InterruptedError:
            continue
        except OSError:
            break
    os._exit(0)  # no atexit handlers, no teardown of the workers: nobody is left to use their results


class OpenDevices:
    """The devices of this process still open, held weakly: closed at exit, disowned in a fork.

    Not a `weakref.WeakSet`: its clean-up callback is Python code that runs wherever a device's last
    reference goes, and a Ctrl-C landing in it is swallowed by the interpreter ("Exception ignored
    in ..."). Here the callback is the set's own `discard`, a C function: no Python code runs."""

    def __init__(self) -> None:
        self._refs: set = set()

    def add(self, dev) -> None:
        dev._open_ref = ref = weakref.ref(dev, self._refs.discard)
        self._refs.add(ref)

    def discard(self, dev) -> None:
        self._refs.discard(getattr(dev, "_open_ref", None))

    def __iter__(self):
        return iter([dev for ref in list(self._refs) if (dev := ref()) is not None])

    def clear(self) -> None:
        self._refs.clear()
