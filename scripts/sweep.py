"""Sweep model size x batch size, sync vs async, side by side; one JSON and one figure.

    python scripts/sweep.py --device cuda --models qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape \
        --batches 1,4,16,32,64 --prompt-len 256 --max-new-tokens 128 --out $OUT
    python scripts/sweep.py --device cpu --models random-llama,tiny --batches 1,4,16 --out out   # a dry run

Each model is loaded once; for each batch size both modes run the same prompts (after an untimed
warm-up run of the same workload, which also captures the CUDA graphs). Writes sweep.json and
sweep.png (async/sync wall ratio and device-busy fraction per model and batch size).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minibatch  # noqa: E402
from minibatch import bench  # noqa: E402


def sweep(models, batches, device, prompt_len, max_new_tokens, out: Path | None = None):
    rows = []
    for name in models:
        model = minibatch.load_model(name, device=device)
        env = bench.environment(model)
        for b in batches:
            prompts = bench.random_prompts(b, prompt_len, model.vocab_size)
            kw = dict(max_batch_size=b, max_batch_tokens=max(b, 2048))
            res = {}
            for mode in ("sync", "async"):
                bench.run_mode(model, prompts, mode, max_new_tokens, **kw)  # warm-up (graph captures)
                res[mode], _, _ = bench.run_mode(model, prompts, mode, max_new_tokens, **kw)
            ratio = res["async"].wall_s / res["sync"].wall_s
            print(f"{name:18} batch {b:3}: sync {res['sync'].tokens_per_s:8.0f} tok/s busy {res['sync'].device_busy:4.0%}"
                  f" | async {res['async'].tokens_per_s:8.0f} tok/s busy {res['async'].device_busy:4.0%}"
                  f" | wall ratio {ratio:.2f}", flush=True)
            rows.append({"model": name, "batch": b, "environment": env,
                         **{mode: asdict(r) for mode, r in res.items()}, "wall_ratio": ratio})
            if out is not None:  # after every row: a run cut short keeps what it measured
                (out / "sweep.json").write_text(json.dumps(rows, indent=1))
        del model
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        x = [r["batch"] for r in mine]
        a.plot(x, [r["wall_ratio"] for r in mine], "o-", label=name)
        b.plot(x, [r["sync"]["device_busy"] for r in mine], "o--", label=f"{name} sync")
        b.plot(x, [r["async"]["device_busy"] for r in mine], "o-", label=f"{name} async")
    a.axhline(1.0, color="gray", lw=0.8)
    a.set(xscale="log", xlabel="batch size", ylabel="wall time async / sync", title="where async helps")
    b.set(xscale="log", xlabel="batch size", ylabel="device busy", ylim=(0, 1.05), title="device busy")
    a.legend(fontsize=7), b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep(a.models.split(","), [int(b) for b in a.batches.split(",")], a.device, a.prompt_len,
                 a.max_new_tokens, out)
    plot(rows, out / "sweep.png")
    print(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")


if __name__ == "__main__":
    main()
