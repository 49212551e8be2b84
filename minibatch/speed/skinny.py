"""Matrix products of a few rows by a small weight: a Triton kernel for the decode step of small models.

Why: a decode step multiplies a handful of rows (the batch) by every weight matrix once, so each
product should take the time to stream its weight from memory. For a 0.6B model's weights (2-12 MB
per product) cuBLAS reaches a third of the copy bandwidth or less on the products with 1024 output
columns (BENCHMARKS.md, small models): they make too few of its tiles to keep every SM reading.
This kernel gives each program a thin slice of output columns (`block_n`: 4 in the setting it ships
with), so 1024 columns make 256 programs, and streams those columns' weights in `block_k`-wide pieces:

    one program per `block_n` output columns (and per split of K, with `split` > 1):
        acc[m, n] = 0                                         (float32, m < rows)
        for each piece of block_k inputs:
            w = W[columns, piece]                            [block_n, block_k]
            x = X[rows, piece]                               [block_m, block_k]  (small: from L2 mostly)
            acc += sum over the piece of x[:, None, :] * w[None, :, :]
        Y[rows, columns] = acc                               (or the split's partial sum)

Plain multiply-adds: with 1 to 4 rows there are a few per weight byte, far below what the arithmetic
units do. (`dot` puts them on tensor cores, in tiles of 16 rows; the timings preferred it only for
8 rows or wide outputs, where cuBLAS is about as fast: it is used for 2-4 rows of the 0.6B model's merged
q/k/v product, whose successor the kernel lets launch early, and by gated.py.) With `split` > 1 each program
sums a range of K into a float32 scratch and a second kernel adds the ranges in a fixed order:
deterministic, unlike atomic adds, so the same step gives the same bits every time.

Where it is used: `skinny_linear` (the custom operator `minibatch::skinny_linear`) takes the place of
the `linear` calls of a compiled decode step with few rows and a narrow output, on CUDA (`route`, a
pass of siblings.py's backend; `CompiledStep(skinny=...)`, on by default where Triton is installed);
it picks its setting per shape (`settings`), and runs cuBLAS where none was measured to win. On Hopper
and later, inside compiled steps, it is launched early (early.py): its weights stream into L2 while the
kernel before it finishes. Sums run in another order than cuBLAS's, so bf16 tokens may differ from a
compiled step without it: compare like with like, as CompiledStep says.
"""

from __future__ import annotations

import torch

from .early import has_pdl, prefetch_l2, wanted
from .fx_edits import bias_free_product, placeholders, recompiled, replace, rows_of, weight_of

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of PyTorch come without Triton
    triton = None

#: the widest product (output columns) that goes to the kernel, by the most rows it has (`settings`):
#: one row up to 2048 columns, 2-4 rows up to 1024; more rows or wider products stay on cuBLAS
WIDEST = {1: 2048, 4: 1024}

#: Past WIDEST: products whose K is at most 1024 (a hidden size of 1024, as the 0.6B model's merged q/k/v,
#: 4096 x 1024) go to the kernel at 1-4 rows up to this many columns (0: WIDEST alone). Why: with so short a
#: K, alone, the kernel took less time than cuBLAS at one row and tied at 4; and in a compiled step the kernel
#: lets the decode attention after it launch early (early.py), which cuBLAS's kernels never do: the 0.6B
#: step was faster with it at 1 and 4 rows, not at 8 (BENCHMARKS.md, small models).
SHORT_K = 4096

