"""A decode step's query, key and value straight from their projections into the decode kernel (notebook 07).

Why: in a compiled decode step every attention layer runs two small kernels between its q/k/v
product and its decode attention: one applies the query's and key's RMSNorm (Qwen3 has them) and the
rotary embedding, one writes the new key and value into the paged cache. Each moves a few hundred
bytes per head and takes 1-3 microseconds, mostly launch and ramp: 56 of the 0.6B step's ~320 kernels
at one row (the kernel lists in figures/data/runs/gpu_small_models_switches_2026-12-05/). The decode
kernel (triton_decode.py) already loads each row's query heads and walks its keys, so it can do that
work itself:

    program (row r, key/value head h, split s), with FRESH:
        q = rotary(rmsnorm(q_raw[r, heads of h]))            the G query heads it serves
        for each chunk of the row's keys: as before, leaving out this step's cell
        if s == 0:                                            one program per (row, head)
            k_new = rotary(rmsnorm(k_raw[r, h])),  v_new = v_raw[r, h]
            cache[cell_mapping[r], h] = k_new, v_new
            fold k_new and v_new into its running max, sum and weighted values, like one more key

So no program reads a cell that another program of the same launch writes, and the loop does no more
than before (one comparison per key): the new key and value are computed after it, by one program.
(With a split and triton_decode.NEW_KEY_APART, that program is one of its own: one more split, whose
range of keys is empty, so that the new key's chain of loads and reductions runs beside the loops
instead of after the first one.) (Held in registers through the loop, to stand in for the cache's
copy wherever a chunk reached this step's cell, they took the 0.6B program to 255 registers and
spills, compiled for sm_90 by scripts/experiments/kernel_resources.py; this way it has none.) Each product is rounded to the model's
dtype where the model's own ops round it (PyTorch's eager rules), so the cache holds what the layer's
own forward would write, up to the last bit of the norm's sum (its order differs).

How: `install(hf)` gives every attention layer of a family whose forward is projections, optional
q/k RMSNorm, rotary embedding, attention and output projection (`FAMILIES`) a forward that, in a
decode-layout step with `ENABLED`, runs the projections and then the operator
`minibatch::paged_decode_fresh`, and otherwise calls the layer's own forward unchanged. The operator
runs the kernel where the step's decode attention is "triton" and, elsewhere (a CPU), the same work
as the model's own ops (`reference`), which the tests compare with the layer's own forward bit for
bit.

Status: on in the compiled decode steps of small models on a GPU (`IN_SMALL_COMPILES`: static rows, the
Triton decode attention, a hidden size of at most 2048: the 0.6B and 1B shapes, where it was timed),
off elsewhere (eager steps, a server's compile with dynamic rows, the 8B shape: untimed there). A model gets
the forward only where `install` is called (a CompiledStep does where the rule picks the path;
scripts/gpu/floor_matrix.py --variants fresh:fresh=1 anywhere), and takes the path only while `ENABLED`
(CompiledStep turns it on around its calls: `turned_on`).
In the 0.6B compiled step on an H200 (BENCHMARKS.md, "Small models"), with the first split's program
folding in the new key, it was 3% slower than the default compiled step at 1, 4 and 8 rows in one
process (5% faster at 4 and 8 rows in another, whose default step was slower): its every program norms
and rotates its query heads before its loop, and the new key's work after the loop lengthened the
longest program. With that work on a program of its own (triton_decode.NEW_KEY_APART, now on) the
step is 1-2% faster than the default compiled step at 1, 4 and 8 rows, in each of two processes, and
again in later runs (the 1B shape too), which also showed the step without it depend on Inductor's timing
of its combined kernels: one compile's q/k norm and rotary kernel took 5.6 us a layer instead of 2.2.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..speed import compiled
from ..speed.skinny import flat_rows
from . import triton_decode
from .attention import attend_rows, decode_mask

#: Attention layers whose forward is the one `_forward` replaces (transformers 5.17-5.24): q/k/v
#: projections, for Qwen3 an RMSNorm of each query and key head, the rotary embedding, the attention
#: function, the output projection.
FAMILIES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")

#: Whether decode-layout steps take this path (read when a step is traced: set it before compiling). Off: only
#: the compiled steps that IN_SMALL_COMPILES's rule picks take it (`turned_on`, around their calls).
ENABLED = False


#: Whether compiled steps of small models take this path (`in_compiled_step`): with static rows, on CUDA with
#: the Triton decode attention, a hidden size of at most SMALL_HIDDEN. Timed 1-2% faster at 1, 4 and 8 rows of
#: the 0.6B and 1B shapes, and without the q/k norm and rotary kernel whose speed depended on Inductor's timing
#: of combined kernels (BENCHMARKS.md, small models). Not timed at the 8B shape, nor with dynamic rows (a
#: server's compile), nor in eager steps.
IN_SMALL_COMPILES = True
SMALL_HIDDEN = 2048


def in_compiled_step(device_type: str, attention: str, dynamic_rows: bool, hidden_size: int) -> bool:
    """Could a compiled step of this model take the path by IN_SMALL_COMPILES's rule (the switch aside)?"""
    return device_type == "cuda" and attention == "triton" and not dynamic_rows and hidden_size <= SMALL_HIDDEN


