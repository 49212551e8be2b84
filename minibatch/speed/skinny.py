"""Matrix products of a few rows by a small weight: a Triton kernel for the decode step of small models.

Why: a decode step multiplies a handful of rows (the batch) by every weight matrix once, so each
product should take the time to stream its weight from memory. For a 0.6B model's weights (2-12 MB
per product) cuBLAS's kernels reach a third of the bandwidth or less (BENCHMARKS.md, small models):
too few of its tiles run at once to keep every SM reading, and small outputs (1024 columns) give
few tiles in the first place. This kernel gives each program a thin slice of output columns
(`block_n`, 2 to 16 of them), so even 1024 columns make hundreds of programs, and streams those
columns' weights in `block_k`-wide pieces:

    one program per `block_n` output columns (and per split of K, with `split` > 1):
        acc[m, n] = 0                                         (float32, m < rows)
        for each piece of block_k inputs:
            w = W[columns, piece]                            [block_n, block_k]
            x = X[rows, piece]                               [block_m, block_k]  (cached: it is small)
            acc += sum over the piece of x[:, None, :] * w[None, :, :]
        Y[rows, columns] = acc                               (or the split's partial sum)

No tensor cores: with 1 to 16 rows the products are a few multiply-adds per weight byte, far below
what the plain arithmetic units do, and `tl.dot` would want 16 rows. With `split` > 1 each program
sums a range of K into a float32 scratch and a second kernel adds the ranges in a fixed order:
deterministic, unlike atomic adds, so the same step gives the same bits every time.

Where it is used: `skinny_linear` (the custom operator `minibatch::skinny_linear`) takes the place of
the `linear` calls of a compiled decode step whose rows are at most MAX_ROWS, on CUDA (siblings.py's
graph pass, `CompiledStep(skinny=True)`); it picks its settings per shape (`settings`), and runs
cuBLAS where no setting was measured to win. Sums run in another order than cuBLAS's, so bf16 tokens
may differ from a compiled step without it: compare like with like, as CompiledStep says.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

#: the most rows the kernel takes; above it every product is cuBLAS's
MAX_ROWS = 16


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, pieces, sxm, swn, sym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, SPLIT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * swn
        x_rows = x_ptr + rm[:, None] * sxm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        start = pid_k * pieces * BLOCK_K  # this program's range of K: `pieces` pieces of BLOCK_K
        for i in tl.range(0, pieces, num_stages=STAGES):
            kk = start + i * BLOCK_K + rk
            inside = kk[None, :] < K
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & inside, other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & inside, other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        out = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT:  # this range's partial sum, into scratch [splits, M, N] (float32)
            tl.store(y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=out)
        else:
            tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)

    @triton.jit
    def _sum_splits_kernel(p_ptr, y_ptr, M, N, sym, S: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(S):  # a fixed order: the same bits every time
            acc += tl.load(p_ptr + s * M * N + i, mask=inside, other=0.0)
        tl.store(y_ptr + (i // N) * sym + i % N, acc.to(y_ptr.dtype.element_ty), mask=inside)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int,
           stages: int, split: int = 1) -> None:
    """y = x @ w.T with x [M, K] (M <= MAX_ROWS, rows contiguous), w [N, K] (rows contiguous), y [M, N]."""
    M, K = x.shape
    N = w.shape[0]
    pieces = triton.cdiv(triton.cdiv(K, split), block_k)  # per split
    split = triton.cdiv(K, pieces * block_k)  # (none empty)
    target = y if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    _skinny_kernel[(triton.cdiv(N, block_n), split)](
        x, w, target, M, N, K, pieces, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        SPLIT=split > 1, num_warps=warps)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](target, y, M, N, y.stride(0), S=split, BLOCK=block)
