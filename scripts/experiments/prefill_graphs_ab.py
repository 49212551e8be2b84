"""Prefill and mixed steps as CUDA graphs, or eager: the same workloads side by side in one process.

    python3 scripts/experiments/prefill_graphs_ab.py OUTDIR [--points MODEL:BATCH:PROMPT:NEW[:ARRIVALS],...] [--repeats 2]

For each point, one Engine runs the workload with `cuda_graphs="decode"` (decode steps replayed as
graphs, prefill and mixed steps eager and unpadded) and with `cuda_graphs=True` (every step padded to
bucketed sizes and replayed: graphs.pad_flat), each in the sync and the async loop. Every one of the four
runs once untimed first (graph captures), then `--repeats` times in turn; the medians are printed: wall
time, device busy, the mean compute span of the prefill/mixed steps, and the decode step. Tokens must be
equal across the four runs of a point within each graph setting (sync == async); across settings too in
float32, and they are reported, not required, in bf16 (padding changes the matrix shapes, so cuBLAS may
round differently). Writes OUTDIR/prefill_graphs_ab.json after every point.

The default points are the sweep's small shapes where the async loop left the GPU idle before each eager
prefill step (notes/benchmarks_history_2026-11-29_to_2026-12-02.md), and the 8B shape with requests arriving all along the run (mixed steps
throughout, each compute-bound), where padding must not cost more than it saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import minibatch  # noqa: E402
from minibatch.tools import bench  # noqa: E402

POINTS = "qwen3-0.6b-shape:8:2016:64,llama3-1b-shape:32:480:64,qwen3-0.6b-shape:1:2016:64,llama3-8b-shape:32:256:256:128"


def run_point(spec: str, repeats: int, max_batch_tokens: int) -> dict:
    name, batch, prompt, new, *rest = spec.split(":")
    batch, prompt, new, arrivals = int(batch), int(prompt), int(new), int(rest[0]) if rest else 0
    model = minibatch.load_model(name, device="cuda")
    prompts = bench.random_prompts(batch, prompt, model.vocab_size)
    kw = dict(max_batch_size=batch, max_batch_tokens=max_batch_tokens, progress=False)
    if arrivals:
        kw["arrival_steps"] = [i * arrivals // batch for i in range(batch)]
    runs = [(graphs, mode) for graphs in ("decode", True) for mode in ("sync", "async")]
    results = {r: [] for r in runs}
    outs = {}
    with minibatch.Engine(model, keep=4) as engine:
        for graphs, mode in runs:  # untimed: captures
            bench.run_mode(engine, prompts, mode, new, cuda_graphs=graphs, **kw)
        for i in range(repeats):
            for graphs, mode in (runs if i % 2 == 0 else runs[::-1]):
                res, _, out = bench.run_mode(engine, prompts, mode, new, cuda_graphs=graphs, **kw)
                results[(graphs, mode)].append(res)
                outs[(graphs, mode)] = out
    row = {"model": name, "batch": batch, "prompt": prompt, "new": new, "arrivals": arrivals, "runs": {},
           "environment": bench.environment(model)}
    del model
    for (graphs, mode), rs in results.items():
        label = f"{mode} {'all graphs' if graphs is True else 'decode graphs'}"
        row["runs"][label] = {
            "wall_s": statistics.median(r.wall_s for r in rs), "busy": statistics.median(r.device_busy for r in rs),
            "other_compute_ms": statistics.median(r.other_compute_ms for r in rs),
            "decode_compute_ms": statistics.median(r.decode_compute_ms for r in rs),
            "all": [asdict(r) for r in rs]}
    row["sync_eq_async"] = {str(g): outs[(g, "sync")] == outs[(g, "async")] for g in ("decode", True)}
    row["graphs_eq_eager_prefill"] = outs[(True, "sync")] == outs[("decode", "sync")]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--points", default=POINTS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env: dict = {}  # the machine's, from the first point's model (each point keeps its own too)
    rows = []
    print(f"{'point':34}{'run':22}{'wall s':>8}{'busy':>8}{'prefill ms':>11}{'decode ms':>10}", flush=True)
    for spec in a.points.split(","):
        row = run_point(spec, a.repeats, a.max_batch_tokens)
        rows.append(row)
        if not env:
            env = {k: v for k, v in row["environment"].items() if k not in ("model", "dtype")}
            env["command"] = " ".join(["python3", *sys.argv])
        base = {m: row["runs"][f"{m} decode graphs"]["wall_s"] for m in ("sync", "async")}
        for label, r in row["runs"].items():
            ratio = r["wall_s"] / base[label.split()[0]]
            print(f"{spec:34}{label:22}{r['wall_s']:>8.3f}{r['busy']:>8.1%}{r['other_compute_ms']:>11.2f}"
                  f"{r['decode_compute_ms']:>10.2f}   x{ratio:.2f}", flush=True)
        print(f"{'':34}sync == async: {row['sync_eq_async']}; all graphs == decode graphs: "
              f"{row['graphs_eq_eager_prefill']}", flush=True)
        (out / "prefill_graphs_ab.json").write_text(json.dumps({"environment": env, "points": rows}, indent=1))


if __name__ == "__main__":
    main()
