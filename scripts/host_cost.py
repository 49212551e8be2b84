"""The host's work per step of the loops, without a model: schedule, build, load, carry-over, update.

    PYTHONPATH=$PWD python scripts/host_cost.py out --rows 32,128 --context 1024
    PYTHONPATH=$PWD python scripts/host_cost.py out --profile      # also a cProfile of the 128-row run

For each row count and key layout, N requests with a prompt of `context` tokens are prefilled (not
timed), then every decode step of the synchronous loop's host side is timed part by part:

    schedule     Scheduler.schedule                       (prepare)
    build        build_batch                              (prepare)
    load         IOSlot.load of the batch into the slot   (prepare)
    carry        carry_over_mask against the previous plan (the async loop's prepare)
    update       Scheduler.update with the sampled tokens

The "device" hands back a fixed token per row at once, so nothing but host work is measured. Two
layouts: flat (what the cpu backend uses) and decode (rows padded to ROW_BUCKETS, keys laid out as
[rows, L] with L a multiple of 64: what a GPU uses). Prints the median per step of each part and of
all five parts ("total": the sync loop's prepare + update, plus "carry", which only the async loop
does) and the fastest step's total ("best"); writes host_cost.json into the output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from minibatch.devices import get_device  # noqa: E402

PARTS = ("schedule", "build", "load", "carry", "update")
BLOCK_SIZE = 16  # generate's default block size


def _module(pkg: str, name: str):
    """A module of `pkg` by its name in its core (core/), in an older checkout's layered package
    (batching/), or in a flat one (older still: the buckets then live in its step module, `bucket` in
    its batch module)."""
    for folder in ("core", "batching"):
        try:
            return importlib.import_module(f"{pkg}.{folder}.{name}")
        except ModuleNotFoundError:
            pass
    if name != "buckets":
        return importlib.import_module(f"{pkg}.{name}")
    step, batch = importlib.import_module(f"{pkg}.step"), importlib.import_module(f"{pkg}.batch")
    return type("buckets", (), {"ROW_BUCKETS": step.ROW_BUCKETS, "bucket": staticmethod(batch.bucket)})


def _request(R, rid: int, prompt: list[int], new_tokens: int, temperature: float):
    """A request of the `requests` module R: its SamplingParams holds max_new_tokens, or (an older checkout)
    the Request takes it beside them."""
    params = R.SamplingParams(temperature, 0, 1.0, rid)
    if "max_new_tokens" in {f.name for f in dataclasses.fields(R.SamplingParams)}:
        return R.Request(rid, prompt, params.replace(max_new_tokens=new_tokens))
    return R.Request(rid, prompt, new_tokens, params)


def host_steps(pkg, dev, rows: int, context: int, new_tokens: int, decode_layout: bool,
               temperature: float = 0.0):
    """Set up `rows` requests with `context`-token prompts, prefilled (not timed), and return a function
    that runs one decode step's host work and returns the seconds of each of PARTS.

    `pkg` is the package to take every piece from ("minibatch", or another checkout's copy of it,
    scripts/experiments/host_cost_ab.py); `dev` gives the IO slot its buffers."""
    m = {name: _module(pkg, name) for name in ("batch", "scheduler", "requests", "kv_cache", "slots", "carry_over")}
    m["buckets"] = _module(pkg, "buckets")
    R = m["requests"]
    reqs = [_request(R, i, [(i + j) % 1000 for j in range(context)], new_tokens, temperature) for i in range(rows)]
    blocks = sum(-(-r.max_len // BLOCK_SIZE) for r in reqs)
    cache = m["kv_cache"].PagedKVCache(1, 1, 1, blocks, BLOCK_SIZE)  # storage size is irrelevant to host cost
    sched = m["scheduler"].Scheduler(cache.allocator, max(rows, 8192), rows)
    for r in reqs:
        sched.add(r)
    row_buckets = m["buckets"].ROW_BUCKETS
    kw = dict(kv_bucket=1, decode_layout=decode_layout, row_buckets=row_buckets if decode_layout else (),
              decode_bucket=64 if decode_layout else None)
    width = -(-(context + new_tokens) // 64) * 64
    slot = m["slots"].IOSlot(dev, 0, max(rows, 8192), max(blocks * BLOCK_SIZE, rows * width) + 64,
                             max(m["buckets"].bucket(rows, row_buckets), rows))
    while any(r.num_sampled == 0 for r in reqs):  # prefill, not timed
        plan = sched.schedule()
        sched.update(plan, [1] * len(plan.sampling_chunks))
    build_batch, carry_over_mask = m["batch"].build_batch, m["carry_over"].carry_over_mask
    state = {"prev": None}

    def step() -> tuple:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        batch = build_batch(plan, cache, **kw)
        t2 = time.perf_counter()
        carry = carry_over_mask(state["prev"], plan)
        t3 = time.perf_counter()
        slot.load(batch, carry)
        del batch  # as in the loops, which keep no batch after loading it (batch.py: copy on write)
        t4 = time.perf_counter()
        sched.update(plan, slot.sampled(len(plan.sampling_chunks)))  # the D2H'd buffer, read as the loop does
        t5 = time.perf_counter()
        state["prev"] = plan
        return t1 - t0, t2 - t1, t4 - t3, t3 - t2, t5 - t4  # in the order of PARTS

    return step


def host_cost(rows: int, context: int, decode_layout: bool, steps: int = 50) -> dict[str, float]:
    """Median milliseconds per decode step of each host part, and of prepare + update ("total")."""
    dev = get_device("cpu")
    try:
        step = host_steps("minibatch", dev, rows, context, steps + 2, decode_layout)
        times = [step() for _ in range(steps)]
    finally:
        dev.close()
    out = {p: 1e3 * statistics.median(t[k] for t in times) for k, p in enumerate(PARTS)}
    totals = [1e3 * sum(t) for t in times]
    out["total"] = statistics.median(totals)
    out["best"] = min(totals)  # the least disturbed step: on a shared machine, a bound on the noise
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (host_cost.json)")
    p.add_argument("--rows", default="32,128")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of every request")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per point")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the largest decode-layout run")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the loop's host thread; the cpu backend's device work has the others
    results = []
    print(f"{'rows':>5} {'layout':>7} " + " ".join(f"{p:>9}" for p in (*PARTS, "total", "best")) + "   (ms per step, median)")
    for rows in (int(x) for x in a.rows.split(",")):
        for layout in ("flat", "decode"):
            r = host_cost(rows, a.context, layout == "decode", a.steps)
            print(f"{rows:>5} {layout:>7} " + " ".join(f"{r[p]:>9.3f}" for p in (*PARTS, "total", "best")), flush=True)
            results.append({"rows": rows, "layout": layout, "context": a.context, **r})
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    (out / "host_cost.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    if a.profile:
        import cProfile
        import pstats
        rows = max(int(x) for x in a.rows.split(","))
        prof = cProfile.Profile()
        prof.runcall(host_cost, rows, a.context, True, a.steps)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
