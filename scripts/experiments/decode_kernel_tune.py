"""The Triton decode attention's launch settings, swept: keys per loop step, warps, pipeline stages, splits.

    python3 scripts/experiments/decode_kernel_tune.py OUTDIR [--points 1x512,8x512,32x512,128x512,32x2048,128x2048]
        [--model llama3-8b-shape] [--per-sm 2,4,8,16]

For each point (rows x context; `--model`'s attention shape: the 8B one has 32 query heads, 8 key/value
heads, head_dim 128, 32 layers; bf16) a paged cache of all its layers holds `rows` requests of `context`
tokens (random keys and values, blocks of 16), and the decode batch is built as a GPU run builds it.
Each setting runs the kernel once per layer, all captured in one CUDA graph (so that, as in a step, the
next layer's keys are not in L2), mean of 20 replays, each kernel launched after the last (no early
launch). Settings: BLOCK_N (keys per loop step) x num_warps x num_stages x programs per SM that
num_splits aims for (`--per-sm`; the shipped heuristic aims for 2, triton_decode.PROGRAMS_PER_SM; below 1
fewer splits, down to none), and the shipped one with Triton's default warps and stages (4 and 3;
"defaults": triton_decode.LEAN off). Prints, per point, the shipped setting's time, the defaults', the best
setting's (and the best of each split count), and each against the keys' and values' bytes at the copy
bandwidth; checks every setting's output against the shipped one's (bf16 rounding). Writes
decode_kernel_tune.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minibatch.model import triton_decode as td  # noqa: E402
from minibatch.tools.floors import graph_replay_ms, measure_bandwidth  # noqa: E402
from minibatch.core.batch import build_batch  # noqa: E402
from minibatch.core.kv_cache import PagedKVCache  # noqa: E402
from minibatch.core.requests import Request, SamplingParams  # noqa: E402
from minibatch.core.scheduler import Scheduler  # noqa: E402
from minibatch.core.buckets import ROW_BUCKETS  # noqa: E402
from minibatch.model.model import RANDOM_CONFIGS  # noqa: E402

BLOCK = 16


def setup(shape: dict, rows: int, context: int):
    cache = PagedKVCache(shape["layers"], shape["kv_heads"], shape["dim"], rows * (-(-(context + 2) // BLOCK)), BLOCK,
                         device="cuda", dtype=torch.bfloat16)
    sched = Scheduler(cache.allocator, rows * context, rows)
    for i in range(rows):
        sched.add(Request(i, [1] * (context - 1), SamplingParams(max_new_tokens=2)))
    sched.update(sched.schedule(), [1] * rows)
    batch = build_batch(sched.schedule(), cache, 64, True, ROW_BUCKETS, 64).to("cuda")
    for t in cache.keys + cache.values:
        t.normal_()
    query = torch.randn(1, shape["heads"], batch.decode_rows, shape["dim"], device="cuda", dtype=torch.bfloat16)
    return cache, batch, query


def attention_shape(model: str) -> dict:
    c = RANDOM_CONFIGS[model][1]
    heads = c["num_attention_heads"]
    return {"layers": c["num_hidden_layers"], "heads": heads, "kv_heads": c.get("num_key_value_heads", heads),
            "dim": c.get("head_dim", c["hidden_size"] // heads)}


def launch(query, k_cache, v_cache, batch, block_n: int, warps: int, stages: int, per_sm: float):
    """triton_decode.launch with the split count num_splits picks when it aims for `per_sm` programs per SM;
    returns the output and the splits launched."""
    rows = batch.decode_rows
    width = batch.kv_indices.shape[0] // rows
    splits = td.num_splits(rows, k_cache.shape[1], width, query.device, per_sm, block_n)
    out = td.launch(query, k_cache, v_cache, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions, rows, 0,
                    query.shape[3] ** -0.5, splits, block_n=block_n, warps=warps, stages=stages, pdl=False)
    return out, td.split_keys(width, splits, block_n)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default="1x512,8x512,32x512,128x512,32x2048,128x2048")
    ap.add_argument("--model", default="llama3-8b-shape", choices=[n for n in RANDOM_CONFIGS if "shape" in n])
    ap.add_argument("--per-sm", default="2,4,8,16",
                    help="the programs per SM num_splits aims for, swept (fractions allowed: 0.125 leaves 4 rows of "
                         "8 key/value heads unsplit on 132 SMs)")
    args = ap.parse_args()
    shape = attention_shape(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {td.triton.__version__}, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    settings = [dict(block_n=n, warps=w, stages=s, per_sm=p)
                for n, w, s, p in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4),
                                                    [float(x) for x in args.per_sm.split(",")])]
    results = {"copy_bandwidth": bw, "model": args.model, "shape": shape, "points": []}
    for pt in args.points.split(","):
        rows, context = (int(x) for x in pt.split("x"))
        warps, stages = td.warps_stages(rows)
        shipped = dict(block_n=td.BLOCK_N, warps=warps, stages=stages, per_sm=td.PROGRAMS_PER_SM)
        defaults = dict(block_n=td.BLOCK_N, warps=4, stages=3, per_sm=td.PROGRAMS_PER_SM)  # (Triton's warps, stages)
        cache, batch, query = setup(shape, rows, context)
        kv_bytes = shape["layers"] * rows * (context + 1) * shape["kv_heads"] * shape["dim"] * 2 * 2
        ref = None
        timed = []
        for st in [shipped, defaults] + settings:
            def run(st=st):
                for layer in range(shape["layers"]):
                    launch(query, cache.keys[layer], cache.values[layer], batch, **st)
            try:
                got, splits = launch(query, cache.keys[0], cache.values[0], batch, **st)
                if ref is None:
                    ref = got.float()
                err = ((got.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"{pt} {st}: output differs from the shipped setting's by {err:.2e}")
                timed.append((graph_replay_ms(run), st, splits, err))
            except Exception as e:  # noqa: BLE001 - a setting that needs more shared memory than an SM has
                if type(e).__name__ != "OutOfResources":
                    raise
                continue
        base, plain = timed[0], timed[1]
        best = min(timed, key=lambda t: t[0])
        floor = kv_bytes / bw * 1e3
        row = {"rows": rows, "context": context, "kv_floor_ms": floor, "shipped": shipped, "shipped_ms": base[0],
               "shipped_splits": base[2], "defaults_ms": plain[0], "best_ms": best[0], "best": best[1],
               "best_splits": best[2],
               "top5": [{"ms": t[0], **t[1], "splits": t[2]} for t in sorted(timed, key=lambda t: t[0])[:5]],
               "best_by_splits": {s: min(t[0] for t in timed if t[2] == s) for s in sorted({t[2] for t in timed})}}
        results["points"].append(row)
        print(f"{rows:4d} x {context:5d}: floor {floor:6.3f} ms  shipped {base[0]:6.3f} ({base[0] / floor:.2f}x, "
              f"{base[2]} splits, {warps} warps, {stages} stages)  defaults {plain[0]:6.3f}  best {best[0]:6.3f} "
              f"({best[0] / floor:.2f}x) {best[1]} {best[2]} splits", flush=True)
        for t in sorted(timed, key=lambda t: t[0])[1:5]:
            print(f"{'':16} next: {t[0]:6.3f} {t[1]} {t[2]} splits", flush=True)
        print(f"{'':16} the best of each split count: "
              + ", ".join(f"{s}: {ms:.3f}" for s, ms in row["best_by_splits"].items()), flush=True)
        del cache, batch, query
        torch.cuda.empty_cache()
        (out / "decode_kernel_tune.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
