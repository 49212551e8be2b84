"""The gated MLP's silu(gate) * up inside skinny.py's down product (an experiment, off).

Why: in a compiled decode step of a small model every layer runs one kernel between its merged gate/up
product and its down product: silu(gate) * up, a few kilobytes per row, ~1.2 us at the 0.6B shape, mostly
launch and ramp (28 of the step's ~320 kernels at one row). Where the down product runs on skinny.py's
kernel (1-4 rows at that shape: `skinny.WIDEST`), each of its programs can compute its pieces of that
input itself, from the gate's and the up projection's:

    in its loop, each piece:   x = silu(gate[rows, piece]) * up[rows, piece]   (each op rounded as PyTorch's)
                               acc += x times the weight's piece, as before

Every program computes the whole input again for its own columns (a few thousand activations, from L2):
more arithmetic, one kernel fewer.

`fuse(gm, example_inputs)`, a pass after skinny.route: each routed product whose input is `silu(a) * b`
becomes one `minibatch::skinny_glu_linear(a, b, weight)` call. The operator runs the kernel where
skinny.settings picks it for the call's rows, else the same work as PyTorch ops.

Status: built, checked (tests/test_glu.py: the pass on the CPU, the kernel with Triton's interpreter and
on a GPU), not yet timed in a step; off (`ENABLED`) until it is (scripts/gpu/floor_matrix.py
--variants NAME:glu=1).
"""

from __future__ import annotations

import operator

import torch

from . import skinny

#: Whether the compiled step's backend runs `fuse` (read when a step compiles: set it before).
ENABLED = False


@torch.library.custom_op("minibatch::skinny_glu_linear", mutates_args=())
def skinny_glu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T, by skinny.py's kernel where its rule takes the product."""
    k, n = gate.shape[-1], weight.shape[0]
    rows = gate.numel() // max(k, 1)
    chosen = (skinny.settings(rows, n, k) if skinny.usable(gate, weight) and up.dtype == gate.dtype
              and up.shape == gate.shape else None)
    if chosen is None:
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight)
    y = gate.new_empty(rows, n)
    skinny.launch(skinny.flat_rows(gate, rows), weight, y, chosen, up=skinny.flat_rows(up, rows))
    return y.reshape(*gate.shape[:-1], n)


@skinny_glu_linear.register_fake
def _(gate, up, weight):
    return gate.new_empty(*gate.shape[:-1], weight.shape[0])


def _silu_times(x) -> tuple | None:
    """(a, b, [the nodes]) where `x` is an FX node for silu(a) * b read once, else None."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is operator.mul
            and len(x.args) == 2 and len(x.users) == 1):
        return None
    act, b = x.args
    if not (isinstance(act, torch.fx.Node) and act.op == "call_function" and act.target is torch.nn.functional.silu
            and len(act.users) == 1 and not act.kwargs.get("inplace") and act.args[1:] in ((), (False,))
            and isinstance(b, torch.fx.Node)):
        return None
    return act.args[0], b, [x, act]


def fuse(gm: torch.fx.GraphModule, example_inputs) -> int:
    """The pass (siblings.py's backend runs it after skinny.route when ENABLED): each skinny_linear call on
    silu(a) * b becomes one skinny_glu_linear call. Returns how many."""
    fused = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.minibatch.skinny_linear.default):
            continue
        found = _silu_times(node.args[0])
        if found is None:
            continue
        a, b, dead = found
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.minibatch.skinny_glu_linear.default, (a, b, node.args[1]))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        for n in [node, *dead]:
            gm.graph.erase_node(n)
        fused += 1
    return skinny.recompiled(gm, fused)
