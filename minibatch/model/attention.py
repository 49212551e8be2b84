"""The paged attention function that transformers calls in every attention layer (notebook 00).

We do not touch the model's architecture or kernels. transformers looks up each attention layer's
implementation by name in `AttentionInterface`; we register one more name, "minibatch_paged", whose
function receives the layer's query/key/value *after* RoPE, and

  1. writes the new keys/values into our paged cache at `cell_mapping`,
  2. reads the keys/values this batch needs (`kv_indices`, from the block tables),
  3. runs scaled-dot-product attention over the ragged batch with a mask that keeps each token to
     its own request and to positions at or before its own (and inside the sliding window, if any).

The batch's metadata reaches the attention function as an extra keyword argument of the model's
forward (`minibatch=...`); transformers passes unknown keyword arguments down to every attention
call. Without it, the function falls back to transformers' own SDPA attention, so a loaded model
still works with Hugging Face `generate` (the parity tests rely on this).

Decode-only steps on a GPU use another key layout, a [rows, L] table (batch.py), and one of the
decode attentions below, chosen by `Model.decode_attention`: "einsum" (the readable reference),
"sdpa" (one fused kernel) or "triton" (reads the cache in place: triton_decode.py).

Flat steps (prefill chunks, alone or beside decode rows) take `Model.flat_attention`: "sdpa", the
readable one above (every query against the step's whole key list, a [T, K] mask keeping it to its
own request), or on a GPU in half precision "varlen": FlashAttention's variable-length kernel, each
chunk against its own keys only (the batch's chunk_starts and key_starts are its offsets), causal
from the bottom right since a chunk's queries are its keys' last ones. The mask's work grows with
T x K, the step's tokens times all its keys, the kernel's with each chunk's own; and SDPA with a mask
may plan anew for every new (T, K), which an eager flat step meets nearly every time (BENCHMARKS.md).
Flat steps padded to buckets (graphs.pad_flat, so that they can be CUDA graphs) take it too: its
offsets are data, its bounds come from the padded shapes (tests/test_gpu.py captures one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..core.batch import Batch
from ..core.kv_cache import PagedKVCache

ATTN_NAME = "minibatch_paged"


@dataclass
class PagedMeta:
    """What the attention function needs besides q/k/v: the cache and this batch's index tensors."""

    cache: PagedKVCache
    batch: Batch
    decode_attention: str = "einsum"  # decode-layout attention: "einsum", "sdpa" or "triton" (triton_decode.py)
    flat_attention: str = "sdpa"  # other steps: "sdpa" (one mask over all keys) or "varlen" (chunk by chunk)
    _masks: dict = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[1, 1, T, K] bool: may token t attend to cache cell k? Built once per forward, shared by layers."""
        if sliding_window not in self._masks:
            b = self.batch
            q_pos, k_pos = b.positions[:, None], b.kv_pos[None, :]
            m = (b.q_seq[:, None] == b.kv_seq[None, :]) & (k_pos <= q_pos)
            if sliding_window:
                m &= q_pos - k_pos < sliding_window
            self._masks[sliding_window] = m[None, None]
        return self._masks[sliding_window]

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat batch's chunk offsets as the varlen kernel takes them (int32), once per forward."""
        if "offsets" not in self._masks:
            self._masks["offsets"] = (self.batch.chunk_starts.to(torch.int32), self.batch.key_starts.to(torch.int32))
        return self._masks["offsets"]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[R, 1, 1, L] bool: may row r's query see key l of its row (decode layout)? Built once per forward."""
        key = ("decode", sliding_window)
        if key not in self._masks:
            b = self.batch
            self._masks[key] = decode_mask(b.kv_seq, b.kv_pos, b.positions, b.rows(), sliding_window)
        return self._masks[key]


