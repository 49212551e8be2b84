"""The private PyTorch and CPython hooks of the cpu device, one function each (tests/test_compat.py).

Why each hook is a function of its own here, and how tests/test_compat.py checks it: minibatch/core/compat.py.

    object_at          an object from its address (ctypes)                          devices/cpu_process.py
    share_fd           a storage's shared-memory file descriptor                    devices/cpu.py

It imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["object_at", "share_fd"]


def object_at(address: int):
    """The Python object at `address` (from `id()`), as a new reference.

    Why: the cpu device's process is a fork of the host, so every object that existed at the fork
    (the model) has a copy at the same address there; a message can name it by `id()` instead of
    pickling gigabytes of weights (devices/cpu_process.py). ctypes' `py_object` is the one way to turn
    an address back into an object; it trusts the address: a wrong one crashes the interpreter, so
    callers pass only ids of objects they made sure to keep alive across the fork. Same on every
    CPython 3; PyTorch plays no part.
    """
    return ctypes.cast(address, ctypes.py_object).value


def share_fd(storage: torch.UntypedStorage) -> tuple[int, int]:
    """(file descriptor, size in bytes) of a storage in shared memory (after `share_memory_()`).

    Why: the cpu device's process maps the host's tensors as its "device memory" and receives them as
    file descriptors over a Unix socket, once each (devices/cpu.py). torch.multiprocessing gets them
    the same way, through `UntypedStorage._share_fd_cpu_`; there is no public call. On 2.11 and 2.13
    it returns (fd, size) for a storage in file-descriptor shared memory (the default strategy on
    Linux) and moves one that is not there yet; the descriptor belongs to the storage: do not close it.
    """
    fd, nbytes = storage._share_fd_cpu_()
    return fd, nbytes