#: The tensor-core setting (`settings`, and gated.py's at 2-8 rows): 32 columns a program, K in pieces of 128,
#: 4 warps, 5 pipeline stages
TILE = dict(block_n=32, block_k=128, warps=4, stages=5, dot=True)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _glu(gate, up, dtype: tl.constexpr):
        """(gated.py) silu(gate) * up from float32 sums: each rounded to `dtype` first, then each op rounded as
        PyTorch's own ops on `dtype` tensors round it (silu in float32, the product in float32)."""
        g = gate.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype)
        return act.to(tl.float32) * up.to(dtype).to(tl.float32)

    @triton.jit
    def _sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEFER: tl.constexpr):
        """A program's sums: [rows, columns], and with DEFER the products kept apart along K (else unused)."""
        if DEFER:
            apart = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            apart = tl.zeros((1, 1, 1), dtype=tl.float32)
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), apart

    @triton.jit
    def _add_piece(x, w, acc, apart, DOT: tl.constexpr, DEFER: tl.constexpr, IEEE: tl.constexpr):
        """One piece of K into the sums: on tensor cores (a tile of 16 rows, those past M zeros; float32 in
        full precision with IEEE, as cuBLAS's float32 products, not TF32), or plain multiply-adds summed over
        the piece now, or (DEFER) kept apart and summed after the loop."""
        if DOT:
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            products = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            if DEFER:
                apart += products
            else:
                acc += tl.sum(products, axis=2)
        return acc, apart

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, pieces, sxm, swn, sym, up_offset, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                       DOT: tl.constexpr, PDL: tl.constexpr, LINE: tl.constexpr, DEFER: tl.constexpr,
                       GATE: tl.constexpr, IEEE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * swn
        x_rows = x_ptr + rm[:, None] * sxm
        acc, apart = _sums(BLOCK_M, BLOCK_N, BLOCK_K, DEFER)
        # (gated.py) the same columns of the up projection, `up_offset` elements past the gate's rows (unread
        # without GATE: the compiler drops them)
        acc_up, apart_up = _sums(BLOCK_M, BLOCK_N, BLOCK_K, DEFER)
        start = pid_k * pieces * BLOCK_K  # this program's range of K: `pieces` pieces of BLOCK_K
        if PDL:  # launched while the kernel before it still runs: this program's weights (which no kernel
            # writes) start streaming into L2 now; x, that kernel's output, is read only after it is done
            lines = tl.arange(0, BLOCK_K // LINE) * LINE  # (one address per 128-byte line, kept inside W)
            w_lines = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * swn
            for i in range(0, pieces):
                prefetch_l2(w_lines + tl.minimum(start + i * BLOCK_K + lines, K - 1)[None, :])
                if GATE:
                    prefetch_l2(w_lines + up_offset + tl.minimum(start + i * BLOCK_K + lines, K - 1)[None, :])
            tl.extra.cuda.gdc_wait()
        for i in tl.range(0, pieces, num_stages=STAGES):
            kk = start + i * BLOCK_K + rk
            inside = kk[None, :] < K
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & inside, other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & inside, other=0.0)
            acc, apart = _add_piece(x, w, acc, apart, DOT, DEFER, IEEE)
            if GATE:
                w_up = tl.load(w_rows + up_offset + kk[None, :], mask=(rn[:, None] < N) & inside, other=0.0)
                acc_up, apart_up = _add_piece(x, w_up, acc_up, apart_up, DOT, DEFER, IEEE)
        if DEFER:
            acc = tl.sum(apart, axis=2)
            if GATE:
                acc_up = tl.sum(apart_up, axis=2)
        if GATE:
            acc = _glu(acc, acc_up, y_ptr.dtype.element_ty)
        if PDL:  # the next kernel may launch now (its programs wait for this one's results); any earlier, and
            tl.extra.cuda.gdc_launch_dependents()  # they would take the places this kernel's last programs need
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


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, setting: dict, up: int | None = None) -> None:
    """y = x @ w.T, x [M, K] (a few rows: 16 at most), w [N, K], y [M, N], each with contiguous rows.
    `up` (gated.py): y = silu(x @ w[:N].T) * (x @ w[up:up + N].T), N = y's columns, w [at least up + N, K]
    (the merged gate/up weight, from the gate's first row); not with a split.

    `setting`: block_n (output columns per program), block_k (K per piece), warps, stages (pipelined
    pieces), split (programs along K, default 1), dot (the products on tensor cores, `tl.dot`, 16 rows a
    tile; block_n and block_k at least 16; default False), defer (without dot: the products kept apart
    along K in registers and summed once after the loop instead of once a piece; default False), pdl
    (launched early: early.py; default: inside a compiled step, only where the GPU has it)."""
    block_n, block_k = setting["block_n"], setting["block_k"]
    pdl = setting.get("pdl", wanted()) and has_pdl(x.device)
    split, dot = setting.get("split", 1), setting.get("dot", False)
    M, K = x.shape
    N = w.shape[0]
    pieces = triton.cdiv(triton.cdiv(K, split), block_k)  # per split
    split = triton.cdiv(K, pieces * block_k)  # (none empty)
    if up is not None:
        N = y.shape[1]
        if split > 1 or up < N or up + N > w.shape[0]:
            raise ValueError(f"a gated product takes w's rows [0, {N}) and [{up}, {up + N}) of {w.shape[0]}, "
                             f"without a split (split {split})")
    target = y if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    _skinny_kernel[(triton.cdiv(N, block_n), split)](
        x, w, target, M, N, K, pieces, x.stride(0), w.stride(0), y.stride(0), (up or 0) * w.stride(0),
        BLOCK_M=max(16 if dot else 1, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=setting["stages"], SPLIT=split > 1, DOT=dot, PDL=pdl, LINE=min(block_k, 128 // w.element_size()),
        DEFER=setting.get("defer", False) and not dot, GATE=up is not None,
        IEEE=x.dtype == torch.float32, num_warps=setting["warps"],
        **({"launch_pdl": True} if pdl else {}))
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](target, y, M, N, y.stride(0), S=split, BLOCK=block)


def settings(rows: int, n: int, k: int) -> dict | None:
    """The kernel's settings for `rows` x [n, k] products, or None where cuBLAS's kernels are as fast.

    From the timings on an H200 (scripts/experiments/skinny_gemv_ab.py and floor_matrix.py --skinny-ab;
    BENCHMARKS.md, small models): on the 0.6B model's attention output and MLP down products (1024
    columns, where cuBLAS's tiles leave most SMs idle) this setting is 1.5-3.4x faster than cuBLAS with
    one row and 1.1-1.7x with 4; on its wide products (4096 columns and more) it only ties with one row
    and loses with 4; the 1B model's step (o and down with 2048 columns) was faster with the kernel at
    one row and slower at 4 rows; with 8 rows cuBLAS is within 9% of the kernel's best setting
    everywhere. So (`WIDEST`): one row and n <= 2048, or 2-4 rows and n <= 1024 (2 and 3 rows were not
    timed apart: they take 4 rows' rule); and, with K of at most 1024, 1-4 rows up to `SHORT_K` columns.
    One setting serves most: 4 columns per program, K in pieces of 1024, 4 warps, 3 pipeline stages;
    except, where it was timed faster in the 0.6B step, K of 2048 in one piece for products of at most
    1024 columns (`ONE_PIECE`), and with 2-4 rows and K over 2048, pieces of 512 summed along K once after
    the loop (`DEFER`).

    2-4 rows on a product wider than 2048 columns (the 0.6B model's merged q/k/v), and more than 4 rows
    (experiments that widen `WIDEST`: floor_matrix.py --variants widest=...), run on tensor cores (`TILE`:
    32 columns per program, K in pieces of 128, 4 warps, 5 pipeline stages), the fastest of 72 tiles alone on
    the 0.6B q/k/v product at 4 and 8 rows as on its gate/up product (gated.py); plain multiply-adds took
    1.2-2x longer there (skinny_gemv_ab.py --grid tiles). TIMED, where it has (rows, n, k), takes the place
    of all this, WIDEST included.
    """
    if (rows, n, k) in TIMED:
        return dict(TIMED[(rows, n, k)])
    widest = max((n_max for r, n_max in WIDEST.items() if r >= rows), default=0) if rows >= 1 else 0
    if 1 <= rows <= 4 and k <= 1024:
        widest = max(widest, SHORT_K)
    if n > widest:
        return None
    if rows > 4 or (rows > 1 and n > 2048):
        return dict(TILE)
    if DEFER and rows > 1 and k > 2048:
        return dict(block_n=4, block_k=512, warps=4, stages=3, defer=True)
    whole = ONE_PIECE and k == 2048 and n <= 1024
    return dict(block_n=4, block_k=k if whole else 1024, warps=4, stages=3)


#: Settings timed elsewhere, by (rows, n, k), that take the place of `settings`' rule for those products, WIDEST
#: included (floor_matrix.py --skinny-settings: the best of skinny_gemv_ab.py's grid, for one variant's paths).
TIMED: dict[tuple[int, int, int], dict] = {}


#: K in one piece where it is 2048 and the product has at most 1024 columns (the 0.6B attention output):
#: timed faster alone (skinny_gemv_ab.py) and in the 0.6B compiled step at 1 and 4 rows (BENCHMARKS.md,
#: small models). K = 3072 in two pieces of 2048 (half of the second masked) was slower, so larger K keeps
#: pieces of 1024; the 1B model's attention output (2048 columns, one row) was not timed with it.
ONE_PIECE = True


#: With 2-4 rows and K over 2048 (the 0.6B down product), the kernel's products summed along K once after
#: its loop rather than once a piece (`defer`), in pieces of 512. Why: with 4 rows each piece's sum over K
#: has 4 times the outputs of one row's, a reduction across the program's threads every piece, and the
#: kernel took longer a product at 4 rows than at 1. Timed faster alone at 4 rows (not at 1, so not used
#: there) and in the 0.6B compiled step at 4 rows (BENCHMARKS.md, small models).
DEFER = True


# Why a custom operator: Inductor then calls the kernel as it is (as triton_decode.paged_decode), and the
# choice of kernel is made where the real row count is known (a server's compile has symbolic rows).
@torch.library.custom_op("minibatch::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T, by the kernel where `settings` picks it (CUDA, x and weight of one
    floating dtype), else F.linear."""
    return _product(x, weight)


@skinny_linear.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(k, 1)
    chosen = settings(rows, n, k) if usable(x, weight) else None
    if chosen is None:
        return torch.nn.functional.linear(x, weight)
    y = x.new_empty(rows, n)
    launch(flat_rows(x, rows), weight, y, chosen)
    return y.reshape(*x.shape[:-1], n)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the kernel take x @ weight.T at all (a CUDA tensor, with Triton; one floating dtype; weight rows
    contiguous)? Which products it takes is `settings`' rule."""
    return (x.is_cuda and available() and weight.stride(-1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def flat_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x as [rows, K] with contiguous rows (a view where it can be: a slice of a wider output stays one)."""
    flat = x.reshape(rows, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def route(gm: torch.fx.GraphModule, example_inputs, on_cuda_only: bool = True) -> int:
    """A pass over a compiled decode step's graph (siblings.py's backend runs it after `merge`): each
    `linear` call without a bias (merged siblings' included: fx_edits.weight_of) for which `settings` picks the
    kernel at the input's row count (or, for a symbolic count, at one row) becomes a `skinny_linear`
    call, which picks the kernel or F.linear per call, from the real row count. Returns how many calls
    it routed. `on_cuda_only=False`: route CPU graphs too (tests: there the operator runs F.linear)."""
    from .compat import LINEAR_TARGETS

    real = placeholders(gm, example_inputs)
    routed = 0
    for node in list(gm.graph.nodes):
        found = bias_free_product(node, LINEAR_TARGETS)
        if found is None:
            continue
        x, w, value = found
        weight = weight_of(w, real)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if (on_cuda_only and not weight.is_cuda) or (torch.is_grad_enabled() and weight.requires_grad):
            continue  # (gradients: the operator has no backward, inference only as siblings.merge)
        rows = rows_of(value)
        if settings(rows if isinstance(rows, int) else 1, *weight.shape) is None:
            continue
        replace(gm, node, torch.ops.minibatch.skinny_linear.default, (x, w))
        routed += 1
    return recompiled(gm, routed)
