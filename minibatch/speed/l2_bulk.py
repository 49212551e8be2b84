"""Weights asked into L2 in bulk by the decode attention (an experiment, off: `ENABLED`).

Why: in a small model's decode step each matrix product waits out trips to memory for its weight
(BENCHMARKS.md, small models: ~240 kernels of a few us, each for 1-2 us of bytes), while the decode
attention before them leaves the memory mostly idle (it waits on chains of loads). An earlier try had our
kernels ask each 128-byte line into L2 with one instruction per line: the products got faster and the
asking kernels slower by as much (the history, "weights asked into L2 ahead"). Hopper's bulk prefetch
(`cp.async.bulk.prefetch.L2`) asks for a whole range in one instruction that returns at once, so every
program of the decode attention asks its share of the weights the layer reads next with a handful of
instructions, before its own wait (early.ask_l2_bulk).

    attach(hf)        each attention layer gets the list of weights read after it, in order: its output
                      projection, the MLP's gate, up and down, then the next layer's q, k and v
    chosen(layer)     the ones asked for (`REACH`), as the attention's operator receives them
    ranges(tensors)   (tensor, bytes) per run of adjacent tensors (siblings.pack stacks gate and up, q, k
                      and v), `MAX` at most: the decode kernel's arguments

Only model/fresh.py's path passes them (the small models' compiled steps), on GPUs with bulk prefetch
(compute capability 9.0 and up: early.has_pdl). A prefetch is only a hint: it changes no result.
"""

from __future__ import annotations

import torch

#: Whether fresh.py's path hands the attention the weights to ask for (read when a step is traced).
ENABLED = False
#: Which: "layer" (this layer's output projection and MLP) or "next" (and the next layer's q, k and v).
REACH = "layer"
#: The most ranges one launch asks for (the kernel's argument slots).
MAX = 4

_LAYER = ("o_proj",)
_MLP = ("gate_proj", "up_proj", "down_proj")
_NEXT = ("q_proj", "k_proj", "v_proj")


def attach(hf: torch.nn.Module) -> int:
    """Give each decoder layer's attention module of `hf` the weights read after it (`_l2_after`: those of
    this layer, and `_l2_next`: the next layer's q, k and v). -> layers given them."""
    layers = getattr(getattr(hf, "model", None), "layers", None)
    if layers is None:
        return 0
    done = 0
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            continue
        attn._l2_after = _weights(attn, _LAYER) + _weights(mlp, _MLP)
        following = getattr(layers[i + 1], "self_attn", None) if i + 1 < len(layers) else None
        attn._l2_next = _weights(following, _NEXT) if following is not None else []
        done += 1
    return done


def _weights(module: torch.nn.Module, names: tuple) -> list[torch.Tensor]:
    return [getattr(module, n).weight for n in names if isinstance(getattr(module, n, None), torch.nn.Linear)]


def chosen(attn: torch.nn.Module) -> list[torch.Tensor]:
    """The weights the decode attention of `attn` asks into L2 (none unless ENABLED)."""
    if not ENABLED:
        return []
    return list(getattr(attn, "_l2_after", [])) + (list(getattr(attn, "_l2_next", [])) if REACH == "next" else [])


def ranges(tensors) -> list[tuple[torch.Tensor, int]]:
    """(first tensor, bytes) for each run of tensors that sit end to end in memory, in order, `MAX` at most;
    a tensor that is not contiguous, or not 16-byte aligned in place and size, is left out."""
    out: list[list] = []
    for t in tensors:
        size = t.numel() * t.element_size()
        if not t.is_contiguous() or t.data_ptr() % 16 or size % 16 or size == 0:
            continue
        if out and out[-1][0].data_ptr() + out[-1][1] == t.data_ptr():
            out[-1][1] += size
        elif len(out) < MAX:
            out.append([t, size])
    return [(t, n) for t, n in out]
