"""Requests arriving as a Poisson process at a serving engine, sync against async: TTFT, ITL, throughput.

    python scripts/online_bench.py OUT_DIR [--model tiny] [--rates 2,8,inf] [--num-prompts 32]
        [--prompt-len 64] [--max-new-tokens 32] [--max-batch-size 8] [--device auto] [--compile]

Writes OUT_DIR/online_bench.json (one row per mode and rate, minibatch.tools.online.summarize) and
prints a table with the async/sync ratios side by side. Prompts are random token ids of
--prompt-len tokens (no EOS: every request makes --max-new-tokens tokens). Also checks that every
request gave the tokens the same prompt gives alone in the same mode's offline run, where the
comparison is exact (float32); in bf16 it reports the count (a matrix product's rounding may depend
on the batch's shape, so near-tied logits can flip).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

import minibatch  # noqa: E402
from minibatch.tools.online import compare  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rates", default="2,8,inf")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [math.inf if r == "inf" else float(r) for r in a.rates.split(",")]
    model = minibatch.load_model(a.model, device=a.device, dtype=a.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.vocab_size - 3) for _ in range(a.prompt_len)] for _ in range(a.num_prompts)]
    t0 = time.perf_counter()
    extra = {"compile": True} if a.compile else {}
    rows = compare(model, prompts, rates, a.max_new_tokens, max_batch_size=a.max_batch_size,
                   max_batch_tokens=max(256, a.max_batch_size), progress=True, **extra)
    meta = {"command": "python scripts/online_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "model": a.model, "device": str(model.device),
            "gpu": torch.cuda.get_device_name() if model.device.type == "cuda" else platform.processor(),
            "dtype": str(model.dtype), "torch": torch.__version__, "transformers": transformers.__version__,
            "prompt_len": a.prompt_len, "max_new_tokens": a.max_new_tokens, "num_prompts": a.num_prompts,
            "max_batch_size": a.max_batch_size, "compile": a.compile, "seconds": time.perf_counter() - t0}
    (out / "online_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{'rate':>6} {'mode':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>8}")
    for r in rows:
        print(f"{r['rate']:>6} {r['mode']:>5} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
              f"{r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} {r['tok_per_s']:8.0f}")
    for rate in rates:
        s, q = ({r["mode"]: r for r in rows if r["rate"] == rate}.get(m) for m in ("sync", "async"))
        if s and q:
            print(f"rate {rate}: async/sync  TTFT p50 {q['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}  "
                  f"ITL p50 {q['itl_p50_ms'] / s['itl_p50_ms']:.2f}  tok/s {q['tok_per_s'] / s['tok_per_s']:.2f}")


if __name__ == "__main__":
    main()
