"""Decode attention, one layer of the 8B shape: gather + SDPA vs the Triton kernel, with and without split.

    python3 scripts/experiments/decode_attention_ab.py $OUT          # on a CUDA machine; writes $OUT/decode_attention_ab.json
    TRITON_INTERPRET=1 python scripts/experiments/decode_attention_ab.py out --cpu   # a small dry run of the script

Shape: 32 query heads, 8 key/value heads, head_dim 128, bf16, block size 16, keys per row padded to a
multiple of 64 (the decode layout a GPU run uses). For rows in {1, 8, 32, 128} x context {512, 2048}:

  sdpa          what attention.py does by default: index_select the row's keys and values out of the
                paged cache into a [rows, L] copy, then one fused SDPA call
  triton        triton_decode.py, one program per (row, kv head), reading the cache in place
  triton split  the same with the keys split over several programs (num_splits' choice; "-" when it
                picks no split)

Each variant is captured in a CUDA graph of 10 calls (launch overhead out), replayed 20 times after a
warm-up, timed with CUDA events; the median per call is reported, with the bandwidth it reaches on
the bytes it must read (keys + values of every row). Correctness: each Triton variant against the
einsum reference (attention._decode_attention) as relative error ||got - ref|| / ||ref||, in float32
(must be < 1e-3) and in bf16 (reference in float32 on the same bf16 values; must be < 1e-2). A
point that fails prints its error in the table and the script goes on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minibatch.model import triton_decode  # noqa: E402
from minibatch.model.attention import PagedMeta, _decode_attention, _decode_attention_sdpa  # noqa: E402
from minibatch.core.batch import build_batch  # noqa: E402
from minibatch.core.buckets import ROW_BUCKETS  # noqa: E402
from minibatch.core.kv_cache import PagedKVCache  # noqa: E402
from minibatch.core.requests import Request, SamplingParams  # noqa: E402
from minibatch.core.scheduler import Scheduler  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
TAGS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ROWS, CONTEXTS = (1, 8, 32, 128), (512, 2048)
DEVICE, LOW = "cuda", torch.bfloat16
if "--cpu" in sys.argv:  # Triton's interpreter: tiny sizes, host-clock times (meaningless, only a check);
    # float16 for the low-precision check, as the interpreter mishandles bf16 loads
    HEADS, KV_HEADS, DIM, ROWS, CONTEXTS, DEVICE, LOW = 4, 2, 16, (1, 3), (100, 200), "cpu", torch.float16


def setup(rows: int, context: int, dtype: torch.dtype):
    """A paged cache of random keys/values holding `rows` requests of `context` tokens, its decode batch
    (on the GPU) and a query."""
    cache = PagedKVCache(1, KV_HEADS, DIM, rows * (-(-(context + 2) // BLOCK)), BLOCK, device=DEVICE, dtype=dtype)
    sched = Scheduler(cache.allocator, rows * context, rows)
    for i in range(rows):
        sched.add(Request(i, [1] * (context - 1), SamplingParams(max_new_tokens=2)))
    sched.update(sched.schedule(), [1] * rows)  # the prompts (their keys are the random ones below)
    batch = build_batch(sched.schedule(), cache, 64, True, ROW_BUCKETS, 64).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(rows * 10_000 + context)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g, device=DEVICE))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g, device=DEVICE))
    query = torch.randn(1, HEADS, batch.decode_rows, DIM, generator=g, device=DEVICE).to(dtype)
    return cache, batch, query


def variants(cache, batch, query, splits):
    k, v = cache.keys[0], cache.values[0]
    meta = PagedMeta(cache, batch)

    def sdpa():
        return _decode_attention_sdpa(query, k.index_select(0, batch.kv_indices), v.index_select(0, batch.kv_indices),
                                      meta, None, None)

    out = {"sdpa": sdpa, "triton": lambda: triton_decode.decode_attention(query, k, v, batch, None, None, 1)}
    if splits > 1:
        out["triton split"] = lambda: triton_decode.decode_attention(query, k, v, batch, None, None, splits)
    return out


def reference(cache, batch, query):
    """The einsum attention in float32 over the gathered keys."""
    k = cache.keys[0].index_select(0, batch.kv_indices).float()
    v = cache.values[0].index_select(0, batch.kv_indices).float()
    return _decode_attention(query.float(), k, v, PagedMeta(cache, batch), None, None)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def graph_ms(fn, calls: int = 10, replays: int = 20) -> float:
    if DEVICE == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def point(rows: int, context: int) -> dict:
    row = {"rows": rows, "context": context}
    # correctness first, in float32, then bf16
    for dtype, limit in ((torch.float32, 1e-3), (LOW, 1e-2)):
        cache, batch, query = setup(rows, context, dtype)
        width = batch.kv_indices.shape[0] // batch.decode_rows
        splits = triton_decode.num_splits(batch.decode_rows, KV_HEADS, width, query.device)
        ref = reference(cache, batch, query)
        tag = TAGS[dtype]
        for name, fn in variants(cache, batch, query, splits).items():
            if name != "sdpa":
                err = rel_err(fn(), ref)
                row[f"err {name} {tag}"] = err
                if not err < limit:
                    row.setdefault("errors", []).append(f"{name} {tag}: relative error {err:.2e} >= {limit:g}")
        if dtype == LOW:
            row["splits"] = splits
            kv = 2 * batch.decode_rows * width * KV_HEADS * DIM * 2  # keys + values the step reads, bf16
            row["kv_mb"] = kv / 1e6
            for name, fn in variants(cache, batch, query, splits).items():
                ms = graph_ms(fn)
                row[f"{name} ms"] = ms
                row[f"{name} GB/s"] = kv / ms / 1e6
        del cache, batch, query, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else ".")
    out.mkdir(parents=True, exist_ok=True)
    if not triton_decode.available() or (DEVICE == "cuda" and not torch.cuda.is_available()):
        sys.exit("decode_attention_ab.py needs the triton package and a CUDA GPU (or --cpu with TRITON_INTERPRET=1)")
    env = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
           "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python3", *sys.argv])}
    print(json.dumps(env), flush=True)
    head = f"{'rows':>5}{'ctx':>6}{'splits':>7}{'sdpa ms':>9}{'triton ms':>10}{'split ms':>9}{'best GB/s':>10}" \
           f"{'err fp32':>10}{'err ' + TAGS[LOW]:>10}"
    print(head, flush=True)
    rows, t0 = [], time.time()
    for r in ROWS:
        for c in CONTEXTS:
            try:
                p = point(r, c)
            except Exception as e:  # noqa: BLE001 - one failing point must not lose the table
                traceback.print_exc()
                p = {"rows": r, "context": c, "errors": [f"{type(e).__name__}: {e}"]}
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            rows.append(p)
            (out / "decode_attention_ab.json").write_text(json.dumps({"environment": env, "points": rows}, indent=1))
            if "sdpa ms" in p:
                best = max(p.get(f"{n} GB/s", 0) for n in ("sdpa", "triton", "triton split"))
                errs = [max(v for k, v in p.items() if k.startswith("err") and k.endswith(t)) for t in ("fp32", TAGS[LOW])]
                split = f"{p['triton split ms']:>9.4f}" if "triton split ms" in p else f"{'-':>9}"
                print(f"{r:>5}{c:>6}{p['splits']:>7}{p['sdpa ms']:>9.4f}{p['triton ms']:>10.4f}{split}{best:>10.0f}"
                      f"{errs[0]:>10.1e}{errs[1]:>10.1e}", flush=True)
            for e in p.get("errors", []):
                print(f"{r:>5}{c:>6}  ERROR {e}", flush=True)
    print(f"done in {time.time() - t0:.0f} s; wrote {out / 'decode_attention_ab.json'}")
    if any(p.get("errors") for p in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
