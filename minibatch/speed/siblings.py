"""Sibling projections as one matrix product in compiled steps, without touching the model's modules.

Why: in a decode step a Linear layer costs the time to stream its weight from memory, and small
weights stream slowly. In an 8B Llama the k and v projections (4096 x 1024) reach a small part of
the bandwidth the MLP's big matrices reach (BENCHMARKS.md, small matrices): too little work per
kernel to keep the whole GPU reading. q, k and v read the same input, as do the MLP's gate
and up; one product over their stacked weights reads the same bytes in fewer, larger kernels.

How, in two parts, neither of which changes what the model computes:

1. `pack(model)`, when a model is set up on a GPU (and again at each run, in case the weights
   moved since: Engine.start): in every module that has them, the sibling Linear layers of `GROUPS`
   (contiguous weights of the same input size, dtype and device; biases on all or none) get their
   weights (and biases) stored as consecutive rows of one tensor, each weight a view of its rows.
   Same values, shapes and strides: eager steps, and the CUDA graphs captured from them, run exactly
   as they would on the separate weights.
2. `merge(gm, example_inputs)`, a pass over the graph torch.compile captures (CompiledStep runs it
   before Inductor): `linear` calls that share their input and whose weights are consecutive views
   of one storage become one `linear` over the whole block, and each original output is a slice of
   its result. Inductor then compiles the graph as usual (after skinny.py's pass, where asked:
   `backend(mode, merging, skinny)`). For inference only: with autograd
   recording, or with an in-place operation between the siblings, a group is left alone.

The module code is transformers' throughout; only the compiled graph and where the weights sit
differ. Bits: a product over the stacked weight may sum in another order than the separate ones,
so compiled bf16 tokens can differ from unmerged compiled ones (compare compiled with compiled,
as CompiledStep says); float32 agrees to rounding (tests).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict

import torch

from . import fx_edits, wide_argmax
from .compat import LINEAR, LINEAR_TARGETS, inductor_compile, persistent_rows, rebind_data
from .fx_edits import placeholders, recompiled

#: names of sibling Linear layers that read the same input, as transformers' Llama, Mistral, Qwen2/3
#: and Gemma name them (attention's q/k/v, the gated MLP's gate/up); other names are left alone
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.imatmul}


def _stack(tensors: list[torch.Tensor]) -> None:
    """Store `tensors` (rows of equal width) as consecutive rows of one new tensor, each a view of it."""
    block = torch.cat([t.detach() for t in tensors])
    row = 0
    for t in tensors:
        rebind_data(t, block[row: row + t.shape[0]])
        row += t.shape[0]


def pack(model: torch.nn.Module) -> int:
    """Stack each module's sibling projections (GROUPS) into one tensor; returns how many groups."""
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            for names in GROUPS:
                layers = [getattr(module, n, None) for n in names]
                if not all(isinstance(m, torch.nn.Linear) for m in layers):
                    continue
                weights = [m.weight for m in layers]
                biases = [m.bias for m in layers]
                if (len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1
                        or not all(w.is_contiguous() for w in weights)):
                    continue
                if any(b is None for b in biases):
                    if not all(b is None for b in biases):
                        continue
                    biases = []
                elif len({(b.dtype, b.device) for b in biases}) != 1:
                    continue
                if stacked(weights) and (not biases or stacked(biases)):
                    continue  # packed already
                _stack(weights)
                if biases:
                    _stack(biases)
                packed += 1
    return packed


def stacked(tensors: list[torch.Tensor]) -> bool:
    """Are these tensors consecutive in one storage, the first at its start (what `merge` needs)?"""
    return tensors[0].storage_offset() == 0 and _consecutive(tensors)


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    """Are these contiguous tensors stored one right after the other in one storage?"""
    first = tensors[0]
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in tensors):
        return False
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


def _in_place(node: torch.fx.Node) -> bool:
    """Does this node change a tensor in place (`x.mul_(2)`, `torch.relu_(x)`, `x += y`)?"""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return False


def _whole(gm: torch.fx.GraphModule, node: torch.fx.Node, tensors: list[torch.Tensor]) -> torch.fx.Node:
    """A graph node viewing consecutive `tensors` (rows of equal width) as one [all their rows, width]
    tensor, through `node`, the first of them. Offset 0: Inductor reads an input's `as_strided` offset
    from the tensor's own start, aten from its storage's; with the first tensor at the storage's start
    the two agree."""
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    return gm.graph.call_function(torch.as_strided, (node, shape, tensors[0].stride(), 0))


