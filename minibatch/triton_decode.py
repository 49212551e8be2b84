"""Decode attention that reads the paged KV cache in place: a small Triton kernel (notebook 07).

Status: opt-in (`model.decode_attention = "triton"`), checked for correctness on the CPU with
Triton's interpreter (tests/test_paged_kernel.py, skipped where Triton is not installed); not yet
timed on a GPU (BENCHMARKS.md says what it is meant to save).

Why: the default decode attention (attention.py) first copies every row's keys and values out of the
cache (`index_select`) into a contiguous [rows, L] table, then runs SDPA over the copy. On the H200
at 32 rows x 512 keys that copy cost ~1.0 ms per 8B step (eager kernel table of a 10.2 ms step; the
compiled step still makes it): every byte is read,
written, and read again. Production engines (vLLM's paged attention, FlashInfer) read the cache
through the block table instead. This kernel does the same, simply:

    one program per (row, key/value head):
        q   = the row's `group` query heads that share this key/value head      [G, D]
        for each chunk of BLOCK_N keys of the row:
            slots = kv_indices[row, chunk]          (the block table, already flattened per token)
            k, v  = k_cache[slots, head], v_cache[slots, head]      (read in place, no copy)
            s     = q @ k.T * scale, masked where the key is padding or in the future
            online softmax: keep a running max m, a running sum l and the weighted sum of v
        out = acc / l

It is the FlashAttention recurrence over one query token (with its G heads as G rows of the tile),
no split over the keys: 256 programs at 32 rows x 8 heads, enough to keep an H200's memory busy.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

BLOCK_N = 64  # keys per loop iteration


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kvi_ptr, kvs_ptr, kvp_ptr, pos_ptr,
                       sq_r, sq_h, sk_s, sk_h, sv_s, sv_h, so_r, so_h, L, scale,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       WINDOW: tl.constexpr, IEEE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        gmask = offs_g[:, None] < G
        heads = h * G + offs_g
        q = tl.load(q_ptr + r * sq_r + heads[:, None] * sq_h + offs_d[None, :], mask=gmask, other=0.0)
        q_pos = tl.load(pos_ptr + r)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(0, L, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < L
            slot = tl.load(kvi_ptr + r * L + offs_n, mask=nmask, other=0)
            seq = tl.load(kvs_ptr + r * L + offs_n, mask=nmask, other=-1)
            k_pos = tl.load(kvp_ptr + r * L + offs_n, mask=nmask, other=0)
            valid = (seq == r) & (k_pos <= q_pos)
            if WINDOW > 0:
                valid = valid & (q_pos - k_pos < WINDOW)
            k = tl.load(k_ptr + slot[:, None] * sk_s + h * sk_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk with no visible key
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * sv_s + h * sv_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + r * so_r + heads[:, None] * so_h + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gmask)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, window,
                     scaling) -> torch.Tensor:
    """query [1, H, R, D] (after RoPE); caches [slots, KVH, D] (new keys already written) -> [1, R, H, D]."""
    if triton is None:
        raise RuntimeError('decode_attention="triton" needs the triton package (it comes with the CUDA '
                           "builds of PyTorch)")
    rows, (_, heads, _, dim) = batch.decode_rows, query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if dim & (dim - 1) or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError(f"the triton decode kernel needs a power-of-two head_dim and contiguous heads, got {dim}")
    q = query[0].transpose(0, 1)  # [R, H, D], a view
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(rows, heads, dim, device=query.device, dtype=query.dtype)
    width = batch.kv_indices.shape[0] // rows
    _decode_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, out, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), width, float(scaling or dim**-0.5),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=BLOCK_N,
        WINDOW=int(window or 0), IEEE=query.dtype == torch.float32,
    )
    return out[None]
