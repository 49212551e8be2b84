"""The Triton decode attention's launch settings, swept: keys per loop step, warps, pipeline stages, splits.

    python3 scripts/experiments/decode_kernel_tune.py OUTDIR [--points 1x512,8x512,32x512,128x512,32x2048,128x2048]

For each point (rows x context; 8B shape: 32 query heads, 8 key/value heads, head_dim 128, bf16) a
paged cache of 32 layers holds `rows` requests of `context` tokens (random keys and values, blocks of
16), and the decode batch is built as a GPU run builds it. Each setting runs the kernel once per
layer, 32 calls captured in one CUDA graph (so that, as in a step, the next layer's keys are not in
L2), mean of 20 replays. Settings: BLOCK_N (keys per loop step) x num_warps x num_stages x
programs per SM that num_splits aims for (the shipped heuristic aims for 2). Prints, per point, the
shipped setting's time, the best setting's, and both against the keys' and values' bytes at the copy
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

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 32, 32, 8, 128, 16


def setup(rows: int, context: int):
    cache = PagedKVCache(LAYERS, KV_HEADS, DIM, rows * (-(-(context + 2) // BLOCK)), BLOCK, device="cuda",
                         dtype=torch.bfloat16)
    sched = Scheduler(cache.allocator, rows * context, rows)
    for i in range(rows):
        sched.add(Request(i, [1] * (context - 1), SamplingParams(max_new_tokens=2)))
    sched.update(sched.schedule(), [1] * rows)
    batch = build_batch(sched.schedule(), cache, 64, True, ROW_BUCKETS, 64).to("cuda")
    for t in cache.keys + cache.values:
        t.normal_()
    query = torch.randn(1, HEADS, batch.decode_rows, DIM, device="cuda", dtype=torch.bfloat16)
    return cache, batch, query


def launch(query, k_cache, v_cache, batch, block_n: int, warps: int, stages: int, per_sm: int):
    """triton_decode.paged_decode's launch, with its settings as arguments."""
    rows, heads, dim = batch.decode_rows, query.shape[1], query.shape[3]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = query[0].transpose(0, 1)
    out = torch.empty(1, rows, heads, dim, device=query.device, dtype=query.dtype)
    o = out[0]
    width = batch.kv_indices.shape[0] // rows
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    splits = max(1, min(-(-per_sm * sms // (rows * kv_heads)), -(-width // block_n), 64))
    keys_per_split = -(-width // splits // block_n) * block_n if splits > 1 else width
    splits = -(-width // keys_per_split) if splits > 1 else 1
    partial = [torch.empty(rows * heads * splits * n, device=query.device, dtype=torch.float32)
               for n in (1, 1, dim)] if splits > 1 else [o, o, o]
    td._decode_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, o, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions, *partial,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), width, keys_per_split, dim ** -0.5,
        G=group, BLOCK_G=max(16, td.triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n,
        WINDOW=0, IEEE=False, SPLIT=splits > 1, num_warps=warps, num_stages=stages)
    if splits > 1:
        td._combine_kernel[(rows, heads)](*partial, o, o.stride(0), o.stride(1), heads, S=splits,
                                          BLOCK_S=max(2, td.triton.next_power_of_2(splits)), D=dim)
    return out, splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--points", default="1x512,8x512,32x512,128x512,32x2048,128x2048")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {td.triton.__version__}, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    shipped = dict(block_n=td.BLOCK_N, warps=4, stages=3, per_sm=2)  # Triton's default warps and stages
    settings = [dict(block_n=n, warps=w, stages=s, per_sm=p)
                for n, w, s, p in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (2, 4, 8, 16))]
    results = {"copy_bandwidth": bw, "shipped": shipped, "points": []}
    for pt in args.points.split(","):
        rows, context = (int(x) for x in pt.split("x"))
        cache, batch, query = setup(rows, context)
        kv_bytes = LAYERS * rows * (context + 1) * KV_HEADS * DIM * 2 * 2
        ref = None
        timed = []
        for st in [shipped] + settings:
            def run(st=st):
                for layer in range(LAYERS):
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
        base = timed[0]
        best = min(timed, key=lambda t: t[0])
        floor = kv_bytes / bw * 1e3
        row = {"rows": rows, "context": context, "kv_floor_ms": floor, "shipped_ms": base[0],
               "shipped_splits": base[2], "best_ms": best[0], "best": best[1], "best_splits": best[2],
               "top5": [{"ms": t[0], **t[1], "splits": t[2]} for t in sorted(timed, key=lambda t: t[0])[:5]]}
        results["points"].append(row)
        print(f"{rows:4d} x {context:5d}: floor {floor:6.3f} ms  shipped {base[0]:6.3f} ({base[0] / floor:.2f}x, "
              f"{base[2]} splits)  best {best[0]:6.3f} ({best[0] / floor:.2f}x) {best[1]} {best[2]} splits", flush=True)
        for t in sorted(timed, key=lambda t: t[0])[1:5]:
            print(f"{'':16} next: {t[0]:6.3f} {t[1]} {t[2]} splits", flush=True)
        del cache, batch, query
        torch.cuda.empty_cache()
        (out / "decode_kernel_tune.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