def _compiled_step_hook(step):
    """(speed/compiled.py's AROUND) For a compiled step the rule picks: the layers get this forward, and each
    call of the step runs with the path on while IN_SMALL_COMPILES is (read per call: experiments switch it)."""
    model = step.model
    if not in_compiled_step(model.device.type, step.attention, step.dynamic_rows, model.hf.config.hidden_size):
        return None
    install(model.hf)
    return lambda: turned_on(IN_SMALL_COMPILES)


compiled.AROUND.append(_compiled_step_hook)


@contextlib.contextmanager
def turned_on(on: bool = True):
    """While open, ENABLED is on where `on` (else left as it is): a compiled step's calls (speed/compiled.py).
    A module setting, not a per-thread one, because the compiler guards on it: a graph traced with the path
    is not reused by a step without it. (One thread runs an engine's steps.)"""
    global ENABLED
    before = ENABLED
    ENABLED = before or on
    try:
        yield
    finally:
        ENABLED = before


def install(hf: torch.nn.Module) -> int:
    """Give each attention layer of `FAMILIES` in `hf` the forward below (once). -> layers changed."""
    _lowering()  # (Inductor's layout rule for the operator: `_shared_rotary`)
    changed = 0
    for module in hf.modules():
        if type(module).__name__ in FAMILIES and getattr(module.forward, "func", None) is not _forward:
            module.forward = functools.partial(_forward, module)  # (a partial, unlike a bound method, pickles)
            changed += 1
    return changed


#: Whether a compiled step's layers share one cos and one sin (paged_decode_fresh's layout rule, `_shared_rotary`);
#: False: each layer's call gets copies of its own, as it did without that rule (for timing the difference)
ONE_ROTARY = True


def _forward(self, *args, **kwargs):
    meta = kwargs.get("minibatch")
    if not (ENABLED and meta is not None and meta.batch.decode_rows):
        return type(self).forward(self, *args, **kwargs)  # the layer's own forward
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    q, k, v = self.q_proj(hidden)[0], self.k_proj(hidden)[0], self.v_proj(hidden)[0]  # [T, heads * D]
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    # Qwen2 and Qwen3 layers know their own window; Mistral's attention passes its config's
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    b, layer = meta.batch, self.layer_idx
    op = paged_decode_fresh if ONE_ROTARY else _exact_strides
    out = op(
        q, k, v, q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
        float(q_norm.variance_epsilon) if q_norm is not None else 0.0, cos, sin,
        meta.cache.keys[layer], meta.cache.values[layer], b.cell_mapping, b.kv_indices, b.kv_seq, b.kv_pos,
        b.positions, b.rows(), int(window or 0), float(self.scaling), meta.decode_attention == "triton")
    return self.o_proj(out.reshape(*hidden.shape[:-1], -1)), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama's, Qwen3's): in float32, then back to the input's dtype, then the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# Why a custom operator: as triton_decode.paged_decode (Inductor calls the kernel as it is); it writes the
