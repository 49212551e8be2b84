"""Decode attention that reads the paged KV cache in place: a small Triton kernel (notebook 07).

Status: the decode attention on a GPU where Triton is installed (`Model.decode_attention`), eager and
inside torch.compile'd steps (as the custom operator `minibatch::paged_decode`); checked
against the einsum reference on the GPU (float32 and bf16) and on the CPU with Triton's interpreter
(tests/test_paged_kernel.py, skipped where Triton is not installed); timed against the gather + SDPA
path by scripts/experiments/decode_attention_ab.py (notes/benchmarks_history_2026-11-29_to_2026-12-02.md).

Why: the SDPA decode attention (attention.py) first copies every row's keys and values out of the
cache (`index_select`) into a contiguous [rows, L] table, then runs SDPA over the copy: every byte
is read, written, and read again. Production engines (vLLM's paged attention, FlashInfer) read the cache
through the block table instead. This kernel does the same, simply:

    one program per (row, key/value head):
        q   = the row's `group` query heads that share this key/value head      [G, D]
        for each chunk of BLOCK_N keys of the row:
            slots = kv_indices[row, chunk]          (the block table, already flattened per token)
            k, v  = k_cache[slots, head], v_cache[slots, head]      (read in place, no copy)
            s     = q @ k.T * scale, masked where the key is padding or in the future
            online softmax: keep a running max m, a running sum l and the weighted sum of v
        out = acc / l

It is the FlashAttention recurrence over one query token (with its G heads as G rows of the tile).
One program per (row, head) leaves most of the GPU idle when rows x kv_heads is small (1 row x 8
heads = 8 programs on a 132-SM H200) or each program has a long context to walk alone. Then the keys
are split ("split-K", as in flash-decoding): `splits` programs per (row, head), each over its own
range of keys, each leaving a partial result (its max m, its sum l, its unnormalized acc); a second
small kernel combines them:

    M = max_s m_s        out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

`num_splits` picks the split count: enough programs to give every SM two, never a split shorter
than one BLOCK_N chunk of keys (nor, from 4 rows on, than 128 keys: MIN_SPLIT_KEYS). On Hopper and
later, inside compiled steps, both kernels are launched early (speed/early.py): the attention asks its
rows' first cached keys and values into L2 while the kernel before it (which writes this step's query
and new key) finishes, and reads them once it has.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None
from ..speed.early import has_pdl, prefetch_l2, wanted

BLOCK_N = 64  # keys per loop iteration


def available() -> bool:
    return triton is not None


if triton is not None:
    from .triton_fresh import new_key, query_heads  # (fresh's path: FRESH)

    @triton.jit
    def _early_start(kvi_ptr, k_ptr, v_ptr, r, h, L, lo, hi, sk_s, sk_h, sv_s, sv_h,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, LINE: tl.constexpr):
        """A decode kernel launched while the kernel before it still runs (which writes this step's keys,
        values and query): the key table is the step's input, so the cache lines of row r's first keys and
        values from lo (head h; two chunks at most, so that the work before waiting stays short however
        long the context) are asked into L2 now; every value is read after that kernel is done. (The decode
        kernel lets its own successor launch only after its main loop: launched sooner, the successor's
        waiting programs would take places on the SMs that the last of ours need.)"""
        lines = tl.arange(0, D // LINE) * LINE
        for start in range(lo, tl.minimum(hi, lo + 2 * BLOCK_N), BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            slot = tl.load(kvi_ptr + r * L + offs_n, mask=offs_n < hi, other=0)
            prefetch_l2(k_ptr + slot[:, None] * sk_s + h * sk_h + lines[None, :])
            prefetch_l2(v_ptr + slot[:, None] * sv_s + h * sv_h + lines[None, :])
        tl.extra.cuda.gdc_wait()

    @triton.jit
    def _chunk(kvi_ptr, kvs_ptr, kvp_ptr, r, L, start, hi, q_pos, new_slot, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr, FRESH: tl.constexpr):
        """The cache slots of row r's keys [start, start + BLOCK_N), which of them the query sees, and which
        are inside the program's range (< hi)."""
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        slot = tl.load(kvi_ptr + r * L + offs_n, mask=nmask, other=0)
        seq = tl.load(kvs_ptr + r * L + offs_n, mask=nmask, other=-1)
        k_pos = tl.load(kvp_ptr + r * L + offs_n, mask=nmask, other=0)
        valid = (seq == r) & (k_pos <= q_pos)
        if FRESH:
            valid = valid & (slot != new_slot)
        if WINDOW > 0:
            valid = valid & (q_pos - k_pos < WINDOW)
        return slot, valid, nmask

    @triton.jit
    def _scores(q, k, valid, m_i, scale, IEEE: tl.constexpr):
        """One chunk's softmax numerators p (against the new running max), the old sums' rescale alpha, and the
        new max."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk with no visible key
        return tl.exp(s - m_safe[:, None]), tl.exp(m_i - m_safe), m_new

    @triton.jit
    def _weighted(acc, alpha, p, v, IEEE: tl.constexpr):
        """The running weighted sum of values, rescaled, plus this chunk's."""
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return acc * alpha[:, None] + pv

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kvi_ptr, kvs_ptr, kvp_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                       sq_r, sq_h, sk_s, sk_h, sv_s, sv_h, so_r, so_h, L, keys_per_split, scale,
                       kn_ptr, vn_ptr, skn_r, svn_r, qw_ptr, kw_ptr, cos_ptr, sin_ptr, scs_r, scs_d, cm_ptr, eps,
                       new_split,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       WINDOW: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                       LINE: tl.constexpr, FRESH: tl.constexpr, NORM: tl.constexpr):
        r, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, L)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        new_slot = tl.load(cm_ptr + r) if FRESH else -1  # this step's cell (fresh.py): added after the loop
        q_pos = tl.load(pos_ptr + r)
        if PDL:  # launched early (programmatic dependent launch)
            _early_start(kvi_ptr, k_ptr, v_ptr, r, h, L, lo, hi, sk_s, sk_h, sv_s, sv_h, D, BLOCK_N, LINE)
        gmask = offs_g[:, None] < G
        heads = h * G + offs_g
        cos_d, sin_d = cos_ptr + r * scs_r + offs_d * scs_d, sin_ptr + r * scs_r + offs_d * scs_d  # (FRESH)
        q = query_heads(q_ptr + r * sq_r + heads[:, None] * sq_h, offs_d, gmask, qw_ptr, cos_d, sin_d, eps, D, FRESH,
                        NORM)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            slot, valid, nmask = _chunk(kvi_ptr, kvs_ptr, kvp_ptr, r, L, start, hi, q_pos, new_slot, BLOCK_N, WINDOW,
                                        FRESH)
            k = tl.load(k_ptr + slot[:, None] * sk_s + h * sk_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            p, alpha, m_i = _scores(q, k, valid, m_i, scale, IEEE)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * sv_s + h * sv_h + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = _weighted(acc, alpha, p, v, IEEE)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now (_early_start: why not sooner)
        if FRESH:
            if split == new_split:  # one program per (row, head): the new key and value, into the cache and the sums
                m_i, l_i, acc = new_key(q, m_i, l_i, acc, kn_ptr + r * skn_r + h * D, vn_ptr + r * svn_r + h * D,
                                        k_ptr + new_slot * sk_s + h * sk_h, v_ptr + new_slot * sv_s + h * sv_h,
                                        offs_d, kw_ptr, cos_d, sin_d, eps, scale, D, NORM)
        _finish(m_i, l_i, acc, r, heads, split, offs_g, offs_d, gmask, m_ptr, l_ptr, acc_ptr, o_ptr, so_r, so_h, G, D,
                SPLIT)

    @triton.jit
    def _finish(m_i, l_i, acc, r, heads, split, offs_g, offs_d, gmask, m_ptr, l_ptr, acc_ptr, o_ptr, so_r, so_h,
                G: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
        """A program's result: with a split, its partials [rows, heads, splits, (D)] in float32, which
        _combine_kernel combines; without, the attention's output."""
        if SPLIT:
            at = (r * tl.num_programs(1) * G + heads) * tl.num_programs(2) + split
            tl.store(m_ptr + at, m_i, mask=offs_g < G)
            tl.store(l_ptr + at, l_i, mask=offs_g < G)
            tl.store(acc_ptr + at[:, None] * D + offs_d[None, :], acc, mask=gmask)
        else:
            out = acc / l_i[:, None]
            tl.store(o_ptr + r * so_r + heads[:, None] * so_h + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=gmask)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, so_r, so_h, H, S: tl.constexpr, BLOCK_S: tl.constexpr,
                        D: tl.constexpr, PDL: tl.constexpr):
        """One program per (row, query head): rescale the splits' partials to a common max and add."""
        if PDL:  # (launched early: everything it reads is the decode kernel's output)
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        smask = offs_s < S
        at = (r * H + h) * S + offs_s
        m = tl.load(m_ptr + at, mask=smask, other=float("-inf"))
        l = tl.load(l_ptr + at, mask=smask, other=0.0)
        acc = tl.load(acc_ptr + at[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # a split that saw no visible key adds 0
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + r * so_r + h * so_h + offs_d, out.to(o_ptr.dtype.element_ty))


#: Whether the decode kernel runs with 2 warps and 2 pipeline stages at 4-64 rows (4 warps and 3 stages,
#: Triton's defaults, otherwise). Measured, not derived: decode_kernel_tune.py on an H200 timed it 4-9%
#: faster than the defaults at every point from 4 to 64 rows (0.6B and 8B shapes), the same at 1 row; at 2
#: rows neither was best, and 128 rows at 2048 keys was not timed. (Compiled for sm_90, the smaller program
#: fits 5 to an SM instead of 4: scripts/experiments/kernel_resources.py.) False: the defaults always.
LEAN = True


#: With fresh.py's path and a split over the keys, whether the new key and value get a program of their own
#: (one more split, whose range of keys is empty) instead of the first split's program doing them after its
#: loop. Why: that work (norm, rotary, cache write, fold) is a chain of dependent loads and reductions that,
#: done by the first split, adds to the longest program's time; apart, it runs beside the loops and costs
#: the combine one more partial. Timed in the 0.6B compiled step on an H200 (floor_matrix.py --variants
#: fresh:fresh=1 apart:fresh=1,apart=1): 4-5% faster than the first split doing it at 1, 4 and 8 rows, so on
#: wherever fresh.py's path runs. False: the first split's program folds it in.
NEW_KEY_APART = True


#: (keys per loop step, warps, pipeline stages) for every launch that does not name its own, instead of
#: BLOCK_N and `warps_stages`: None. For timing other settings inside whole compiled steps, where the
#: kernel runs early beside its neighbours (floor_matrix.py --variants LABEL:attn=128x4x2).
SETTINGS: tuple[int, int, int] | None = None


def warps_stages(rows: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the decode kernel for a batch of `rows` (`LEAN`)."""
    return (2, 2) if LEAN and 4 <= rows <= 64 else (4, 3)


#: The programs per SM `num_splits` aims for (decode_kernel_tune.py --per-sm sweeps it; fractions split less:
#: at 0.125 on 132 SMs, 4 or more rows of 8 key/value heads are not split at all, and no combine step runs).
PROGRAMS_PER_SM = 2

#: The fewest keys a split walks in a batch of at least MIN_SPLIT_ROWS rows (else one `block_n` chunk). In the
#: 0.6B shape's compiled step at 4 rows x 512 keys, 4 splits of 128 keys beat the 8 of 64 that 2 programs per SM
#: ask for, in each of four runs; at 8 rows 4 splits of 128 were already the fastest, 2 or 3 longer ones slower
#: (BENCHMARKS.md, small models; floor_matrix.py --variants ...:min_split=64 times the old rule). At 1 row the
#: rule cost 4% (32 programs instead of 64 for 132 SMs); 2 and 3 rows, as few programs, keep 64-key splits.
MIN_SPLIT_KEYS = 128
MIN_SPLIT_ROWS = 4


def num_splits(rows: int, kv_heads: int, width: int, device: torch.device, per_sm: float | None = None,
               block_n: int = BLOCK_N) -> int:
    """How many programs share one (row, kv head)'s keys: enough for `per_sm` programs per SM (None:
    PROGRAMS_PER_SM), each over at least one `block_n` chunk of keys, and at least MIN_SPLIT_KEYS keys where
    there are MIN_SPLIT_ROWS rows or more."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    per_sm = PROGRAMS_PER_SM if per_sm is None else per_sm
    want = -(-int(per_sm * sms) // (rows * kv_heads))
    shortest = max(block_n, MIN_SPLIT_KEYS) if rows >= MIN_SPLIT_ROWS else block_n
    return max(1, min(want, -(-width // shortest), 64))


def split_keys(width: int, splits: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(keys per split, splits): `splits` ranges of whole `block_n` chunks over `width` keys, none left empty."""
    if splits <= 1:
        return width, 1
    keys_per_split = -(-width // splits // block_n) * block_n
    return keys_per_split, -(-width // keys_per_split)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, window,
                     scaling, splits: int | None = None) -> torch.Tensor:
    """query [1, H, R, D] (after RoPE); caches [slots, KVH, D] (new keys already written) -> [1, R, H, D].

    `splits`: programs per (row, kv head) over the keys (None: `num_splits` decides; 1: no split).
    The work is the custom operator `minibatch::paged_decode` (`paged_decode` below), so that
    torch.compile treats the kernel as one opaque call instead of tracing into its launch.
    """
    if triton is None:
        raise RuntimeError('decode_attention="triton" needs the triton package (it comes with the CUDA '
                           "builds of PyTorch)")
    dim = query.shape[-1]
    if dim & (dim - 1) or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError(f"the triton decode kernel needs a power-of-two head_dim and contiguous heads, got {dim}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be an integer >= 1, got {splits!r}")
    return paged_decode(query, k_cache, v_cache, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions,
                        batch.rows(), int(window or 0), float(scaling or dim**-0.5), splits or 0)


# Why a custom operator: torch.compile, tracing into a Triton launch, re-specializes it and passes the
# float scale as float64, which the kernel's loop rejects. Behind an operator, Inductor compiles
# everything around it and calls the kernel as it is. The fake implementation tells the compiler the
# output's shape without running anything.
@torch.library.custom_op("minibatch::paged_decode", mutates_args=())
def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
                 kv_seq: torch.Tensor, kv_pos: torch.Tensor, positions: torch.Tensor, rows: int, window: int,
                 scaling: float, splits: int) -> torch.Tensor:
    """The kernels' launch (splits 0: `num_splits` decides). Output [1, rows, H, D], a new tensor."""
    return launch(query, k_cache, v_cache, kv_indices, kv_seq, kv_pos, positions, rows, window, scaling, splits)


def launch(query, k_cache, v_cache, kv_indices, kv_seq, kv_pos, positions, rows: int, window: int, scaling: float,
           splits: int, block_n: int = 0, warps: int = 0, stages: int = 0,
           pdl: bool | None = None, fresh: dict | None = None) -> torch.Tensor:
    """paged_decode's work, its settings as arguments (for experiments: decode_kernel_tune.py): keys per loop
    step, warps and pipeline stages (0: `SETTINGS`, or BLOCK_N and `warps_stages`), split count (0:
    `num_splits`), `pdl` (None: early inside compiled steps on GPUs that have it). `fresh` (fresh.py's
    operator): query is this step's q as its projection left it, [R, H * D], and the dict holds k and v
    likewise ([R, KVH * D]), the norms' weights (None: no norm), their eps, cos and sin [R, D] and the cache
    cells to write (cell_mapping)."""
    rule = SETTINGS or (BLOCK_N, *warps_stages(rows))
    block_n, warps, stages = block_n or rule[0], warps or rule[1], stages or rule[2]
    kv_heads, dim = k_cache.shape[1], k_cache.shape[2]
    if fresh is None:
        heads = query.shape[1]
        q = query[0].transpose(0, 1)  # [R, H, D], a view
        if q.stride(2) != 1:
            q = q.contiguous()
        q_strides, norm = (q.stride(0), q.stride(1)), False
        extra = [q, q, 0, 0, q, q, q, q, 0, 1, q, 0.0, 0]  # (the FRESH arguments: unused)
    else:
        q, heads = query, query.shape[1] // dim
        k_new, v_new, cos, sin = fresh["k"], fresh["v"], fresh["cos"], fresh["sin"]
        norm = fresh["q_weight"] is not None
        weights = [fresh["q_weight"], fresh["k_weight"]] if norm else [q, q]
        q_strides = (q.stride(0), dim)
        if cos.stride() != sin.stride():
            raise ValueError(f"cos and sin need one layout, got strides {cos.stride()} and {sin.stride()}")
        extra = [k_new, v_new, k_new.stride(0), v_new.stride(0), *weights, cos, sin, *cos.stride(),
                 fresh["cell_mapping"], float(fresh["eps"])]  # (and the new key's split: below)
    group = heads // kv_heads
    out = torch.empty(1, rows, heads, dim, device=query.device, dtype=query.dtype)
    o = out[0]
    pdl = (wanted() if pdl is None else pdl) and has_pdl(query.device)  # (inside compiled steps: speed/early.py)
    early = {"launch_pdl": True} if pdl else {}
    width = kv_indices.shape[0] // rows
    if splits == 0:
        splits = num_splits(rows, kv_heads, width, query.device, block_n=block_n)
    keys_per_split, splits = split_keys(width, splits, block_n)
    if fresh is not None:  # which program folds in the new key: the first split's, or one more of its own
        apart = NEW_KEY_APART and splits > 1
        extra.append(splits if apart else 0)
        splits += apart  # (its range of keys starts past the last key: its loop is empty)
    partial = [torch.empty(rows * heads * splits * n, device=query.device, dtype=torch.float32)
               for n in (1, 1, dim)] if splits > 1 else [o, o, o]  # m, l, acc (unused without a split)
    _decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, o, kv_indices, kv_seq, kv_pos, positions, *partial,
        *q_strides, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), width, keys_per_split, scaling, *extra,
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        WINDOW=window, IEEE=query.dtype == torch.float32, SPLIT=splits > 1, PDL=pdl,
        LINE=min(dim, 128 // k_cache.element_size()), FRESH=fresh is not None, NORM=norm,
        num_warps=warps, num_stages=stages, **early,
    )
    if splits > 1:
        _combine_kernel[(rows, heads)](*partial, o, o.stride(0), o.stride(1), heads, S=splits,
                                       BLOCK_S=max(2, triton.next_power_of_2(splits)), D=dim, PDL=pdl, **early)
    return out


@paged_decode.register_fake
def _(query, k_cache, v_cache, kv_indices, kv_seq, kv_pos, positions, rows, window, scaling, splits):
    return query.new_empty(1, rows, query.shape[1], query.shape[3])
