"""One layer's attention in a mixed step (prefill chunks beside decode rows), two ways, side by side.

    python3 scripts/experiments/mixed_attention_ab.py OUT_DIR        # a CUDA GPU, bf16

"dense": what a flat batch runs today (model/attention.py): every query against the whole key list of
the step, with a [T, K] mask that keeps it to its own request; its cost grows with T x K, so a prefill
chunk beside many long decode rows pays for all their keys. "varlen": FlashAttention's
variable-length kernel over the same packed queries and keys, each chunk against its own keys only
(cumulative offsets per chunk, causal from the bottom right: a chunk's queries are its keys' last
ones). Cost: the sum of each chunk's queries x its own keys. Shapes of Llama 3 8B (32 heads, 8 KV
heads, head dim 128). For each workload: the median of 20 timed calls each (CUDA events, the two
alternating), their ratio, and the largest difference of the outputs (they must agree to bf16
rounding). Writes mixed_attention_ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

HEADS, KV_HEADS, DIM = 32, 8, 128
# (name, prefill chunks as (new tokens, tokens before them), decode rows, context of each decode row)
WORKLOADS = [
    ("256-token prompt + 32 decode rows of 400", [(256, 0)], 32, 400),
    ("256-token prompt + 64 decode rows of 512", [(256, 0)], 64, 512),
    ("2048-token budget: 8 prompts of 256 + 0 rows", [(256, 0)] * 8, 0, 0),
    ("1024 tokens of prompts + 56 decode rows of 384", [(256, 0)] * 4, 56, 384),
    ("a 512-token chunk after 1536 + 16 decode rows of 300", [(512, 1536)], 16, 300),
]


def chunks_of(prefill, rows, context):
    """(query count, key count) per chunk: prefill chunks first, then one-token decode rows."""
    return [(new, before + new) for new, before in prefill] + [(1, context)] * rows


def dense(q, k, v, chunks):
    qs = torch.repeat_interleave(torch.arange(len(chunks), device=q.device), torch.tensor([c[0] for c in chunks], device=q.device))
    ks = torch.repeat_interleave(torch.arange(len(chunks), device=q.device), torch.tensor([c[1] for c in chunks], device=q.device))
    qpos = torch.cat([torch.arange(e - n, e, device=q.device) for n, e in chunks])
    kpos = torch.cat([torch.arange(e, device=q.device) for _, e in chunks])
    mask = (qs[:, None] == ks[None, :]) & (kpos[None, :] <= qpos[:, None])

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask[None, None],
            enable_gqa=True)
        return out[0].transpose(0, 1)
    return run


def varlen(q, k, v, chunks):
    cu_q = torch.tensor([0] + [c[0] for c in chunks], device=q.device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [c[1] for c in chunks], device=q.device).cumsum(0).to(torch.int32)
    max_q, max_k = q.shape[0], k.shape[0]  # upper bounds from the shapes (what a CUDA graph could fix)

    def run():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)[0]
    return run


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("torch", torch.__version__, torch.cuda.get_device_name())
    import inspect
    import torch.nn.attention as attn
    vl = getattr(attn, "varlen", None)
    print("torch.nn.attention.varlen:", None if vl is None else inspect.signature(vl.varlen_attn))
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, prefill, rows, context in WORKLOADS:
        chunks = chunks_of(prefill, rows, context)
        t, kk = sum(c[0] for c in chunks), sum(c[1] for c in chunks)
        q = torch.randn(t, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(kk, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(kk, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        a, b = dense(q, k, v, chunks), varlen(q, k, v, chunks)
        diff = (a().float() - b().float()).abs().max().item()
        for _ in range(3):
            a(), b()
        ta, tb = [], []
        for _ in range(20):
            ta.append(timed(a)), tb.append(timed(b))
        row = {"workload": name, "T": t, "K": kk, "dense_ms": statistics.median(ta), "varlen_ms": statistics.median(tb),
               "max_abs_diff": diff}
        row["ratio"] = row["varlen_ms"] / row["dense_ms"]
        results.append(row)
        print(f"{name:55} T={t:5} K={kk:6}  dense {row['dense_ms']:7.3f} ms  varlen {row['varlen_ms']:7.3f} ms  "
              f"x{row['ratio']:.3f}  max |diff| {diff:.4f}", flush=True)
    (args.out / "mixed_attention_ab.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
