"""Process-wide settings that open cpu devices hold: the GIL switch interval, torch's thread count.

Both cpu backends change settings that belong to the whole process, not to one device: the thread
backend shortens the interval after which Python makes a running thread hand over the GIL, and sets
torch's intra-op thread count so that the device's workers and the host do not fight over cores; the
process backend gives the host one torch thread (its second would wait for the core the device
process uses). Devices open and close in any order, so each setting counts its holders: the first
sets it, the last puts back what was there before the first.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import torch


class ProcessSetting:
    """A process-wide setting held while devices are open: the first holder sets it, the last one
    restores what was there. Held and released under a C-level lock (no interrupt in between)."""

    def __init__(self, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        self._get, self._set, self._lock = get, set_, threading.Lock()
        self._holders, self._saved = 0, None

    def hold(self, value) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = self._get()
                self._set(value)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self._set(self._saved)


SWITCH = ProcessSetting(sys.getswitchinterval, sys.setswitchinterval)
TORCH_THREADS = ProcessSetting(torch.get_num_threads, torch.set_num_threads)


def _after_fork_in_child() -> None:
    """A fork of a process with devices open has none of them: what they held goes back to what it was.

    Setting torch's thread count also rebuilds its intra-op thread pool here, on the one thread a fork
    leaves: torch replaces a pool inherited through fork the first time one is asked for, and when
    several threads ask at once (transformers loads weights from a thread pool) one of them can find no
    pool at all ("Invalid thread pool!")."""
    for setting in (SWITCH, TORCH_THREADS):
        if setting._holders:
            setting._set(setting._saved)
    torch.set_num_threads(torch.get_num_threads())
    start_afresh()


os.register_at_fork(after_in_child=_after_fork_in_child)


def start_afresh() -> None:
    """In a forked device process: the fork copied the host's holders, which are not this process's."""
    global SWITCH, TORCH_THREADS
    SWITCH = ProcessSetting(sys.getswitchinterval, sys.setswitchinterval)
    TORCH_THREADS = ProcessSetting(torch.get_num_threads, torch.set_num_threads)
