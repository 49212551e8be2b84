"""Does the async loop beat the sync loop on a CPU? Alternating sync/async pairs in one process.

    PYTHONPATH=$PWD python scripts/cpu_overlap.py OUT_DIR [--pairs 7] [--device cpu|cpu-threads] [--like-demo]

The demo's kind of workload: the tiny model, 8 prompts x 48 new tokens, seeded sampling at T=0.7, no
injected delay, one Engine for every run, batches of up to 8 rows and 64 tokens. With --like-demo,
exactly what `python -m minibatch demo` runs instead: its prompts, batches of up to 4 rows and 32
tokens, stopping at the end-of-text token. Pairs alternate (sync then async, async then sync, ...) so
that a change in the machine's load hits both modes alike. Prints each pair's async/sync wall ratio,
their median and spread, whether the tokens are equal (they must be), the device's busy share per
mode, and what a decode step costs the host (prepare + update) and the device (compute); writes it
all to OUT_DIR/cpu_overlap.json. Other work on the machine shows up in the numbers: the load average
is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import minibatch
from minibatch.tools import bench
from minibatch.core import engine
from minibatch.devices import get_device

PROMPTS = ["The for statement", "A class definition", "Exceptions are raised", "The import system",
           "Assignment statements", "A string literal", "The while loop", "Functions are defined"]


def per_step(tl, lane: str, names: tuple[str, ...]) -> float:
    """Median milliseconds per step spent in spans of `names` on `lane` (decode and prefill steps)."""
    by_step: dict[int, float] = {}
    for s in tl.spans:
        if s.lane == lane and s.name in names and s.step >= 0:
            by_step[s.step] = by_step.get(s.step, 0.0) + s.duration
    return 1e3 * statistics.median(by_step.values()) if by_step else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for cpu_overlap.json")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cpu-threads"])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--like-demo", action="store_true",
                    help="the demo's own prompts and batch limits (4 rows, 32 tokens) instead of 8 rows, 64 tokens")
    args = ap.parse_args()
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    if args.device != "cpu":  # the engine opens the model's device ("cpu"); this picks the backend
        engine.get_device = lambda kind, **kw: get_device(args.device)
    load_before = os.getloadavg()
    model = minibatch.load_model("tiny", device="cpu")
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    kw = dict(max_batch_size=8, max_batch_tokens=64, temperature=0.7, seed=0)
    if args.like_demo:  # as minibatch.tools.cli.demo runs it
        from minibatch.tools.cli import DEMO_PROMPTS

        prompts = [model.tokenizer.encode(p) for p in DEMO_PROMPTS]
        kw = dict(eos_token_id=model.tokenizer.eos_token_id, max_batch_size=4, max_batch_tokens=32,
                  temperature=0.7, seed=0)
    eng = minibatch.Engine(model)
    bench.run_mode(eng, prompts, "sync", args.max_new_tokens, **kw)  # warm-up: first-call costs out of the way
    pairs, same = [], True
    for i in range(args.pairs):
        order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
        runs = {}
        for mode in order:
            r, tl, outs = bench.run_mode(eng, prompts, mode, args.max_new_tokens, **kw)
            runs[mode] = (r, tl, outs)
        same &= runs["sync"][2] == runs["async"][2]
        row = {"ratio": runs["async"][0].wall_s / runs["sync"][0].wall_s}
        for mode, (r, tl, _) in runs.items():
            row[mode] = {"wall_s": r.wall_s, "device_busy": r.device_busy, "steps": r.steps,
                         "host_ms_per_step": per_step(tl, "CPU", ("prepare", "update")),
                         "compute_ms_per_step": per_step(tl, "compute", ("compute",))}
        pairs.append(row)
        print(f"pair {i + 1} ({order[0]} first): async/sync {row['ratio']:.3f}   sync {row['sync']['wall_s']:.3f} s "
              f"busy {row['sync']['device_busy']:.0%}   async {row['async']['wall_s']:.3f} s "
              f"busy {row['async']['device_busy']:.0%}", flush=True)
    eng.close()
    ratios = [p["ratio"] for p in pairs]
    summary = {
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
        "tokens_equal": same,
        **{f"{m}_device_busy_median": statistics.median(p[m]["device_busy"] for p in pairs) for m in ("sync", "async")},
        **{f"{m}_{k}_median": statistics.median(p[m][k] for p in pairs)
           for m in ("sync", "async") for k in ("host_ms_per_step", "compute_ms_per_step")},
    }
    env = {"device": args.device, "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    print(f"\nmedian async/sync {summary['median_ratio']:.3f} (spread {summary['min_ratio']:.3f}-"
          f"{summary['max_ratio']:.3f}, {len(ratios)} pairs); tokens equal: {same}")
    print(f"device busy: sync {summary['sync_device_busy_median']:.0%}, async {summary['async_device_busy_median']:.0%}")
    print(f"per step (median ms): host prepare+update {summary['sync_host_ms_per_step_median']:.2f} (sync) / "
          f"{summary['async_host_ms_per_step_median']:.2f} (async); device compute "
          f"{summary['sync_compute_ms_per_step_median']:.2f} / {summary['async_compute_ms_per_step_median']:.2f}")
    print(f"load average {load_before[0]:.2f} before, {env['load_after'][0]:.2f} after; {env['cores']} cores")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_overlap.json").write_text(json.dumps({"summary": summary, "pairs": pairs, "env": env}, indent=1))
    if not same:
        raise SystemExit("error: sync and async gave different tokens")


if __name__ == "__main__":
    main()
