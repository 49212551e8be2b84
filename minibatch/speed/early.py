"""Kernels launched early: programmatic dependent launch on Hopper and later GPUs (notebook 07).

In a CUDA graph a kernel starts once the kernel before it has finished, and then needs a moment to get
going (its programs placed, its first loads answered). A small model's decode step is ~350 such
kernels. With programmatic dependent launch a kernel may be launched while its predecessor still
runs: it does what does not depend on that kernel, waits (`gdc_wait`) until the predecessor's writes
are visible, and the predecessor says when its successor may launch (`gdc_launch_dependents`).

    inductor_options(device)   Inductor's `triton.enable_pdl` for a compiled step, where it exists
    inside()                   a context: our kernels launch early while it is open (CompiledStep's calls)
    wanted() / has_pdl(device) whether a launch now should be early / can be, on this device
    prefetch_l2                (Triton) ask for a line of memory to be brought into L2, nothing returned

Our kernels (skinny.py's product, triton_decode.py's attention) launch early only inside compiled steps,
where the kernels around them are Inductor's and let them start early; in an eager step a PyTorch
kernel precedes them, which never does, and the work done before waiting would only add time.
`ENABLED` switches our kernels' early launches off (floor_matrix.py --variants ... early=0).

Why a kernel that waits only for the kernel right before it still sees what earlier ones wrote: every
kernel lets its successor launch only after its own `gdc_wait` (Inductor writes a wait after a kernel's
first load even where it reads nothing of its predecessor; ours wait before their main loop and signal
after it), so no kernel finishes before the kernels before it have. cuBLAS's and PyTorch's kernels are
never launched early and never signal early: after them, everything behaves as without it.
Measured: BENCHMARKS.md, small models.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

#: whether our kernels launch early inside compiled steps (where the GPU has it)
ENABLED = True
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("minibatch_early_launch", default=False)


@contextlib.contextmanager
def inside():
    """While open, `wanted()` is true (if ENABLED): the calls of a compiled step, its graph capture included."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def wanted() -> bool:
    return ENABLED and _inside.get()


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched early: compute capability 9.0 and up, and not under
    Triton's CPU interpreter (which has no grid-dependency instructions)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def inductor_options(device: torch.device) -> dict:
    """Inductor's config for early launches on `device` where it has it: each generated kernel waits for
    its predecessor only before reading what that one wrote, and lets its successor launch after its
    own loads. Empty where the GPU or this torch's Inductor lacks it."""
    import torch._inductor.config as inductor_config

    if not (has_pdl(device) and hasattr(inductor_config.triton, "enable_pdl")):
        return {}
    return {"triton.enable_pdl": True}


if triton is not None:

    @triton.jit
    def prefetch_l2(ptrs):
        """Ask for these addresses' 128-byte lines to be brought into L2 (a hint: nothing is returned)."""
        return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)
else:
    prefetch_l2 = None