# caches, which it says (mutates_args), so that the compiler orders it after earlier reads of them.
# Why a layout rule of its own (`_lowering`): with Inductor's default for an operator (every input in the
# strides it had when traced), an input that is not yet a buffer is computed again for each call that reads
# it: the rotary cos and sin, which every layer shares, were computed once per layer instead of once. With
# no rule at all (a flexible layout) they were computed once, but laid out column by column, and the
# kernel's reads of them got slower. The rule makes them one buffer, in rows, for every layer.
# `ONE_ROTARY` False calls the same operator without that rule (floor_matrix.py --variants ...:rotary=0).
def _paged_decode_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, cell_mapping: torch.Tensor,
                        kv_indices: torch.Tensor, kv_seq: torch.Tensor, kv_pos: torch.Tensor, positions: torch.Tensor,
                        rows: int, window: int, scaling: float, kernel: bool) -> torch.Tensor:
    """q [R, H * D], k and v [R, KVH * D] as their projections left them; norm weights (None: no norm) and
    eps; cos, sin [R, D] (or [1, R, D], as the model's rotary embedding makes them); caches [cells, KVH, D],
    written at cell_mapping -> attention [1, R, H, D]. `kernel`: the Triton decode kernel (triton_decode.launch
    with `fresh`), else `reference`."""
    cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    if not kernel:
        return reference(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, cell_mapping, kv_indices,
                         kv_seq, kv_pos, positions, rows, window, scaling)
    # (the kernel steps along rows; it reads cos and sin through both strides, so that whatever layout a compile
    # gives them, every layer reads them in place rather than copying them)
    k, v, q = (flat_rows(t, t.shape[0]) for t in (k, v, q))
    fresh = dict(k=k, v=v, q_weight=q_weight, k_weight=k_weight, eps=eps, cos=cos, sin=sin, cell_mapping=cell_mapping)
    return triton_decode.launch(q, k_cache, v_cache, kv_indices, kv_seq, kv_pos, positions, rows, window, scaling, 0,
                                fresh=fresh)


def _fake(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, cell_mapping, kv_indices, kv_seq, kv_pos,
          positions, rows, window, scaling, kernel):
    return q.new_empty(1, rows, q.shape[1] // k_cache.shape[2], k_cache.shape[2])


paged_decode_fresh = torch.library.custom_op("minibatch::paged_decode_fresh",
                                             mutates_args=("k_cache", "v_cache"))(_paged_decode_fresh)
paged_decode_fresh.register_fake(_fake)
_exact_strides = torch.library.custom_op("minibatch::paged_decode_fresh_exact_strides",
                                         mutates_args=("k_cache", "v_cache"))(_paged_decode_fresh)
_exact_strides.register_fake(_fake)
_ROTARY_ARGS = ("cos", "sin")


def _shared_rotary(fx_node, *args, **kwargs):
    """paged_decode_fresh's layout rule for Inductor: cos and sin made buffers first (a buffer, once made,
    is every reader's), then every input in its traced strides' order (Inductor's constrain_to_fx_strides)."""
    from torch._inductor import ir
    from torch._inductor.lowering import constrain_to_fx_strides

    names = [a.name for a in torch.ops.minibatch.paged_decode_fresh.default._schema.arguments]
    for name in _ROTARY_ARGS:
        i = names.index(name)
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, ir.TensorBox):
            value.realize()
    return constrain_to_fx_strides(fx_node, *args, **kwargs)


@functools.cache
def _lowering() -> bool:
    """Give Inductor paged_decode_fresh with `_shared_rotary` as its layout rule (once per process, before a
    compile lowers the operator: `install`). Inductor's lowering module is not a public API: where this
    torch's lacks what the rule uses, a warning says so and the operator keeps Inductor's default (the
    same results, a copy of cos and sin per layer). -> whether the rule is in place."""
    try:
        from torch._inductor import ir, lowering

        ir.TensorBox, lowering.constrain_to_fx_strides  # (what `_shared_rotary` uses: AttributeError where absent)
        lowering.make_fallback(torch.ops.minibatch.paged_decode_fresh.default, layout_constraint=_shared_rotary)
    except (ImportError, AttributeError, TypeError) as e:
        warnings.warn(f"fresh.py: this torch's Inductor did not take paged_decode_fresh's layout rule ({e!r}); "
                      "compiled steps compute the rotary cos and sin once per layer", stacklevel=3)
        return False
    return True


def reference(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, cell_mapping, kv_indices, kv_seq,
              kv_pos, positions, rows, window, scaling) -> torch.Tensor:
    """The operator's work as the model's own ops do it (transformers' RMSNorm and rotary embedding, as in
    its Llama and Qwen3 layers; the cache write and einsum attention of attention.py)."""
    dim = k_cache.shape[2]
    q, k, v = (t.reshape(t.shape[0], -1, dim) for t in (q, k, v))  # [R, heads, D]
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # (cos, sin [R, D]: over the heads)
    k_cache.index_copy_(0, cell_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, cell_mapping, v.to(v_cache.dtype))
    keys, values = k_cache.index_select(0, kv_indices), v_cache.index_select(0, kv_indices)
    mask = decode_mask(kv_seq, kv_pos, positions, rows, window)
    return attend_rows(q.transpose(0, 1)[None], keys, values, mask, scaling)