def decode_mask(kv_seq, kv_pos, positions, rows, sliding_window: int | None) -> torch.Tensor:
    """[R, 1, 1, L] bool from a decode batch's key table (`PagedMeta.decode_mask`)."""
    q_pos, k_pos = positions[:, None], kv_pos.view(rows, -1)
    ok = (kv_seq.view(rows, -1) == torch.arange(rows, device=k_pos.device)[:, None]) & (k_pos <= q_pos)
    if sliding_window:
        ok &= q_pos - k_pos < sliding_window
    return ok[:, None, None, :]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: PagedMeta | None = kwargs.get("minibatch")
    if meta is None:  # a plain transformers call (e.g. HF generate): behave like SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer = module.layer_idx
    k_cache, v_cache = meta.cache.keys[layer], meta.cache.values[layer]
    b = meta.batch
    k_cache.index_copy_(0, b.cell_mapping, key[0].transpose(0, 1).to(k_cache.dtype))  # [T, kv_heads, head_dim]
    v_cache.index_copy_(0, b.cell_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if b.decode_rows and meta.decode_attention == "triton":  # reads the cache in place, no gathered copy
        from .triton_decode import decode_attention
        return decode_attention(query, k_cache, v_cache, b, window, scaling), None
    keys = k_cache.index_select(0, b.kv_indices)  # [K, kv_heads, head_dim]
    values = v_cache.index_select(0, b.kv_indices)
    if b.decode_rows:
        decode = _decode_attention_sdpa if meta.decode_attention == "sdpa" else _decode_attention
        return decode(query, keys, values, meta, window, scaling), None
    if meta.flat_attention == "varlen":
        return _varlen_attention(query, keys, values, meta, window, scaling), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=meta.mask(window),
        scale=scaling, enable_gqa=query.shape[1] != keys.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None  # [1, T, heads, head_dim], no attention weights


def varlen_available() -> bool:
    """FlashAttention's variable-length forward, as torch ships it (CUDA builds)."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def _varlen_attention(query, keys, values, meta: PagedMeta, window, scaling):
    """A flat step's attention, each chunk against its own keys: one FlashAttention varlen call.

    The maximum lengths it takes are bounds from the shapes (tokens, keys), the same for every step of a
    shape, as a CUDA graph needs; the chunks' true lengths come from the offsets. Padding tokens lie in
    no chunk, so the kernel leaves their rows unwritten: they are zeroed, since a NaN there would
    reach the scratch cell's keys through the next layer."""
    b, (starts, key_starts) = meta.batch, meta.offsets()  # (padded: empty chunks fill the offsets up)
    q = query[0].transpose(0, 1)  # [T, heads, head_dim]
    band = {"window_size_left": window - 1, "window_size_right": 0} if window else {}  # (q_pos - k_pos < window)
    out = torch.ops.aten._flash_attention_forward(
        q, keys, values, starts, key_starts, q.shape[0], keys.shape[0],
        0.0, True, False, scale=scaling, **band)[0]
    if b.padded:
        out = out.masked_fill((b.q_seq < 0)[:, None, None], 0.0)
    return out[None]  # [1, T, heads, head_dim]


def _decode_attention(query, keys, values, meta: PagedMeta, window, scaling):
    """One query per row, each against its own row of keys: [rows, L] instead of a [T, K] mask.

    Grouped-query attention without copying keys per query head: query heads are viewed as
    [kv_heads, group] and matched with their shared key/value head inside the einsum.
    """
    return attend_rows(query, keys, values, meta.decode_mask(window), scaling)


def attend_rows(query, keys, values, mask, scaling):
    """`_decode_attention`'s work, its [R, 1, 1, L] key mask given (`decode_mask`)."""
    rows, (_, heads, _, dim) = mask.shape[0], query.shape
    kv_heads = keys.shape[1]
    q = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)  # [R, KVH, G, D]
    k = keys.view(rows, -1, kv_heads, dim)  # [R, L, KVH, D]
    v = values.view(rows, -1, kv_heads, dim)
    scores = torch.einsum("rhgd,rlhd->rhgl", q, k).float() * (scaling or dim**-0.5)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    out = torch.einsum("rhgl,rlhd->rhgd", probs, v)  # [R, KVH, G, D]
    return out.reshape(1, rows, heads, dim)


def _decode_attention_sdpa(query, keys, values, meta: PagedMeta, window, scaling):
    """The same attention as `_decode_attention`, in one fused SDPA kernel.

    Trick: a decode row has one query token, and the `group` query heads that share a key/value head
    all look at the same keys. So we hand SDPA the group as if it were `group` query *positions* of
    one head: q [R, KVH, G, D] against k, v [R, KVH, L, D] (a strided view of the gathered keys, no
    copy), with the row's key mask broadcast over the group. The fused kernel reads each key once,
    keeps the scores in registers, and needs no float32 [R, H, L] tensor in memory.
    """
    b = meta.batch
    rows, (_, heads, _, dim) = b.rows(), query.shape
    kv_heads = keys.shape[1]
    q = query[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)  # [R, KVH, G, D]
    k = keys.view(rows, -1, kv_heads, dim).transpose(1, 2)  # [R, KVH, L, D]
    v = values.view(rows, -1, kv_heads, dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask(window),
                                                           scale=scaling)
    return out.reshape(1, rows, heads, dim)


AttentionInterface.register(ATTN_NAME, paged_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # masks for the HF-generate fallback path
