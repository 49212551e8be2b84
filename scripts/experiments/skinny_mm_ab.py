"""Can a Triton kernel stream a decode step's weights faster than cuBLAS? Skinny matrix products, A/B.

    python3 scripts/experiments/skinny_mm_ab.py OUTDIR [--rows 1,8,32,128] [--layers 32]

A decode step's Linear layers multiply a few rows (the batch) by large weight matrices: y = x @ W.T
with x [M, K], W [N, K], M small. Each weight is read once, so the time is set by memory bandwidth;
the floor is the weight bytes over the copy bandwidth. For each Linear shape of the 8B Llama shape
and each row count this script times, over `--layers` distinct weight copies (so that nothing stays
in the L2 cache), in one CUDA graph per variant:

    cublas      torch.nn.functional.linear (what transformers' Linear layers call)
    triton      one program per BLOCK_N outputs for all M rows, looping over K (tl.dot on a
                BLOCK_M x BLOCK_K tile of x and a BLOCK_N x BLOCK_K tile of W); the best of a small
                grid of tile sizes, warps and pipeline stages

and prints each shape's times and achieved bandwidth, then the whole model's Linear layers (sum over
shapes, per row count) for both, against the weight floor at the copy bandwidth measured here
(floors.measure_bandwidth, as the bench's floor). Two more shapes are timed for comparison, not as
layers of the model: q, k and v as one product (N = 6144) and gate and up as one (N = 28672), which
is what engines that merge those projections run; the totals say what merging would give.
Checks that the Triton result equals cuBLAS's within bf16 rounding. Writes skinny_mm.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
import triton.language as tl

from minibatch.tools.floors import graph_replay_ms, measure_bandwidth  # noqa: E402

# (name, N, K) per layer of the 8B Llama shape, and the LM head once
SHAPES = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
          ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]
HEAD = ("lm_head", 128256, 4096)
MERGED = [("qkv", 6144, 4096), ("gate_up", 28672, 4096)]  # for comparison only


@triton.jit
def skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * sxm + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + (k + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x, w, y, block_n, block_k, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    skinny_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                              num_warps=warps, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    bw = measure_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    configs = [dict(block_n=n, block_k=k, warps=w, stages=s)
               for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))
               if n * k <= 16384]
    results = {"copy_bandwidth": bw, "rows": rows, "shapes": {}, "torch": torch.__version__,
               "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    for name, N, K in SHAPES + [HEAD] + MERGED:
        copies = 1 if name == "lm_head" else args.layers
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        per = results["shapes"][name] = {"N": N, "K": K, "copies": copies}
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
            ref = torch.nn.functional.linear(x, ws[0])

            def cublas():
                for w, y in zip(ws, ys):
                    torch.mm(x, w.t(), out=y)

            t_cublas = graph_replay_ms(cublas, 10)
            best = None
            t0 = time.perf_counter()
            for c in configs:
                def run(c=c):
                    for w, y in zip(ws, ys):
                        triton_linear(x, w, y, **c)
                try:
                    run()
                    torch.cuda.synchronize()
                    err = ((ys[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if err > 2e-2:
                        raise AssertionError(f"{name} M={M} {c}: relative error {err:.3g}")
                    t = graph_replay_ms(run, 10)
                except (triton.runtime.errors.OutOfResources if hasattr(triton.runtime, "errors") else RuntimeError):
                    continue
                if best is None or t < best[0]:
                    best = (t, c, err)
            nbytes = copies * N * K * 2
            per[M] = {"cublas_ms": t_cublas, "triton_ms": best[0], "config": best[1], "rel_err": best[2],
                      "floor_ms": nbytes / bw * 1e3}
            print(f"{name:8s} N={N:6d} K={K:5d} M={M:3d}  cublas {t_cublas:7.3f} ms ({nbytes / t_cublas / 1e6:5.0f} GB/s)  "
                  f"triton {best[0]:7.3f} ms ({nbytes / best[0] / 1e6:5.0f} GB/s) {best[1]}  err {best[2]:.1e}  "
                  f"[tuning {time.perf_counter() - t0:.0f} s]", flush=True)
        del ws
        torch.cuda.empty_cache()
    print("\nwhole model, Linear layers (ms):")
    sh = results["shapes"]
    for M in rows:
        tot = {k: sum(sh[s][M][k] for s, _, _ in SHAPES + [HEAD]) for k in ("cublas_ms", "triton_ms", "floor_ms")}
        best = {s: min(sh[s][M]["cublas_ms"], sh[s][M]["triton_ms"]) for s in sh}
        tot["best_ms"] = sum(best[s] for s, _, _ in SHAPES + [HEAD])
        # the same bytes with q/k/v and gate/up each read by one product
        tot["merged_cublas_ms"] = tot["cublas_ms"] - sum(sh[s][M]["cublas_ms"] for s in ("q", "k", "v", "gate", "up")) \
            + sh["qkv"][M]["cublas_ms"] + sh["gate_up"][M]["cublas_ms"]
        results.setdefault("total", {})[M] = tot
        f = tot["floor_ms"]
        print(f"M={M:3d}  floor {f:.2f}  cublas {tot['cublas_ms']:.2f} ({tot['cublas_ms'] / f:.2f}x)  "
              f"triton {tot['triton_ms']:.2f} ({tot['triton_ms'] / f:.2f}x)  best of both per shape {tot['best_ms']:.2f} "
              f"({tot['best_ms'] / f:.2f}x)  cublas, q/k/v and gate/up merged {tot['merged_cublas_ms']:.2f} "
              f"({tot['merged_cublas_ms'] / f:.2f}x)", flush=True)
    (out / "skinny_mm.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
