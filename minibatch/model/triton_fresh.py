"""Fresh's path inside the decode kernel (model/fresh.py; notebook 07): the Triton pieces that norm and rotate this
step's query and key heads and fold its new key and value in, called by triton_decode.py's `_decode_kernel` where
FRESH is set. Apart from that kernel so that it stays readable in one sitting; every rounding here follows the
model's own ops (fresh.py says why).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

if triton is not None:

    @triton.jit
    def fresh_heads(base, offs_d, mask, w_ptr, cos_d, sin_d, eps, D: tl.constexpr, NORM: tl.constexpr):
        """Head vectors [R, D] from `base` ([R, 1] pointers): RMSNorm over D with weight w (NORM), then the
        rotary embedding with this row's cos and sin (`cos_d`, `sin_d`: [D] pointers, any stride), each product
        rounded to the input's dtype as the model's own ops round it (fresh.py)."""
        perm = (offs_d + D // 2) % D  # rotate_half: [-x2, x1], i.e. x[perm] with the first half negated
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
        xp = tl.load(base + perm[None, :], mask=mask, other=0.0)
        dt = x.dtype
        x, xp = x.to(tl.float32), xp.to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]  # (the same for x and its rotation)
            w, wp = tl.load(w_ptr + offs_d).to(tl.float32), tl.load(w_ptr + perm).to(tl.float32)
            x = (w[None, :] * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp[None, :] * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c, s = tl.load(cos_d).to(tl.float32), tl.load(sin_d).to(tl.float32)
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        a = (x * c[None, :]).to(dt).to(tl.float32)  # q * cos + rotate_half(q) * sin, each product rounded
        b = ((sign[None, :] * xp) * s[None, :]).to(dt).to(tl.float32)
        return (a + b).to(dt)

    @triton.jit
    def query_heads(q_rows, offs_d, gmask, qw_ptr, cos_d, sin_d, eps, D: tl.constexpr, FRESH: tl.constexpr,
                    NORM: tl.constexpr):
        """The query heads a program serves [BLOCK_G, D]: as RoPE left them, or (FRESH: fresh.py) as their
        projection did, normed and rotated here."""
        if FRESH:
            return fresh_heads(q_rows, offs_d, gmask, qw_ptr, cos_d, sin_d, eps, D, NORM)
        return tl.load(q_rows + offs_d[None, :], mask=gmask, other=0.0)

    @triton.jit
    def new_key(q, m_i, l_i, acc, k_raw, v_raw, k_cell, v_cell, offs_d, kw_ptr, cos_d, sin_d, eps, scale,
                D: tl.constexpr, NORM: tl.constexpr):
        """This step's key (normed and rotated) and value: written into the cache cell, and folded into the
        running max m, sum l and weighted values acc like one more key (always visible: the row's own)."""
        k_new = fresh_heads(k_raw + tl.zeros([1, 1], tl.int32), offs_d, offs_d[None, :] < D, kw_ptr, cos_d,
                            sin_d, eps, D, NORM)  # [1, D]
        v_new = tl.load(v_raw + offs_d[None, :])
        tl.store(k_cell + offs_d[None, :], k_new.to(k_cell.dtype.element_ty))
        tl.store(v_cell + offs_d[None, :], v_new.to(v_cell.dtype.element_ty))
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale  # [G]
        m_new = tl.maximum(m_i, s_new)
        p = tl.exp(s_new - m_new)
        alpha = tl.exp(m_i - m_new)
        p_v = p.to(v_new.dtype).to(tl.float32)  # (rounded as the loop's p before its product with v)
        return m_new, l_i * alpha + p, acc * alpha[:, None] + p_v[:, None] * v_new.to(tl.float32)
