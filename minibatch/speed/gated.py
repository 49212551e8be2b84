"""The gated MLP's silu(gate) * up as the last step of its gate/up product's kernel (small models).

Why: in a compiled decode step of a small model every layer runs one kernel between its merged gate/up
product and its down product: silu(gate) * up, a few kilobytes per row, ~1.2 us at the 0.6B shape,
mostly launch and ramp (28 of the step's ~270 kernels). The gate/up product runs on cuBLAS there (6144
columns: wider than skinny.py's rule takes). skinny.py's kernel can take it with the activation inside:
each program reads the same columns of the gate's and of the up projection's rows of the merged weight,
sums both, and writes only the activation:

    one program per block_n columns c of the output [rows, I]:
        g = x @ W[c].T,  u = x @ W[I + c].T            (float32 sums, as skinny.py's kernel sums)
        y[:, c] = silu(g) * u                            (each rounded as PyTorch's ops round it)

Half the bytes written, one kernel fewer. (Putting the activation in the down product's kernel instead,
where every program must compute all of it again, was slower: BENCHMARKS.md's history, `skinny.GATED`
and `glu=1`.)

`fuse(gm, example_inputs)`, a pass after skinny.route: each product (cuBLAS's `linear` or `skinny_linear`)
whose output is only read as two slices, `silu(first) * second`, becomes one `minibatch::skinny_gated`
call, where the graph's rows are a number and `settings` picks the kernel for them (elsewhere, a server's
compile for any row count included, the graph keeps its ops, which Inductor fuses as before). The operator
runs the kernel where it can (a CUDA tensor, with Triton), else the same work as PyTorch ops.

Where it applies (`settings`): 1-8 rows of a gate/up product of at most 3072 outputs by 1024 inputs, the
0.6B shape's, where it was timed (BENCHMARKS.md, small models; the kernel's settings alone:
scripts/experiments/skinny_gemv_ab.py --grid gated, the step: scripts/gpu/floor_matrix.py --variants
NAME:gated=0, and NAME:gated_rows=0 for one row only). At 2-8 rows, on tensor cores (`MANY_ROWS`), its
products inside the step take longer than cuBLAS's (alone they were faster), but the activation kernel goes
and the step is about 2% faster (BENCHMARKS.md, small models).
Larger models, and more rows, keep cuBLAS and Inductor's activation kernel.
"""

from __future__ import annotations

import operator

import torch

from . import skinny
from .compat import LINEAR_TARGETS
from .fx_edits import bias_free_product, calls, recompiled, rows_of

#: Whether the compiled step's backend runs `fuse` (read when a step compiles: set it before).
ENABLED = True

#: The widest gate/up product (outputs, inputs) the kernel takes: the one it was timed on.
WIDEST, DEEPEST = 3072, 1024

#: The most rows the kernel takes a gated product for (more stay on cuBLAS and PyTorch's ops).
MOST_ROWS = 8

#: Whether 2-8 rows take the kernel too (tensor cores); off, only one row does.
MANY_ROWS = True


#: Settings timed elsewhere, by row count, that take the place of `settings`' whole rule, MANY_ROWS and
#: the shape limits included (floor_matrix.py --gated-settings: the best of skinny_gemv_ab.py --grid gated,
#: for the 0.6B step in the same command).
TIMED: dict[int, dict] = {}


def settings(rows: int, n: int, k: int) -> dict | None:
    """skinny.py's setting for a gated product of `rows` x [2 n, k] (n outputs), or None (PyTorch's ops).
    Each program reads 2 x block_n weight rows. The fastest alone at the 0.6B shape
    (skinny_gemv_ab.py --grid gated, an H100): one row, plain multiply-adds, 4 columns a program, K in one
    piece; 2-8 rows (with MANY_ROWS), tensor cores, 32 columns a program, K in pieces of 128, 5 pipeline
    stages (2 for float32: the operator), of 74 settings the one that took as long as cuBLAS's product
    alone (pieces of 256 in 4 stages, chosen from a smaller grid before, took 7% longer; BENCHMARKS.md).
    TIMED, where it has the row count, takes the place of all this."""
    if not 1 <= rows <= MOST_ROWS:
        return None
    if rows in TIMED:
        return dict(TIMED[rows])
    if n > WIDEST or k > DEEPEST or (rows > 1 and not MANY_ROWS):
        return None
    if rows > 1:
        return dict(skinny.TILE)
    return dict(block_n=4, block_k=1 << (k - 1).bit_length(), warps=4, stages=3)  # (a power of 2: the K mask
    # covers the rest)


