"""Every private PyTorch or CPython hook the package uses, one function each (tests/test_compat.py).

minibatch keeps to public APIs where one exists. Where none does, the hook lives here, so that a new
PyTorch or Python version breaks one function with a name and a test, not a loop somewhere far away.
Each function says why it is needed, what it relies on, and what it does on the PyTorch versions the
project runs on (2.13 on the CPU, 2.11 on the GPU machine of BENCHMARKS.md); tests/test_compat.py
checks each hook on whichever version is installed, so running it under another one says which
hooks still hold.

    tensor_version     a tensor's in-place write counter (Tensor._version)          model/model.py
    rebind_data        point a parameter at other storage (Tensor.data = ...)       speed/siblings.py
    LINEAR(_TARGETS)   the function an FX graph's linear nodes call                speed/siblings.py
    inductor_compile   Inductor, as torch.compile's backend would run it            speed/siblings.py
    raise_recompile_limit / mark_dynamic   torch._dynamo's limit and shape hints    speed/compiled.py
    referenced_elsewhere   reference counts as a copy-on-write test                 core/decode_keys.py
    object_at          an object from its address (ctypes)                          devices/cpu_process.py
    share_fd           a storage's shared-memory file descriptor                    devices/cpu.py

This module sits at the bottom of the layers: it imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["tensor_version", "rebind_data", "LINEAR", "LINEAR_TARGETS", "inductor_compile", "raise_recompile_limit",
           "mark_dynamic", "referenced_elsewhere", "object_at", "share_fd"]


def tensor_version(t: torch.Tensor) -> int:
    """How many in-place writes `t`'s storage has seen (-1 where torch keeps no count).

    Why: an engine keeps CUDA graphs and a forked device process that read the model's weights where
    they were; it must notice weights written in place (`load_state_dict`, `copy_`), which leave the
    address unchanged. Autograd's version counter is the only record of such writes; torch has no
    public name for it. On 2.11 and 2.13 `Tensor._version` is an int bumped by every in-place op;
    reading it on a tensor made under `torch.inference_mode` raises RuntimeError (such tensors keep no
    counter), hence -1.
    """
    try:
        return t._version
    except RuntimeError:
        return -1


def rebind_data(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make `t` (a Parameter, typically) use `new`'s storage, keeping the Python object `t` itself.

    Why: stacking a layer's q/k/v weights into one tensor (speed/siblings.py) must leave every module
    holding the same Parameter object (hooks, optimizers, `named_parameters` and transformers' tied
    weights refer to it), now a view of the stacked block. `Tensor.data = ...` is the only way to swap
    the storage under an existing Parameter; `torch.utils.swap_tensors` swaps whole objects instead.
    On 2.11 and 2.13 it replaces the tensor's storage, shape, strides and offset without autograd
    seeing it; shape and dtype must match what `t` was (checked here, so a mistake is not silent).
    """
    if new.shape != t.shape or new.dtype != t.dtype:
        raise ValueError(f"rebind_data: {tuple(new.shape)} {new.dtype} cannot stand in for {tuple(t.shape)} {t.dtype}")
    t.data = new


#: What a `torch.nn.functional.linear` call is in an FX graph that torch.compile hands its backend
#: (dynamo records the C++ binding `torch._C._nn.linear`), and what a graph rewrite inserts for a new
#: linear call. On 2.11 and 2.13 `F.linear` *is* that binding (one object); LINEAR_TARGETS holds both
#: names, so a node still matches should a version wrap the binding in a Python function.
LINEAR = torch._C._nn.linear
LINEAR_TARGETS: tuple = tuple({id(f): f for f in (LINEAR, torch.nn.functional.linear)}.values())


def inductor_compile(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None):
    """Compile an FX graph with Inductor as `torch.compile(mode=mode)` would, and return the callable.

    Why: a custom torch.compile backend (speed/siblings.py rewrites the graph first) must then hand it
    to Inductor with the options that `mode` stands for. torch exports no function for either step:
    `torch._inductor.compile_fx.compile_fx` is what the "inductor" backend calls, and
    `torch._inductor.list_mode_options` maps a mode name to its config patches. Both exist with these
    signatures on 2.11 and 2.13 ("max-autotune-no-cudagraphs" -> max_autotune and coordinate descent).
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = list_mode_options(mode, dynamic=False) if mode else None
    return compile_fx(gm, example_inputs, config_patches=options)


def raise_recompile_limit(at_least: int = 64) -> None:
    """Let torch.compile keep at least `at_least` compiled versions of one function.

    Why: a compiled decode step is compiled once per shape (rows x keys bucket); past dynamo's limit
    (8 by default) it silently runs uncompiled. The limit is a global config value of the private
    `torch._dynamo` module, so this changes it for the whole process (only ever upwards). Its name is
    `recompile_limit` on 2.11 and 2.13; older versions called it `cache_size_limit` (2.13 keeps that
    name as an alias), so both are raised where present.
    """
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(at_least, getattr(dynamo.config, name)))


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that `t`'s size along `dim` varies between calls: one compile serves all.

    Why: the Triton decode attention reads any number of keys per row, so the key tensors' length need
    not cost a compile each. `torch._dynamo.mark_dynamic` is the documented way, under a private
    module name; on 2.11 and 2.13 it tags the tensor object, and a later compile of a graph reading
    it makes that size symbolic.
    """
    import torch._dynamo as dynamo

    dynamo.mark_dynamic(t, dim)


def referenced_elsewhere(obj, owners: int = 1) -> bool:
    """True if anything besides `owners` known references (list items, attributes) holds `obj`.

    Why: the decode key table (core/decode_keys.py) hands out views of its arrays; while a caller
    still holds a batch built on them, the next step must write to a copy (copy on write), and when
    none does it may write in place, which keeps the host's work per step O(rows). numpy tracks no
    views, so the reference count of the base array is the test (a view holds its base). CPython's
    `sys.getrefcount` also counts the references the call itself makes (this function's argument,
    getrefcount's own), and how many those are differs between CPython versions; so the count of an
    object with exactly one owner is measured once, at import, through a function shaped like this one
    (`_BASELINE`: 3 on CPython 3.11), and `obj`'s count is compared with it.
    """
    return sys.getrefcount(obj) > _BASELINE + owners - 1


def _one_owner(obj) -> int:
    return sys.getrefcount(obj)  # (the same call as in referenced_elsewhere: the same extra references)


def _calibrate() -> int:
    holder = [object()]
    return _one_owner(holder[0])


_BASELINE = _calibrate()


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
