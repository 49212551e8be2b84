"""Sweep model shape x batch x context, sync vs async side by side, against the full floor; JSON + figure.

    python scripts/sweep.py --device cuda --out $OUT     # qwen3-0.6b, llama3-1b, llama3-8b shapes x
                                                        # batch 1,8,32,128 x context 512,2048, 64 new tokens
    python scripts/sweep.py --device cpu --out out      # a dry run: tiny models, small sizes, < 1 minute

`--context C` sets each prompt to C - max_new_tokens / 2 tokens, so that the mean context of the
decode steps is C. Each model is loaded once; the copy bandwidth is measured once per model (it is
the device's); for each point both modes run the same prompts after an untimed warm-up of the same
workload (which also captures the CUDA graphs). Per point it prints the async/sync wall ratio, the
device-busy fraction of each mode, the median decode step (compute span, async), the full floor
(floors.decode_floor_ms: weights + every row's keys and values at the measured bandwidth), their
ratio, and whether async and sync gave the same tokens. Writes sweep.json after every point (a run
cut short keeps what it measured) and sweep.png at the end.

64 new tokens by default: 63 decode steps give a stable median step, while the prompts (up to
128 x 2016 tokens at the 8B shape) dominate the wall time at long contexts; twice the new tokens
would add about a third to the whole sweep's time for no better median.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minibatch  # noqa: E402
from minibatch.tools import bench
from minibatch.tools import floors  # noqa: E402

GPU = dict(models="qwen3-0.6b-shape,llama3-1b-shape,llama3-8b-shape", batches="1,8,32,128", contexts="512,2048",
           max_new_tokens=64)
CPU = dict(models="random-llama,random-qwen3", batches="1,8", contexts="24,48", max_new_tokens=8)


def sweep(models, batches, contexts, device, max_new_tokens, out: Path | None = None, max_batch_tokens=2048):
    rows = []
    print(f"{'model':18}{'batch':>6}{'ctx':>6}{'async/sync':>11}{'busy sync':>10}{'busy async':>11}"
          f"{'step ms':>9}{'floor ms':>9}{'step/floor':>11}  tokens", flush=True)
    for name in models:
        model = minibatch.load_model(name, device=device)
        # one engine per model, so the warm-up's CUDA graphs serve the timed run; it keeps two shapes
        # (this point's sync and async): the KV caches of the large points are tens of GB each
        engine = minibatch.Engine(model, keep=2)
        env = bench.environment(model)
        bandwidth = floors.measure_bandwidth(model.device)
        for b in batches:
            for ctx in contexts:
                prompt_len = max(1, ctx - max_new_tokens // 2)
                prompts = bench.random_prompts(b, prompt_len, model.vocab_size)
                kw = dict(max_batch_size=b, max_batch_tokens=max(b, max_batch_tokens), progress=False)
                res, outs = {}, {}
                for mode in ("sync", "async"):
                    bench.run_mode(engine, prompts, mode, max_new_tokens, **kw)  # warm-up (graph captures)
                    res[mode], _, outs[mode] = bench.run_mode(engine, prompts, mode, max_new_tokens, **kw)
                ratio = res["async"].wall_s / res["sync"].wall_s
                floor = floors.decode_floor_ms(model, b, ctx, bandwidth)
                step = res["async"].decode_compute_ms
                same = outs["sync"] == outs["async"]
                print(f"{name:18}{b:>6}{ctx:>6}{ratio:>11.2f}{res['sync'].device_busy:>10.1%}"
                      f"{res['async'].device_busy:>11.1%}{step:>9.2f}{floor:>9.2f}{step / floor:>11.2f}  "
                      f"{'async == sync' if same else 'DIFFER'}", flush=True)
                rows.append({"model": name, "batch": b, "context": ctx, "prompt_len": prompt_len,
                             "max_new_tokens": max_new_tokens, "environment": env,
                             **{mode: asdict(r) for mode, r in res.items()}, "wall_ratio": ratio,
                             "bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor,
                             "weight_floor_ms": floors.decode_floor_ms(model, 0, 0, bandwidth),
                             "step_over_floor": step / floor,
                             "sync_step_over_floor": res["sync"].decode_compute_ms / floor, "same_tokens": same})
                if out is not None:  # after every point: a run cut short keeps what it measured
                    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
        engine.close()
        del engine, model
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for (name, ctx) in dict.fromkeys((r["model"], r.get("context")) for r in rows):
        mine = [r for r in rows if r["model"] == name and r.get("context") == ctx]
        x = [r["batch"] for r in mine]
        label = f"{name}, ctx {ctx}"
        axes[0].plot(x, [r["wall_ratio"] for r in mine], "o-", label=label)
        axes[1].plot(x, [r["async"]["device_busy"] for r in mine], "o-", label=label)
        axes[2].plot(x, [r["step_over_floor"] for r in mine], "o-", label=label)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[2].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(xscale="log", xlabel="batch size", ylabel="wall time async / sync", title="where async helps")
    axes[1].set(xscale="log", xlabel="batch size", ylabel="device busy (async)", ylim=(0, 1.05),
                title="is the device kept busy?")
    axes[2].set(xscale="log", xlabel="batch size", ylabel="decode step / floor", ylim=(0, None),
                title="decode step against the full floor")
    for a in axes:
        a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cuda, cpu (a dry run with tiny models) or auto")
    p.add_argument("--models", help=f"comma-separated (default on a GPU: {GPU['models']}; on cpu: {CPU['models']})")
    p.add_argument("--batches", help=f"comma-separated (default {GPU['batches']}; cpu {CPU['batches']})")
    p.add_argument("--contexts", help=f"mean decode contexts, comma-separated (default {GPU['contexts']}; "
                                      f"cpu {CPU['contexts']})")
    p.add_argument("--max-new-tokens", type=int, help=f"default {GPU['max_new_tokens']} (cpu {CPU['max_new_tokens']})")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget per step (prefill chunks)")
    p.add_argument("--out", default="out")
    a = p.parse_args()
    import torch
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    defaults = CPU if device == "cpu" else GPU
    models = (a.models or defaults["models"]).split(",")
    batches = [int(x) for x in (a.batches or defaults["batches"]).split(",")]
    contexts = [int(x) for x in (a.contexts or defaults["contexts"]).split(",")]
    new = a.max_new_tokens or defaults["max_new_tokens"]
    if new < 2 or any(c <= new // 2 for c in contexts):
        p.error(f"--max-new-tokens must be >= 2 and every context > max_new_tokens / 2, got {new} and {contexts}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep(models, batches, contexts, device, new, out, a.max_batch_tokens)
    plot(rows, out / "sweep.png")
    print(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")


if __name__ == "__main__":
    main()
