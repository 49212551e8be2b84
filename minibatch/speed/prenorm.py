"""The residual add and RMSNorm before a product, inside skinny.py's kernel (an experiment, off).

Why: in a compiled decode step of a small model every layer runs two kernels that add a block's output
to the residual stream and RMS-normalize the sum (Inductor fuses the two into one): ~1.4 us each at
the 0.6B shape, 55 of the step's ~320 kernels at one row (the kernel lists in
figures/data/runs/gpu_small_models_switches_2026-12-05/). Both feed a product (the
merged q/k/v, the merged gate/up) whose every program reads the whole normalized row anyway. Where
that product runs on skinny.py's kernel, the kernel can do the add and the norm itself:

    each program, before its loop:  h = x + r (rounded); 1 / rms of each row of h, over all of K
                                     (program 0 also stores h: the residual stream the layer goes on with)
    in its loop, each piece:         x = weight * (h * (1 / rms))  (rounded as transformers' RMSNorm)

`fuse(gm, example_inputs)`, a pass after skinny.route and gated.fuse: each routed product whose input is
transformers' RMSNorm of a sum (`a + b` -> to(float32) -> pow(2) -> mean(-1) -> + eps -> rsqrt -> * ->
to(dtype) -> weight *) becomes one `minibatch::skinny_norm_linear` call, returning the product and the
sum, and each gated product (gated.py) on such a norm one `minibatch::skinny_norm_gated` call; the sum's
other readers read the call's. Each operator runs the kernel where its product's rule picks it for the
call's rows (skinny.settings; gated.py's for the gated one), else the same work as PyTorch ops (`rms_norm`,
F.linear).

Where it applies: only to products skinny.py's kernel takes, and a small model's q/k/v and gate/up are
wider than its default rule (`skinny.WIDEST`); so it is timed with a wider rule
(scripts/gpu/floor_matrix.py --variants NAME:prenorm=1,widest=1:8192/4:8192/8:8192). In a step compiled
for any row count, rows the rule does not take run the PyTorch ops, unfused. Timed and left off (`ENABLED`): in the
0.6B compiled step on an H200 (BENCHMARKS.md, "Small models") the norm kernels go, but the wide products it
needs run slower on skinny.py's kernel than on cuBLAS at 4 and 8 rows, by more than the norms saved. That was
before gated.py: its gate/up product is on the kernel at 1-8 rows under the default rule, so there the pass
takes the norm before it (one kernel fewer per layer) and moves no product off cuBLAS
(floor_matrix.py --variants NAME:prenorm=1); not yet timed. (With the wider rule too, the gate/up's norm now
goes into the gated product, which the earlier timing had as a skinny_norm_linear and an activation kernel.)
"""

from __future__ import annotations

import operator

import torch

from . import gated, skinny
from .fx_edits import calls, recompiled

#: Whether the compiled step's backend runs `fuse` (read when a step compiles: set it before).
ENABLED = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama's, Qwen3's): in float32, then back to the input's dtype, then the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("minibatch::skinny_norm_linear", mutates_args=())
def skinny_norm_linear(x: torch.Tensor, r: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + r) @ weight.T, x + r), by skinny.py's kernel where its rule takes the product."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(k, 1)
    chosen = skinny.settings(rows, n, k) if skinny.usable(x, weight) and r.dtype == x.dtype else None
    if chosen is None:
        h = x + r
        return torch.nn.functional.linear(rms_norm(h, norm_weight, eps), weight), h
    y, h = x.new_empty(rows, n), x.new_empty(rows, k)
    skinny.launch(skinny.flat_rows(x, rows), weight, y, chosen, pre=(skinny.flat_rows(r, rows), norm_weight, h, eps))
    return y.reshape(*x.shape[:-1], n), h.reshape(x.shape)


@skinny_norm_linear.register_fake
def _(x, r, norm_weight, eps, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x)