@torch.library.custom_op("minibatch::skinny_gated", mutates_args=())
def skinny_gated(x: torch.Tensor, weight: torch.Tensor, gate: int, up: int, n: int) -> torch.Tensor:
    """silu(x @ weight[gate:gate + n].T) * (x @ weight[up:up + n].T), by skinny.py's kernel where
    `settings` picks it, else PyTorch's ops."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    chosen = chosen_setting(x, weight, gate, up, n)
    if chosen is None:
        return glu_ops(x, weight, gate, up, n)
    y = x.new_empty(rows, n)
    skinny.launch(skinny.flat_rows(x, rows), weight[gate:], y, chosen, up=up - gate)
    return y.reshape(*x.shape[:-1], n)


def chosen_setting(x: torch.Tensor, weight: torch.Tensor, gate: int, up: int, n: int) -> dict | None:
    """The kernel's setting for this call of a gated product (`settings` for its rows), or None: PyTorch's ops."""
    k = x.shape[-1]
    chosen = settings(x.numel() // max(k, 1), n, k) if skinny.usable(x, weight) and gate + n <= up else None
    if chosen is not None and chosen.get("dot") and x.element_size() > 2:  # (float32 tiles: 4 stages would
        chosen = {**chosen, "stages": 2}  # need more shared memory than an H100's SM has)
    return chosen


def glu_ops(x: torch.Tensor, weight: torch.Tensor, gate: int, up: int, n: int) -> torch.Tensor:
    """The gated product as the graph's own PyTorch ops compute it: the merged product, sliced."""
    both = torch.nn.functional.linear(x, weight)
    return torch.nn.functional.silu(both.narrow(-1, gate, n)) * both.narrow(-1, up, n)


@skinny_gated.register_fake
def _(x, weight, gate, up, n):
    return x.new_empty(*x.shape[:-1], n)


def _last_columns(node) -> tuple | None:
    """(start, length) where `node` takes columns of its input's last dimension (torch.narrow, as
    siblings.merge writes it), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.narrow
            and len(node.users) == 1 and len(node.args) == 4 and not node.kwargs and node.args[1] == -1
            and all(isinstance(a, int) for a in node.args[2:])):
        return None
    return node.args[2], node.args[3]


def _gated_use(product) -> tuple | None:
    """(gate start, up start, n, the mul node, [the nodes the call replaces but `product`]) where `product`'s
    output is read only as silu(columns [gate, gate + n)) * columns [up, up + n), else None."""
    if len(product.users) != 2:
        return None
    slices = {u: _last_columns(u) for u in product.users}
    if any(s is None for s in slices.values()):
        return None
    for first, (gate, n) in slices.items():
        act = next(iter(first.users))
        if not (calls(act, torch.nn.functional.silu) and not act.kwargs.get("inplace")
                and act.args[1:] in ((), (False,))):
            continue
        mul = next(iter(act.users))
        second = next(u for u in slices if u is not first)
        up, n_up = slices[second]
        if (mul.op == "call_function" and mul.target is operator.mul and len(mul.args) == 2
                and set(mul.args) == {act, second} and n_up == n and gate + n <= up):
            return gate, up, n, mul, [mul, act, first, second]
    return None


def fuse(gm: torch.fx.GraphModule, example_inputs) -> int:
    """The pass (siblings.py's backend runs it after skinny.route when ENABLED): each gate/up product read as
    silu(gate) * up becomes one skinny_gated call. Returns how many."""
    fused = 0
    targets = (*LINEAR_TARGETS, torch.ops.minibatch.skinny_linear.default)
    for node in list(gm.graph.nodes):
        product = bias_free_product(node, targets)
        if product is None:
            continue
        x, w, value = product
        rows = rows_of(value)
        if not isinstance(rows, int):
            continue  # (symbolic rows: a server's compile keeps PyTorch's ops)
        found = _gated_use(node)
        if found is None or settings(rows, found[2], value.shape[-1]) is None:
            continue  # (where the kernel would not run, Inductor's fused activation is the better fallback)
        gate, up, n, mul, dead = found
        with gm.graph.inserting_before(mul):
            call = gm.graph.call_function(torch.ops.minibatch.skinny_gated.default, (x, w, gate, up, n))
        call.meta.update(mul.meta)
        mul.replace_all_uses_with(call)
        for d in [*dead, node]:
            gm.graph.erase_node(d)
        fused += 1
    return recompiled(gm, fused)