def merge(gm: torch.fx.GraphModule, example_inputs) -> int:
    """Replace `linear` calls that share an input and whose weights are stacked (`pack`) by one call
    and slices of its output; returns how many calls were merged into others."""
    real = placeholders(gm, example_inputs)
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups: dict[tuple, list] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS or len(node.args) < 2:
            continue
        x, w = node.args[:2]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight, bias = real.get(w), None if b is None else real.get(b)
        if not isinstance(weight, torch.Tensor) or (b is not None and not isinstance(bias, torch.Tensor)):
            continue
        groups[(x, weight.untyped_storage().data_ptr(), b is None)].append((node, weight, bias, w, b))
    merged = 0
    for members in groups.values():
        members.sort(key=lambda m: m[1].storage_offset())
        weights, biases = [m[1] for m in members], [m[2] for m in members]
        if len(members) < 2 or not stacked(weights) or (biases[0] is not None and not stacked(biases)):
            continue
        if torch.is_grad_enabled() and any(t.requires_grad for t in weights + biases if t is not None):
            continue  # (k's and v's gradients would be lost: inference only)
        first, at = members[0], min((m[0] for m in members), key=order.__getitem__)
        if any(order.get(a, len(order)) >= order[at] for a in first[3:] if isinstance(a, torch.fx.Node)):
            continue  # (the first sibling's weight must exist where the merged call goes)
        last = max(order[m[0]] for m in members)
        if any(_in_place(n) for n in nodes[order[at]:last]):
            continue  # (moving a later sibling's product before an in-place change would change what it reads)
        with gm.graph.inserting_before(at):
            # the stacked weight, read through the first sibling's: the same storage from offset 0 on, so
            # no new tensor enters the graph (the compiler's inputs stay the model's own parameters)
            args = [first[0].args[0], _whole(gm, first[3], weights)]
            if biases[0] is not None:
                args.append(_whole(gm, first[4], biases))
            whole = gm.graph.call_function(LINEAR, tuple(args))
        start = 0
        for node, weight, *_ in members:
            with gm.graph.inserting_after(whole):
                part = gm.graph.call_function(torch.narrow, (whole, -1, start, weight.shape[0]))
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
            start += weight.shape[0]
        merged += len(members) - 1
    return recompiled(gm, merged)


#: Reductions of at most this many rows (over at most 1024 elements) compiled as persistent kernels whatever
#: Inductor's hint for them (compat.persistent_rows: the first RMSNorm, fused with the embedding's gather, which
#: as a looped kernel took 3 us in some compiles and 8 in others; BENCHMARKS.md, small models); 0: Inductor's own
#: rule (floor_matrix.py --variants ...:persistent=0).
PERSISTENT_ROWS = 8


class _Backend:
    """`merge` (with `merging`), then skinny.route (with `skinny`; and then, with its ENABLED,
    gated.fuse), then wide_argmax.split (with its ENABLED), then fx_edits.outer_products (with
    fx_edits.OUTER), then Inductor (with PERSISTENT_ROWS) with the options of torch.compile's `mode` and
    the config `patches` ((name, value) pairs). `merged`, `routed` and `argmaxes`: per compile, how many linear calls went into
    a sibling's, how many to the skinny kernel, and how many argmax calls over a vocabulary became two
    steps (wide_argmax.py)."""

    def __init__(self, mode: str | None, merging: bool = True, skinny: bool = False, patches: tuple = ()) -> None:
        self.mode, self.merging, self.skinny, self.patches = mode, merging, skinny, patches
        self.merged, self.routed, self.argmaxes = [], [], []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.merging:
            self.merged.append(merge(gm, example_inputs))
        if self.skinny:
            from . import gated, skinny

            self.routed.append(skinny.route(gm, example_inputs))
            if gated.ENABLED:  # (on by default: gated.py)
                gated.fuse(gm, example_inputs)
        self.argmaxes.append(wide_argmax.split(gm, example_inputs) if wide_argmax.ENABLED else 0)
        if fx_edits.OUTER:
            fx_edits.outer_products(gm, example_inputs)
        with persistent_rows(PERSISTENT_ROWS):
            return inductor_compile(gm, example_inputs, self.mode, self.patches)


def backend(mode: str | None = None, merging: bool = True, skinny: bool = False,
            inductor: dict | None = None) -> _Backend:
    """The torch.compile backend for `mode` (and the passes): one object per set of options, because
    torch.compile reuses what it compiled for a function only when the backend is the same object (a
    new one per engine would compile every shape again, and past its recompile limit run the step
    uncompiled)."""
    patches = tuple(sorted((inductor or {}).items()))  # (one cache key however the options are passed)
    return _backend(mode, bool(merging), bool(skinny), patches)


@functools.lru_cache(maxsize=None)
def _backend(mode: str | None, merging: bool, skinny: bool, patches: tuple) -> _Backend:
    return _Backend(mode, merging, skinny, patches)
