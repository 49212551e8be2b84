"""Weights asked into L2 ahead of the cuBLAS products that read them (an experiment, off: `ENABLED`).

Why: in a small model's decode step the products that stay on cuBLAS (the merged q/k/v and gate/up with
1-4 rows, every product with 8) read 8-12 MB of weights each, and take about twice the time those bytes
need at the copy bandwidth: too few of cuBLAS's tiles to keep enough loads in flight, so each one waits
out a trip to memory. Our own kernels before them (skinny.py's product, the decode attention) leave the
memory mostly idle: they wait on chains of loads too. So each of our kernels, once its own loads are
done, asks for the weights of the cuBLAS products that follow it to be brought into L2 (50 MB on an
H100 or H200), and those products then read them from there:

    plan(gm, real, weight_of)  a pass over a compiled decode step's graph (siblings.py's backend, after
                               skinny.route): for each of our kernels' calls, the weights of the products
                               after it, up to the next decode attention, in graph order
    targets(anchor, rows, ..)  at launch (`choose`): those of them that run on cuBLAS at `rows`, up to the
                               first one skinny.py's kernel takes (it asks for its own weights), `BYTES`
                               at most
    launch_args(...)           the pointers and line counts a kernel takes for them (`MAX` at most)
    prefetch(...)              (Triton) a program's share of those lines

The plan is keyed by the address of the call's own weight (skinny) or key cache (attention): the kernel
is called by Inductor as it is, and looks its plan up when launched (once per CUDA graph capture). A
prefetch is only a hint: it changes no result.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

from .early import prefetch_l2

#: Whether compiled steps plan prefetches (read when a step is compiled) and our kernels issue them.
ENABLED = False
#: Issue them before the kernel's own wait and main loop (True) or after its main loop (False).
EARLY = False
#: Only the decode attention asks, for every product up to the next attention (skinny.py's too, whose
#: kernel reads slowly where it streams a larger weight than its own): the attention waits on chains of
#: loads and leaves the memory idle, where skinny.py's kernel streams weights itself.
FROM_ATTENTION = False
#: Instead of our kernels asking, a kernel of its own on a second stream asks (`side`): launched as each
#: decode attention starts, beside the step's kernels, for every product up to the next attention; joined
#: back at that attention. One stream's kernel that asks ends only once its lines have come (measured): a
#: kernel beside them does not hold up the step's own.
SIDE = False
#: Programs of that kernel.
PROGRAMS = 32
#: The most bytes one kernel asks for: the products it covers must fit in L2 beside the step's other traffic.
BYTES = 32 << 20
#: The most tensors one kernel covers (each is one pointer argument of the kernel).
MAX = 4
#: Lines per program per loop step of `prefetch` (its BLOCK argument).
BLOCK = 256

_PLAN: dict[int, list[torch.Tensor]] = {}
_ORDER: dict[int, tuple[int, int]] = {}  # a decode attention's key cache -> (its place, how many in the step)
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_forked = [False]  # whether a side kernel runs that the next attention joins back


def plan(gm: torch.fx.GraphModule, real: dict, weight_of) -> int:
    """Record, for each call of skinny.py's operator or the decode attention in `gm`, the weights of the
    products after it up to the next decode attention. `real`: the graph's inputs (placeholder node ->
    tensor); `weight_of(arg, real)`: the tensor a product's weight argument stands for, or None
    (skinny._weight). Returns how many calls got a plan."""
    from .compat import LINEAR_TARGETS

    ops = torch.ops.minibatch
    attention = {getattr(ops, name): place  # (which argument is its key cache; registered where imported)
                 for name, place in (("paged_decode", 1), ("paged_decode_fresh", 8)) if hasattr(ops, name)}
    calls = []  # (kind, the tensor that keys it or None, its weight or None), in graph order
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        packet = getattr(node.target, "overloadpacket", node.target)  # (an operator's overload, or the operator)
        if packet in attention:
            place = attention[packet]
            calls.append(("attention", real.get(node.args[place]) if len(node.args) > place else None, None))
        elif node.target in LINEAR_TARGETS or packet is ops.skinny_linear:
            weight = weight_of(node.args[1], real) if len(node.args) > 1 else None
            ours = packet is ops.skinny_linear
            calls.append(("skinny" if ours else "linear", weight if ours else None, weight))
    caches = [key for kind, key, _ in calls if kind == "attention" and isinstance(key, torch.Tensor)]
    _ORDER.update({key.data_ptr(): (i, len(caches)) for i, key in enumerate(caches)})
    planned = 0
    for i, (kind, key, _) in enumerate(calls):
        if kind == "linear" or not isinstance(key, torch.Tensor):
            continue
        after = []
        for other_kind, _, weight in calls[i + 1:]:
            if other_kind == "attention":
                break
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                after.append(weight)
        if after:
            _PLAN[key.data_ptr()] = after
            planned += 1
    return planned


def targets(anchor: torch.Tensor, rows: int, taken, attention: bool = False) -> list[torch.Tensor]:
    """The weights the kernel keyed by `anchor` (the decode attention's key cache where `attention`) asks
    into L2 at `rows` rows (`choose` of its plan; with FROM_ATTENTION, all of it for the attention, none
    for skinny.py's kernel)."""
    if not (ENABLED and usable(anchor)) or SIDE or (FROM_ATTENTION and not attention):
        return []
    return choose(_PLAN.get(anchor.data_ptr(), []), rows, (lambda *shape: None) if FROM_ATTENTION else taken)


def choose(weights: list[torch.Tensor], rows: int, taken) -> list[torch.Tensor]:
    """The first of `weights` that run on cuBLAS at `rows` rows, in order, up to the first that
    skinny.py's kernel takes (`taken(rows, n, k)` not None: skinny.settings), `BYTES` and `MAX` at most."""
    out, total = [], 0
    for weight in weights:
        size = weight.numel() * weight.element_size()
        if taken(rows, *weight.shape) is not None or total + size > BYTES or len(out) == MAX:
            break
        out.append(weight)
        total += size
    return out


def side(anchor: torch.Tensor, rows: int) -> bool:
    """(SIDE) Before the decode attention keyed by `anchor` launches: join back the side kernel an earlier
    attention of the step started, then (unless it is the step's last) start one for every product up to
    the next attention (`choose` with nothing taken), on the side stream after what the step queued so far.
    Returns whether it started one."""
    if not (ENABLED and SIDE and usable(anchor)):
        return False
    place, count = _ORDER.get(anchor.data_ptr(), (0, 0))
    main = torch.cuda.current_stream(anchor.device)
    index = anchor.device.index if anchor.device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:  # (made once, before any capture: a step runs eagerly before its graph)
        _SIDE_STREAMS[index] = torch.cuda.Stream(anchor.device)
    stream = _SIDE_STREAMS[index]
    if place == 0:
        _forked[0] = False  # (a new step: nothing of an earlier one to join)
    if _forked[0]:
        main.wait_stream(stream)
        _forked[0] = False
    weights = choose(_PLAN.get(anchor.data_ptr(), []), rows, lambda *shape: None) if place + 1 < count else []
    if not weights:
        return False
    args, constants = launch_args(weights, weights[0])
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        _side_kernel[(PROGRAMS,)](*args, COUNT=len(weights), STEP=constants["AHEAD_STEP"], BLOCK=BLOCK)
    _forked[0] = True
    return True


def usable(t: torch.Tensor) -> bool:
    """Prefetches run on CUDA only, and not under Triton's CPU interpreter (which has no inline assembly)."""
    return (t.is_cuda and triton is not None
            and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"))


def launch_args(weights: list[torch.Tensor], fallback: torch.Tensor) -> tuple[list, dict]:
    """A kernel's prefetch arguments for `weights` (one element size): `MAX` pointers (`fallback` where
    unused) and each one's count of 128-byte lines (0 where unused), and its constexprs: AHEAD_START or
    AHEAD_END (how many, where the kernel issues them: `EARLY`) and AHEAD_STEP (elements per line)."""
    weights = [w for w in weights if w.element_size() == weights[0].element_size()]
    ptrs = list(weights) + [fallback] * (MAX - len(weights))
    lines = [-(-w.numel() * w.element_size() // 128) for w in weights] + [0] * (MAX - len(weights))
    step = 128 // (weights[0] if weights else fallback).element_size()
    count = len(weights)
    return ptrs + lines, dict(AHEAD_START=count if EARLY else 0, AHEAD_END=0 if EARLY else count, AHEAD_STEP=step)


def clear() -> None:
    """Forget every plan (tests; a new model's weights may reuse the addresses)."""
    _PLAN.clear()
    _ORDER.clear()


if triton is not None:

    @triton.jit
    def _span(ptr, lines, pid, programs, STEP: tl.constexpr, BLOCK: tl.constexpr):
        """Program `pid` of `programs` asks for its share of `lines` lines from ptr (STEP elements a line)."""
        per = tl.cdiv(lines, programs)
        lo = pid * per
        hi = tl.minimum(lo + per, lines)
        for start in range(lo, hi, BLOCK):
            idx = tl.minimum(start + tl.arange(0, BLOCK), hi - 1)
            prefetch_l2(ptr + idx.to(tl.int64) * STEP)

    @triton.jit
    def prefetch(a0, a1, a2, a3, n0, n1, n2, n3, COUNT: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr):
        """The weights `launch_args` gave (COUNT of them, none where 0; STEP elements per 128-byte line):
        this program's share, the programs of a grid of up to three axes taken in order."""
        pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        if COUNT > 0:
            _span(a0, n0, pid, programs, STEP, BLOCK)
        if COUNT > 1:
            _span(a1, n1, pid, programs, STEP, BLOCK)
        if COUNT > 2:
            _span(a2, n2, pid, programs, STEP, BLOCK)
        if COUNT > 3:
            _span(a3, n3, pid, programs, STEP, BLOCK)
    @triton.jit
    def _side_kernel(a0, a1, a2, a3, n0, n1, n2, n3, COUNT: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr):
        prefetch(a0, a1, a2, a3, n0, n1, n2, n3, COUNT, STEP, BLOCK)
else:
    prefetch = None
