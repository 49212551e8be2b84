"""A small model's decode products: cuBLAS against speed/skinny.py's kernel, every setting, A/B (GPU only).

    python3 scripts/experiments/skinny_gemv_ab.py OUTDIR [--model qwen3-0.6b-shape] [--rows 1,8]

For each matrix product of a decode step of `--model` as the compiled step runs it (q/k/v and gate/up
merged: siblings.py), at each row count: cuBLAS (`torch.mm`) against the Triton kernel of
minibatch/speed/skinny.py at every setting of a grid (columns per program, K per piece, warps,
pipeline stages, K splits; plain multiply-adds or tensor cores), each over as many distinct weight
copies as the model has layers (so nothing stays in the L2 cache), in one CUDA graph per variant;
the floor is the weights' bytes at the copy bandwidth measured here. The kernel is launched without
programmatic dependent launch (speed/early.py), like cuBLAS's: each product starts after the last. Checks each result against
cuBLAS's within bf16 rounding. `--grid gated`: the merged gate/up product with silu(gate) * up
inside the kernel (speed/gated.py), against cuBLAS's product followed by PyTorch's silu and product (two more
kernels; a compiled step runs one). `--grid tiles`: the shipped setting against those tensor-core tiles, on plain
products (floor_matrix.py --skinny-settings takes the best into a step). Prints each shape's best setting and the model's products summed
(cuBLAS, the kernel's best, the floor), and writes OUTDIR/skinny_gemv_MODEL.json with every timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from minibatch.model.model import RANDOM_CONFIGS  # noqa: E402
from minibatch.speed import skinny  # noqa: E402
from minibatch.tools.floors import graph_replay_ms, measure_bandwidth  # noqa: E402


def model_shapes(name: str) -> tuple[list[tuple[str, int, int]], int]:
    """(product, N, K) of one layer, q/k/v and gate/up merged, and the LM head; and the layer count."""
    c = RANDOM_CONFIGS[name][1]
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    kv = c.get("num_key_value_heads", heads)
    return [("qkv", (heads + 2 * kv) * head_dim, hidden), ("o", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter), ("lm_head", c["vocab_size"], hidden)], \
        c["num_hidden_layers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b-shape", choices=[n for n in RANDOM_CONFIGS if "shape" in n])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--shapes", default=None, help="the products to time, e.g. o,down (default: all)")
    ap.add_argument("--grid", choices=["all", "defer", "gated", "tiles"], default="all",
                    help="defer: only the shipped settings and the kernel's `defer` ones (sums over K after the loop); "
                         "tiles: the shipped settings and tensor-core tiles as --grid gated's, without the activation; "
                         "gated: the gate/up product with silu(gate) * up inside the kernel (speed/gated.py), "
                         "against cuBLAS's product followed by PyTorch's silu and product")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("skinny_gemv_ab.py times CUDA graphs: it needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    shapes, layers = model_shapes(args.model)
    torch.manual_seed(0)
    bw = measure_bandwidth("cuda")
    print(f"{args.model}: copy bandwidth {bw / 1e9:.0f} GB/s; torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    grid = [dict(block_n=n, block_k=k, warps=w, stages=s, split=p)
            for n, k, w, s, p in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (1, 3), (1, 2, 4))] + [
        dict(block_n=n, block_k=k, warps=w, stages=s, split=p, dot=True)  # tensor cores, 16 rows a tile
        for n, k, w, s, p in itertools.product((16, 32), (256, 512, 1024), (4, 8), (2, 4), (1, 2, 4))]
    if args.grid == "defer":
        grid = [dict(block_n=4, block_k=k, warps=4, stages=3, split=1) for k in (1024, 2048)] + [
            dict(block_n=n, block_k=k, warps=w, stages=s, split=1, defer=True)
            for n, k, w, s in itertools.product((4, 8), (256, 512, 1024), (4, 8), (1, 3))]
    tiles = [dict(block_n=n, block_k=k, warps=w, stages=s, split=1, dot=True)
             for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4, 5))]
    if args.grid == "tiles":  # (the shipped plain setting first; skinny.py's wide tile is one of the tiles)
        grid = [dict(block_n=4, block_k=1024, warps=4, stages=3, split=1)] + tiles
    if args.grid == "gated":  # (gated.py's own settings first)
        grid = [dict(block_n=n, block_k=k, warps=w, stages=3, split=1, defer=d)
                for n, k, w, d in itertools.product((4, 8), (512, 1024), (4, 8), (False, True))] + tiles
        args.shapes = "gate_up"
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    results = {"model": args.model, "copy_bandwidth": bw, "rows": rows, "layers": layers, "shapes": {},
               "torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "command": "python3 scripts/experiments/skinny_gemv_ab.py "
               + " ".join(sys.argv[1:])}
    for name, N, K in shapes:
        copies = 1 if name == "lm_head" else layers
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        per = results["shapes"][name] = {"N": N, "K": K, "copies": copies}
        gate = args.grid == "gated"
        out_n = N // 2 if gate else N  # (gated: the activation's columns)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(M, out_n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            both = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws] if gate else ys
            ref = torch.nn.functional.linear(x, ws[0])
            ref = (torch.nn.functional.silu(ref[:, :out_n]) * ref[:, out_n:] if gate else ref).float()

            def cublas():
                for w, y, b in zip(ws, ys, both):
                    torch.mm(x, w.t(), out=b)
                    if gate:
                        torch.mul(torch.nn.functional.silu(b[:, :out_n]), b[:, out_n:], out=y)

            t_cublas = graph_replay_ms(cublas, 20)
            if gate:  # (the product alone too: what the kernel's product part has to beat)

                def cublas_product():
                    for w, b in zip(ws, both):
                        torch.mm(x, w.t(), out=b)

                per.setdefault("cublas_product_ms", {})[M] = graph_replay_ms(cublas_product, 20)
                print(f"gate_up M={M}: cuBLAS's product alone {per['cublas_product_ms'][M]:.3f} ms", flush=True)
            timings, t0 = [], time.perf_counter()
            for c in grid:
                per_thread = (max(1, triton.next_power_of_2(M)) * c["block_n"] * c["block_k"] / (32 * c["warps"])
                              * (2 if gate else 1))
                if not c.get("dot") and per_thread > 256:
                    continue  # (more than 256 products per thread per piece: registers spill)

                def run(c=c):
                    for w, y in zip(ws, ys):
                        skinny.launch(x, w, y, {**c, "pdl": False}, up=out_n if gate else None)  # (each after
                        # the one before, as cuBLAS's)
                try:
                    run()
                    torch.cuda.synchronize()
                except triton.runtime.errors.OutOfResources:
                    continue
                err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    raise AssertionError(f"{name} M={M} {c}: relative error {err:.3g}")
                timings.append((graph_replay_ms(run, 20), c))
            timings.sort(key=lambda t: t[0])
            best_ms, best = timings[0]
            nbytes = copies * N * K * 2
            per[M] = {"cublas_ms": t_cublas, "triton_ms": best_ms, "config": best, "floor_ms": nbytes / bw * 1e3,
                      "all": timings}
            print(f"{name:8s} N={N:6d} K={K:5d} M={M:3d}  "
                  f"cublas {t_cublas:7.3f} ms ({nbytes / t_cublas / 1e6:5.0f} GB/s)"
                  f"  triton {best_ms:7.3f} ms ({nbytes / best_ms / 1e6:5.0f} GB/s) {best}"
                  f"  [{len(timings)} settings, {time.perf_counter() - t0:.0f} s]", flush=True)
        ws.clear()  # (frees the copies before the next shape's)
        torch.cuda.empty_cache()
    print("\nthe model's products per decode step (ms):")
    sh = results["shapes"]
    for M in rows:
        tot = {k: sum(sh[s][M][k] for s, _, _ in shapes) for k in ("cublas_ms", "triton_ms", "floor_ms")}
        tot["best_ms"] = sum(min(sh[s][M]["cublas_ms"], sh[s][M]["triton_ms"]) for s, _, _ in shapes)
        results.setdefault("total", {})[M] = tot
        f = tot["floor_ms"]
        print(f"M={M:3d}  floor {f:.3f}  cublas {tot['cublas_ms']:.3f} ({tot['cublas_ms'] / f:.2f}x)  triton "
              f"{tot['triton_ms']:.3f} ({tot['triton_ms'] / f:.2f}x)  best of both per shape {tot['best_ms']:.3f} "
              f"({tot['best_ms'] / f:.2f}x)", flush=True)
    (out / f"skinny_gemv_{args.model}.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
