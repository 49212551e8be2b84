"""The graph edits that the compiled step's passes share (notebook 07).

A torch.compile backend receives the step's FX graph before Inductor compiles it, with the tensors it
was called with. siblings.py's backend runs passes over it, each a few lines of "find a node, put a
call in its place": `siblings.merge` (sibling projections as one product), `skinny.route` (few-row
products to skinny.py's kernel), `gated.fuse` (the activation inside that kernel), `wide_argmax.split`
and one kept here, `outer_products` (a product over one term as a multiply). What they all need is here,
so that each pass reads as what it looks for:

    real = placeholders(gm, example_inputs)          the graph's inputs -> the tensors behind them
    found = bias_free_product(node, LINEAR_TARGETS)  (x, w, x's example value) of an x @ w.T call
    weight = weight_of(w, real)                      the tensor w stands for (merged siblings' too)
    rows = rows_of(value)                            the rows of x (an int, or symbolic)
    replace(gm, node, op, args)                      a call of op takes node's place
    return recompiled(gm, changed)                   check and regenerate the code once, if changed

No Triton here (the passes import it where they launch kernels): a module that edits graphs only
imports this one.
"""

from __future__ import annotations

import operator

import torch


def placeholders(gm: torch.fx.GraphModule, example_inputs) -> dict:
    """The graph's inputs (placeholder nodes) -> the tensors torch.compile passed for them."""
    return dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))


def calls(node, target, kind: str = "call_function", users: int | None = 1) -> bool:
    """Is `node` an FX node calling `target` (a function, or a method's name with kind "call_method"),
    read by `users` nodes (None: any number)?"""
    return (isinstance(node, torch.fx.Node) and node.op == kind and node.target == target
            and (users is None or len(node.users) == users))


def bias_free_product(node: torch.fx.Node, targets) -> tuple | None:
    """(x, w, x's example value) where `node` calls one of `targets` (linear's) as x @ w.T without a bias,
    else None."""
    if node.op != "call_function" or node.target not in targets or len(node.args) < 2:
        return None
    if (node.args[2:] or [None])[0] is not None or node.kwargs.get("bias") is not None:
        return None
    x, w = node.args[:2]
    value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    return (x, w, value) if isinstance(value, torch.Tensor) else None


def weight_of(w, real: dict):
    """The tensor a `linear` call's weight argument stands for: a graph input's, or the stacked weight of
    merged siblings (siblings.merge: `as_strided` over the first sibling's weight, offset 0), else None."""
    if w in real:
        return real[w]
    if (isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target is torch.as_strided
            and len(w.args) == 4 and isinstance(real.get(w.args[0]), torch.Tensor)):
        return torch.as_strided(real[w.args[0]], *w.args[1:])
    return None


def rows_of(value: torch.Tensor):
    """The rows of a [..., K] value: the product of its leading sizes (an int, or symbolic)."""
    rows = 1
    for size in value.shape[:-1]:
        rows = rows * size
    return rows


def replace(gm: torch.fx.GraphModule, node: torch.fx.Node, op, args: tuple) -> torch.fx.Node:
    """`node` becomes a call of `op` on `args` (with its metadata) and leaves the graph; returns the call."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


#: `outer_products` runs (siblings.py's backend reads this at each compile). On: in the 0.6B shape's compiled
#: step it removes the cuBLAS kernel of the rotary angles (BENCHMARKS.md, small models); False keeps the product
#: (floor_matrix.py --variants ...:outer=0)
OUTER = True
_MATMULS = (operator.matmul, torch.matmul, torch.bmm)


def outer_products(gm: torch.fx.GraphModule, example_inputs=None) -> int:
    """Each matrix product whose summed dimension has size 1 (a [.., M, 1] @ [.., 1, N] outer product) becomes
    a broadcast multiply; returns how many. Why: the rotary embedding of transformers before 5.24 computes its
    angles as inv_freq [1, D/2, 1] @ positions [1, 1, R] in float32, which Inductor hands to cuBLAS: a kernel
    of a few us that never launches early (early.py). A product with one term is that term, rounded once:
    the same bits as the multiply, with float32 matmuls in full precision (PyTorch's default): where TF32 is
    allowed, a float32 product rounds its inputs first, so float32 products are left as they are."""
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs:
            continue
        a, b = (x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None for x in node.args)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2):
            continue
        if a.shape[-1] != 1 or b.shape[-2] != 1 or not a.is_floating_point() or a.dtype != b.dtype:
            continue
        if a.dtype == torch.float32 and tf32:
            continue
        replace(gm, node, operator.mul, tuple(node.args))
        changed += 1
    return recompiled(gm, changed)


def recompiled(gm: torch.fx.GraphModule, changed: int) -> int:
    """After a pass: where it changed anything, check the graph and regenerate its code. Returns `changed`."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