@torch.library.custom_op("minibatch::skinny_norm_gated", mutates_args=())
def skinny_norm_gated(x: torch.Tensor, r: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, gate: int, up: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated.skinny_gated of RMSNorm(x + r), x + r): the norm inside a gated product (gated.py), by
    skinny.py's kernel where gated.py's rule takes the product."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    chosen = gated.chosen_setting(x, weight, gate, up, n) if r.dtype == x.dtype else None
    if chosen is None:
        h = x + r
        return gated.glu_ops(rms_norm(h, norm_weight, eps), weight, gate, up, n), h
    y, h = x.new_empty(rows, n), x.new_empty(rows, k)  # (gated.py's setting as it is: with r's pieces in
    # shared memory too it still fits a Hopper SM, float32's 2 stages included; kernel_resources.py counts it)
    skinny.launch(skinny.flat_rows(x, rows), weight[gate:], y, chosen,
                  pre=(skinny.flat_rows(r, rows), norm_weight, h, eps), up=up - gate)
    return y.reshape(*x.shape[:-1], n), h.reshape(x.shape)


@skinny_norm_gated.register_fake
def _(x, r, norm_weight, eps, weight, gate, up, n):
    return x.new_empty(*x.shape[:-1], n), torch.empty_like(x)


def _norm_of_sum(x) -> tuple | None:
    """(a, b, weight, eps, [the norm's nodes]) where `x` is transformers' RMSNorm of a sum a + b, else None."""
    if not (calls(x, operator.mul) and len(x.args) == 2 and calls(x.args[1], "to", "call_method")):
        return None
    weight, to_dtype = x.args
    scaled = to_dtype.args[0]
    if not (calls(scaled, operator.mul) and calls(scaled.args[1], torch.rsqrt)):
        return None
    hf, rsqrt = scaled.args
    add = rsqrt.args[0]
    if not (calls(add, operator.add) and isinstance(add.args[1], float) and calls(add.args[0], "mean", "call_method")):
        return None
    pow_ = add.args[0].args[0]
    if not (calls(pow_, "pow", "call_method") and pow_.args[1:] == (2,) and pow_.args[0] is hf
            and calls(hf, "to", "call_method", users=2) and tuple(hf.args[1:]) == (torch.float32,)):
        return None
    total = hf.args[0]
    if not (calls(total, operator.add, users=None) and len(total.args) == 2
            and all(isinstance(a, torch.fx.Node) for a in total.args)):
        return None
    return (*total.args, weight, add.args[1], [x, to_dtype, scaled, rsqrt, add, add.args[0], pow_, hf])


def fuse(gm: torch.fx.GraphModule, example_inputs) -> int:
    """The pass (siblings.py's backend runs it after skinny.route and gated.fuse when ENABLED): each
    skinny_linear call on the RMSNorm of a sum becomes one skinny_norm_linear call, each skinny_gated call
    one skinny_norm_gated call. Returns how many."""
    fused_op = {torch.ops.minibatch.skinny_linear.default: torch.ops.minibatch.skinny_norm_linear.default,
                torch.ops.minibatch.skinny_gated.default: torch.ops.minibatch.skinny_norm_gated.default}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in fused_op:
            continue
        found = _norm_of_sum(node.args[0])
        if found is None:
            continue
        a, b, norm_weight, eps, norm_nodes = found
        total = norm_nodes[-1].args[0]
        readers = [u for u in total.users if u is not norm_nodes[-1]]
        if any(order[u] < order[node] for u in readers):
            continue  # (the sum is read before the product: it must exist there)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(fused_op[node.target], (a, b, norm_weight, eps, *node.args[1:]))
            product = gm.graph.call_function(operator.getitem, (call, 0))
            new_total = gm.graph.call_function(operator.getitem, (call, 1))
        product.meta.update(node.meta)
        new_total.meta.update(total.meta)
        node.replace_all_uses_with(product)
        for reader in readers:
            reader.replace_input_with(total, new_total)
        for dead in [node, *norm_nodes, total]:
            gm.graph.erase_node(dead)
        fused += 1
    return recompiled(gm, fused)
