"""The host's work per decode step: this package against another checkout of it, step by step, one process.

    git worktree add /tmp/before COMMIT
    PYTHONPATH=$PWD python scripts/host_cost_ab.py OUT --against /tmp/before [--rows 128] [--context 1024]

Why not two runs of host_cost.py: on a shared machine the speed of a core drifts by up to 3x within
minutes (BENCHMARKS.md), more than most changes to the host's work. Here the other checkout's
`minibatch` is copied under another name and imported beside this one; two identical runs (N requests
with a prompt of C tokens, prefilled untimed, then decoding in the decode layout a GPU run builds) take
turns step by step, the order alternating, so a drift slows both alike. Parts timed per step: schedule,
build (build_batch), carry (carry_over_mask), load (IOSlot.load, into plain host tensors: no device
is opened) and update. Prints the median ms per step of each part and of all five, for both, and
writes host_cost_ab.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

PARTS = ("schedule", "build", "carry", "load", "update")


class _HostOnly:
    """Just enough of a device for an IOSlot: host tensors for both sides, no events."""

    def empty(self, shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype)

    def pin(self, tensor):
        return tensor.clone()

    def event(self):
        return None


def stepper(pkg: str, rows: int, context: int, new_tokens: int):
    """A function that runs one decode step's host work with package `pkg` and returns its part times."""
    m = {name: importlib.import_module(f"{pkg}.{name}")
         for name in ("batch", "scheduler", "requests", "kv_cache", "slots", "carry_over", "step")}
    R = m["requests"]
    reqs = [R.Request(i, [(i + j) % 1000 for j in range(context)], new_tokens, R.SamplingParams(0.7, 0, 1.0, i))
            for i in range(rows)]
    cache = m["kv_cache"].PagedKVCache(1, 1, 1, sum(-(-r.max_len // 16) for r in reqs), 16)
    sched = m["scheduler"].Scheduler(cache.allocator, max(rows, 8192), rows)
    for r in reqs:
        sched.add(r)
    while any(r.num_sampled == 0 for r in reqs):  # prefill, not timed
        plan = sched.schedule()
        sched.update(plan, [1] * len(plan.sampling_chunks))
    width = -(-(context + new_tokens + 2) // 64) * 64
    slot = m["slots"].IOSlot(_HostOnly(), 0, max(rows, 8192), rows * width + 64, 256)
    kw = dict(kv_bucket=1, decode_layout=True, row_buckets=m["step"].ROW_BUCKETS, decode_bucket=64)
    state = {"prev": None}

    def step() -> tuple:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        batch = m["batch"].build_batch(plan, cache, **kw)
        t2 = time.perf_counter()
        carry = m["carry_over"].carry_over_mask(state["prev"], plan)
        t3 = time.perf_counter()
        slot.load(batch, carry)
        del batch  # as the loops do (batch.py: copy on write)
        t4 = time.perf_counter()
        sched.update(plan, slot.sampled(len(plan.sampling_chunks)))
        t5 = time.perf_counter()
        state["prev"] = plan
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (host_cost_ab.json)")
    p.add_argument("--against", required=True, help="another checkout of the project (its minibatch/ is used)")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of every request")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per side")
    a = p.parse_args()
    other = Path(a.against) / "minibatch"
    if not (other / "__init__.py").is_file():
        p.error(f"--against {a.against}: no minibatch package there")
    torch.set_num_threads(1)  # the loop's host thread
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(other, Path(tmp) / "minibatch_against", ignore=shutil.ignore_patterns("assets"))
        sys.path.insert(0, tmp)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        sides = {"this": stepper("minibatch", a.rows, a.context, a.steps + 10),
                 "against": stepper("minibatch_against", a.rows, a.context, a.steps + 10)}
        times = {k: [] for k in sides}
        for i in range(a.steps):
            for name in (("this", "against") if i % 2 else ("against", "this")):
                times[name].append(sides[name]())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    print(f"{a.rows} rows, {a.context}-token contexts, {a.steps} steps each; ms per step, median")
    print(f"{'':9}" + "".join(f"{x:>10}" for x in (*PARTS, "total")))
    for name, ts in times.items():
        med = {part: 1e3 * statistics.median(t[k] for t in ts) for k, part in enumerate(PARTS)}
        med["total"] = 1e3 * statistics.median(sum(t) for t in ts)
        results[name] = med
        print(f"{name:9}" + "".join(f"{med[x]:>10.3f}" for x in (*PARTS, "total")))
    print(f"this / against, total: {results['this']['total'] / results['against']['total']:.2f}")
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    (out / "host_cost_ab.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()
