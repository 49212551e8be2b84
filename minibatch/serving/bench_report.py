"""What `bench-serve` reports, from each request's timings: vLLM's `bench serve` metrics.

    TTFT  time to first token: from sending the request to its first streamed token
    TPOT  time per output token after the first: (e2e - TTFT) / (output tokens - 1), one value a request
    ITL   inter-token latency: every gap between two streamed chunks, of every request
    e2e   end-to-end latency: from sending the request to its last chunk

Each at mean, p50, p90 and p99 (milliseconds); request and output-token throughput over the wall time of
the rate's run; goodput: requests per second that met every latency target of the SLO (e.g. TTFT at
most 500 ms and TPOT at most 50 ms). Runs go to one JSON file, merged by label (a server or a mode), so
several servers share one file and one figure: TTFT and ITL (p50 solid, p99 dashed) against the rate.
Notebook 08 reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RequestResult:
    """One request as the client saw it (seconds, from the moment it was sent)."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _stats(values_s: list[float]) -> dict:
    ms = [x * 1000 for x in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def parse_slo(arg: str) -> dict[str, float]:
    """"ttft=500,tpot=50" -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); keys: ttft, tpot, itl, e2e."""
    slo = {}
    for part in filter(None, arg.split(",")):
        key, _, value = part.partition("=")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if key not in ("ttft", "tpot", "itl", "e2e") or not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"--slo takes ttft=MS,tpot=MS (also itl, e2e; positive milliseconds), got {arg!r}")
        slo[key] = ms
    return slo


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    got = {"ttft": r.ttft, "tpot": tpot, "itl": max(r.itl, default=0.0), "e2e": r.e2e}
    return all(got[k] * 1000 <= ms for k, ms in slo.items())


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict:
    """One rate's numbers (latencies in ms, throughputs per second of wall time)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
        "mean_output_tokens": out_tokens / max(len(ok), 1),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "goodput": sum(_meets(r, slo) for r in ok) / duration if slo else None,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_row(rate: float, s: dict) -> str:
    g = "" if s["goodput"] is None else f"  goodput {s['goodput']:.2f} req/s"
    return (f"rate {rate_key(rate):>5}: {s['completed']} ok, {s['failed']} failed  "
            f"TTFT p50/p99 {s['ttft_ms']['p50']:.1f}/{s['ttft_ms']['p99']:.1f} ms  "
            f"TPOT p50 {s['tpot_ms']['p50']:.2f} ms  ITL p50/p99 {s['itl_ms']['p50']:.2f}/{s['itl_ms']['p99']:.2f} ms  "
            f"e2e p50 {s['e2e_ms']['p50']:.0f} ms  {s['request_throughput']:.2f} req/s  "
            f"{s['output_throughput']:.1f} tok/s{g}"
            + (f"  client CPU {s['client_cpu']:.0%}" if "client_cpu" in s else ""))


def save(out: Path, label: str, run: dict) -> dict:
    """Merge one label's run into out/bench_serve.json (rates measured again replace the old ones)."""
    path = out / "bench_serve.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    old = data["runs"].get(label, {})
    run = {**old, **run, "rates": {**old.get("rates", {}), **run["rates"]}}
    data["runs"][label] = run
    path.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n")
    return data


def plot(out: Path, data: dict) -> Path:
    """out/bench_serve.png: TTFT and ITL (p50 solid, p99 dashed) against the rate, one colour per label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for run in data["runs"].values() for k in run["rates"]}, key=lambda k: float(k))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (label, run) in enumerate(data["runs"].items()):
        mine = [k for k in keys if k in run["rates"]]
        x = [keys.index(k) for k in mine]
        for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
            for q, style in (("p50", "-"), ("p99", "--")):
                ax.plot(x, [run["rates"][k][metric][q] for k in mine], style, marker="o", color=f"C{i}",
                        label=f"{label} {q}")
    for ax, title in zip(axes, ("time to first token", "inter-token latency")):
        ax.set_xticks(range(len(keys)), keys)
        ax.set_xlabel("request rate (req/s; inf: all at once)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = out / "bench_serve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
