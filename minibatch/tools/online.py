"""Requests arriving as a Poisson process at a serving engine: time to first token and inter-token
latency, sync against async (notebook 08; `scripts/online_bench.py` runs it on a GPU).

    arrivals   ▼    ▼ ▼         ▼      ▼  ▼        (exponential gaps, mean 1/rate; rate inf: all at once)
    request    ├─TTFT─┤ tok ├ITL┤ tok ├ITL┤ tok … (time to first token, gaps between tokens)

Everything is measured from the streams' own timestamps (serving/stream.py): TTFT from submit to the
first token, ITL between consecutive tokens, end-to-end from submit to the last. Throughput counts
generated tokens over the span from the first submit to the last token. What the overlap trades:
every gap between tokens loses the host's share of a step (ITL down), while a request that arrives
now waits for the step in flight before it can join (TTFT may grow by up to a step).
"""

from __future__ import annotations

import math
import random
import time

from ..serving import bench_serve
from ..serving.bench_report import percentile


def arrival_times(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each of n requests arrives: bench-serve's schedule (gamma gaps of
    mean 1/rate, burstiness 1 a Poisson process; rate inf: all at 0), drawn from `seed`."""
    return bench_serve.arrival_times(n, rate, burstiness, random.Random(seed))


def run_arrivals(server, prompts: list, rate: float, max_new_tokens: int, seed: int = 0,
                 progress=None) -> list:
    """Submit prompts to a serving engine (a serving.service.Serving) at Poisson arrival times (from a thread of their own, as
    clients would); wait for every stream; return the streams in submission order."""
    times = arrival_times(len(prompts), rate, seed)
    streams: list = []
    start = time.perf_counter()
    for prompt, at in zip(prompts, times):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        streams.append(server.submit(prompt, max_new_tokens=max_new_tokens))
    for s in streams:
        s.wait()
        if progress is not None:
            progress.update(1)
    return streams


def summarize(streams: list) -> dict:
    """TTFT, ITL and end-to-end latency (mean, p50, p90, p99, in ms) and throughput of finished streams."""
    ttft = [s.ttft for s in streams]
    itl = [g for s in streams for g in s.itl]
    e2e = [s.token_times[-1] - s.arrival for s in streams]
    span = max(s.token_times[-1] for s in streams) - min(s.arrival for s in streams)
    tokens = sum(len(s.token_ids) for s in streams)
    out = {"requests": len(streams), "tokens": tokens, "wall_s": span,
           "tok_per_s": tokens / span if span > 0 else float("nan")}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_mean_ms"] = 1e3 * sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q)
    return out


def compare(model, prompts: list, rates: list[float], max_new_tokens: int, modes=("sync", "async"),
            progress: bool = False, **serving) -> list[dict]:
    """For each mode and rate, one serving run of `prompts` at that rate (arrival times of seed 0):
    a row of `summarize` each. A warm-up pass (all at once) first fills the caches and captures the
    CUDA graphs of each mode. `serving`: Serving's options (max_batch_size=..., compile=...)."""
    from ..core.engine import Engine
    from ..serving.service import Serving

    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(modes) * len(rates) * len(prompts), desc="online", unit="req")
    with Engine(model) as engine:
        for mode in modes:
            with Serving(engine, mode, **serving) as server:
                run_arrivals(server, prompts, math.inf, max_new_tokens)
                for rate in rates:
                    streams = run_arrivals(server, prompts, rate, max_new_tokens, progress=bar)
                    rows.append({"mode": mode, "rate": rate, **summarize(streams)})
    if bar is not None:
        bar.close()
    return rows
