"""The argmax over a vocabulary in two steps, in compiled steps: a pass over the graph torch.compile captures.

Why: a greedy decode step ends with one argmax per row over the whole vocabulary (151,936 logits for
Qwen3). Inductor compiles that into one reduction kernel with one program per row, and a program that
walks 150k values alone takes tens of microseconds (BENCHMARKS.md, small models: 33 us of a 1 ms
step on an H200) while the rest of the GPU waits. Cut the row into pieces and the same reduction has
enough programs to fill the GPU:

    pieces = logits.view(rows, V // width, width)          (width divides V: no copy)
    best, where = pieces.max(dim=-1)                       one (value, index) per piece, many programs
    piece = best.argmax(dim=-1)                            the first piece holding the largest value
    token = piece * width + where[piece]

The same token as `argmax`, bit for bit, ties and NaN included: `max` and `argmax` both return the
first index of the largest value (NaN counting as the largest), so the first piece that holds it, and
its first position there, is the first position in the row.

`split(gm, example_inputs)` rewrites every `argmax` over the last dimension of a tensor whose sizes are
all static, the last at least `SHORTEST` and with a divisor `width` between 1,024 and 8,192 (a
vocabulary without one keeps its argmax). siblings.py's backend runs it on every compiled graph, with
`ENABLED` (on by default).

Why not with a symbolic row count (a server's compile for any batch): there torch 2.11's Inductor fused
a seeded sampler's random numbers into the pieces' kernel and wrote their index arithmetic in 32 bits,
which a 128,256-entry vocabulary overflows (the Triton compile failed: the dynamic-rows sampling test in
tests/test_gpu.py). Static-row steps, where the split was timed, keep it.
"""

from __future__ import annotations

import torch

from .fx_edits import recompiled, replace

#: the pass runs (siblings.py's backend reads this at each compile)
ENABLED = True
#: the shortest last dimension whose argmax is rewritten
SHORTEST = 16384


def piece_width(size: int) -> int | None:
    """The width of the pieces a row of `size` values is cut into: its smallest divisor from 1,024 to
    8,192 (at least 8 pieces), or None where it has none (the argmax then stays one reduction)."""
    for width in range(1024, min(8192, size // 8) + 1):
        if size % width == 0:
            return width
    return None


def two_step_argmax(x: torch.Tensor, width: int) -> torch.Tensor:
    """argmax(x, dim=-1) of x [..., V], V a multiple of `width`, through the maxima of pieces of `width`."""
    best, where = x.unflatten(-1, (x.shape[-1] // width, width)).max(dim=-1)
    piece = best.argmax(dim=-1, keepdim=True)
    return (piece * width + where.gather(-1, piece)).squeeze(-1)


def _last_dim_argmax(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of an `argmax(x, dim=-1)` node (method or function, keepdim False), else None."""
    method = node.op == "call_method" and node.target == "argmax"
    if not (method or (node.op == "call_function" and node.target in (torch.argmax, torch.Tensor.argmax))):
        return None
    x, *rest = node.args
    dim = rest[0] if rest else node.kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else node.kwargs.get("keepdim", False)
    value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if keepdim or not isinstance(value, torch.Tensor) or value.dim() < 1 or not isinstance(dim, int):
        return None
    if not all(isinstance(size, int) for size in value.shape):
        return None  # (a symbolic size: see the module's docstring)
    return x if dim in (-1, value.dim() - 1) else None


def split(gm: torch.fx.GraphModule, example_inputs=None) -> int:
    """Replace each wide last-dimension `argmax` by `two_step_argmax`; returns how many it replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        x = _last_dim_argmax(node)
        if x is None:
            continue
        size = x.meta["example_value"].shape[-1]
        width = piece_width(size) if isinstance(size, int) and size >= SHORTEST else None
        if width is None:
            continue
        replace(gm, node, two_step_argmax, (x, width))
        replaced += 1
    return recompiled(gm, replaced)
