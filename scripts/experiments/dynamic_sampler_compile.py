"""Does Inductor compile the sampler with a symbolic row count? One variant per process.

    python3 scripts/experiments/dynamic_sampler_compile.py OUT_DIR            # every variant below, on CUDA
    python3 scripts/experiments/dynamic_sampler_compile.py OUT_DIR --vocab 512 --variants base

The function compiled is what a decode step does after its last layer: a [rows, 4096] bf16 hidden state
times a [vocab, 4096] head, then `sampling.sample` with top-k and top-p (filtered: a sort, a softmax,
a cumulative sum over the vocabulary). torch.compile with static shapes except the row count, marked
dynamic on every input (what CompiledStep does with `dynamic_rows`); called for 2, 4, 16 and 3 rows,
each result compared with the eager sampler's. Variants: "base" (the sampler as it is), "scatter"
(the top-k/top-p mask scattered back to vocabulary order instead of the noise gathered into sorted
order), and "base" with one Inductor setting changed (the settings listed in VARIANTS). Each runs in
a process of its own, with a time limit, because a failed compile can leave torch in any state.
Prints one line per variant and writes OUT_DIR/dynamic_sampler_compile.txt.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "base": [], "scatter": [],
    "no-mix-order": ["triton.mix_order_reduction=False"],
    "no-split-reductions": ["split_reductions=False"],
    "one-tile": ["triton.max_tiles=1"],
    "no-coalesce-analysis": ["triton.coalesce_tiling_analysis=False"],
    "no-persistent": ["triton.persistent_reductions=False"],
}


def sample_scatter(logits, temperature, top_k, top_p, seed, counter):
    """sampling.sample with the filter mask scattered back to vocabulary order (same tokens, but for
    an exact float32 tie between two noisy scores)."""
    import torch

    from minibatch.core import sampling

    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    gumbel = -torch.log(-torch.log(sampling.uniform_noise(seed, counter, logits.shape[-1])))
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    dropped = torch.empty_like(drop).scatter_(-1, order, drop)
    sampled = (scaled + gumbel).masked_fill(dropped, float("-inf")).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def one(variant: str, vocab: int, device: str) -> str:
    """Compile and run one variant in this process; one line saying how far it got."""
    import torch
    import torch._dynamo
    import torch._inductor.config as inductor_config

    from minibatch.core import sampling

    for setting in VARIANTS[variant]:
        name, value = setting.split("=")
        *path, last = name.split(".")
        obj = inductor_config
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, ast.literal_eval(value))
    fn = sample_scatter if variant == "scatter" else sampling.sample
    head = torch.randn(vocab, 4096, device=device, dtype=torch.bfloat16) * 0.02

    def step(h, t, k, p, s, c):
        return fn(h @ head.T, t, k, p, s, c)

    compiled = torch.compile(step, dynamic=False)
    said = []
    for rows in (2, 4, 16, 3):
        g = torch.Generator(device=device).manual_seed(rows)
        h = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16, generator=g)
        args = (h, torch.ones(rows, device=device), torch.full((rows,), 8, device=device, dtype=torch.int64),
                torch.full((rows,), 0.9, device=device), torch.arange(rows, device=device, dtype=torch.int64),
                torch.zeros(rows, device=device, dtype=torch.int64))
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        try:
            out = compiled(*args)
        except Exception as e:  # noqa: BLE001 (the point is which error, if any)
            first = (str(e).splitlines() or [""])[0][:160]
            return f"{variant}: {rows} rows: compile FAILED: {type(e).__name__}: {first}"
        said.append(f"{rows} rows same tokens as eager: {torch.equal(out, sampling.sample(h @ head.T, *args[1:]))}")
    return f"{variant}: compiled; " + "; ".join(said)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default: Llama 3's)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per variant")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (the child process: run this variant)
    args = ap.parse_args()
    if args.one:
        print(one(args.one, args.vocab, args.device), flush=True)
        return
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    import torch

    lines = [f"torch {torch.__version__}, vocabulary {args.vocab}, {args.device}"]
    print(lines[0], flush=True)
    for name in names:
        cmd = [sys.executable, __file__, str(args.out), "--one", name, "--vocab", str(args.vocab), "--device",
               args.device]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            said = [ln for ln in done.stdout.splitlines() if ln.startswith(f"{name}:")]
            line = said[-1] if said else f"{name}: exit {done.returncode}: {done.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            line = f"{name}: no result in {args.timeout:.0f} s"
        print(line, flush=True)
        lines.append(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamic_sampler_compile.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
