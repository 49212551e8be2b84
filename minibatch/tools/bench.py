"""Measurements: one workload, each mode, in one process; a table and JSON (notebook 07).

Every number is a ratio measured side by side in the same run, never compared across runs or
machines. For each mode we report wall time, generated tokens per second, the device-busy fraction
from the recorded timeline, the mean time per step, and for decode-only steps the median compute
span (what a step costs the device) and the median period from one step to the next (what it costs
in wall time: compute plus any device idle gap).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from ..core.engine import Engine, generate
from ..model.model import Model
from ..core.timeline import Timeline


@dataclass
class Result:
    mode: str
    wall_s: float
    new_tokens: int
    tokens_per_s: float
    device_busy: float
    ms_per_step: float  # wall time / steps, prefill steps included
    steps: int
    decode_compute_ms: float = float("nan")  # median compute span of decode-only steps (device clock)
    decode_period_ms: float = float("nan")  # median time from one decode step's compute start to the next
    other_compute_ms: float = float("nan")  # mean compute span of the other steps (prefill and mixed)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


#: a mode's suffix -> generate's `compile`: once per decode shape, or once for every row count
COMPILE_SUFFIXES = {"+compile": True, "+dynamic": "dynamic"}


def split_mode(mode: str) -> tuple[str, bool | str]:
    """"async+dynamic" -> ("async", "dynamic"); "sync" -> ("sync", False)."""
    for suffix, compile in COMPILE_SUFFIXES.items():
        if mode.endswith(suffix):
            return mode.removesuffix(suffix), compile
    return mode, False


def run_mode(model: Model | Engine, prompts, mode: str, max_new_tokens: int, **kw) -> tuple[Result, Timeline, list]:
    """One timed run of `prompts` in `mode` ("sync", "async", each optionally "+compile" or "+dynamic":
    `split_mode`). Pass an Engine to keep its resources (and CUDA graphs) from one run to the next."""
    tl = Timeline()
    decode_steps: set[int] = set()  # steps in which every chunk is one decode token

    def on_step(plan, done):
        if all(c.num_tokens == 1 and c.start >= len(c.request.prompt) for c in plan.chunks):
            decode_steps.add(plan.step)

    base, compile = split_mode(mode)
    t0 = time.perf_counter()
    outs = generate(model, prompts, max_new_tokens=max_new_tokens, mode=base, timeline=tl, on_step=on_step,
                    compile=compile, **kw)
    wall = time.perf_counter() - t0
    steps = len({s.step for s in tl.spans if s.step >= 0})
    n = sum(len(o) for o in outs)
    compute = sorted((s.start, s.end) for s in tl.spans if s.name == "compute" and s.step in decode_steps)
    spans = [1e3 * (b - a) for a, b in compute]
    periods = [1e3 * (b[0] - a[0]) for a, b in zip(compute, compute[1:])]
    other = [1e3 * s.duration for s in tl.spans if s.name == "compute" and 0 <= s.step not in decode_steps]
    return Result(mode, wall, n, n / wall, tl.device_busy(), 1e3 * wall / max(steps, 1), steps,
                  _median(spans), _median(periods), sum(other) / len(other) if other else float("nan")), tl, outs


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def environment(model: Model | Engine) -> dict:
    model = model.model if isinstance(model, Engine) else model
    dev = str(model.device)
    if model.device.type == "cuda":
        dev = torch.cuda.get_device_name(model.device)
    return {"device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "model": model.name, "dtype": str(model.dtype),
            "command": " ".join([_program(), *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d")}


def _program() -> str:
    """How this process was started: `python -m minibatch`, or the script that imported the bench."""
    first = sys.argv[0] if sys.argv else ""
    if not first or first.endswith("__main__.py") or first == "-m":
        return "python -m minibatch"
    return f"python {Path(first).as_posix()}"


def format_table(results: list[Result]) -> str:
    base = results[0].wall_s
    rows = [f"{'mode':<14}{'wall s':>9}{'tok/s':>10}{'busy':>7}{'ms/step':>9}{'steps':>7}{'decode ms':>11}"
            f"{'period ms':>11}{'wall ratio':>12}"]
    for r in results:
        rows.append(f"{r.mode:<14}{r.wall_s:>9.2f}{r.tokens_per_s:>10.1f}{r.device_busy:>7.0%}"
                    f"{r.ms_per_step:>9.2f}{r.steps:>7}{r.decode_compute_ms:>11.2f}{r.decode_period_ms:>11.2f}"
                    f"{r.wall_s / base:>12.2f}")
    return "\n".join(rows)


def summary(results: list[Result]) -> str:
    """One line: our fastest mode against transformers' fastest, when both ran."""
    ours = [r for r in results if not r.mode.startswith("hf")]
    theirs = [r for r in results if r.mode.startswith("hf")]
    if not ours or not theirs:
        return ""
    a, b = max(ours, key=lambda r: r.tokens_per_s), max(theirs, key=lambda r: r.tokens_per_s)
    return (f"fastest minibatch mode {a.mode} {a.tokens_per_s:.0f} tok/s vs fastest transformers mode {b.mode} "
            f"{b.tokens_per_s:.0f} tok/s: {a.tokens_per_s / b.tokens_per_s:.2f}x")


def save_json(path, model: Model, results: list[Result], workload: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(model), "workload": workload,
                   "results": [asdict(r) for r in results]}, f, indent=2)


def hf_generate_batch(model: Model, prompts, max_new_tokens: int, use_async: bool | None = None,
                      use_graphs: bool | None = None, memory: float | None = None) -> tuple[Result, list]:
    """The same workload through transformers' own continuous batching (`generate_batch`), in this process.

    use_async / use_graphs / memory map to its ContinuousBatchingConfig (None: its default). The
    model's attention implementation is switched to transformers' paged one for the call, then back.
    Its wall time includes its own warm-up (graph captures), as a user would see it. For a fair
    comparison run it where nothing else holds device memory: `hf_in_own_process`.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from ..model.attention import ATTN_NAME

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    model.hf.set_attn_implementation("sdpa" if (major, minor) >= (5, 23) else "paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    options = {k: v for k, v in dict(use_async_batching=use_async, use_cuda_graph=use_graphs,
                                     max_memory_percent=memory).items() if v is not None}
    if model.device.type == "cpu":  # it sizes its KV cache and masks from ~60% of the RAM otherwise (GBs)
        tokens = sum(len(p) + max_new_tokens for p in prompts)
        options.update(num_blocks=-(-tokens // 256) + len(prompts),  # its blocks hold 256 tokens
                       max_batch_tokens=min(512, max(64, sum(len(p) for p in prompts))))
    label = "hf" + ("" if use_async is None else "_async" if use_async else "_sync") + (
        "" if use_graphs is None else "_graphs" if use_graphs else "_eager")
    try:
        t0 = time.perf_counter()
        out = model.hf.generate_batch([list(p) for p in prompts], generation_config=cfg, progress_bar=False,
                                      continuous_batching_config=ContinuousBatchingConfig(**options))
        wall = time.perf_counter() - t0
    finally:
        model.hf.set_attn_implementation(ATTN_NAME)
    tokens = [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    n = sum(len(t) for t in tokens)
    return Result(label, wall, n, n / wall, float("nan"), float("nan"), 0), tokens


def hf_in_own_process(model_name: str, device: str, prompts, max_new_tokens: int, config: dict,
                      warmup: bool = False, timeout: float = 1800.0) -> tuple[Result, list]:
    """`hf_generate_batch` in a fresh Python process that loads `model_name` itself.

    Why a process of its own: transformers sizes its KV cache from the device memory it finds free, so
    run after our engine (whose cache and graphs still hold memory) it gets less of it and runs slower
    than it would alone. A fresh process gives it the whole device, as a user would run it. The model
    must be loadable by name (a built-in name with the same seed gives the same random weights).
    Raises RuntimeError with the child's last lines if it fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(dict(model=model_name, device=device, prompts=[list(p) for p in prompts],
                                        max_new_tokens=max_new_tokens, config=config, warmup=warmup)))
        proc = subprocess.run([sys.executable, "-m", "minibatch.tools.bench", str(spec), str(out)], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"transformers run in its own process failed (exit {proc.returncode}): {tail}")
        got = json.loads(out.read_text())
    return Result(**got["result"]), got["tokens"]


def _hf_child(spec_path: str, out_path: str) -> None:
    from ..model.model import load_model

    spec = json.loads(Path(spec_path).read_text())
    model = load_model(spec["model"], device=spec["device"])
    if spec["warmup"]:  # untimed, like ours: its first launches and captures
        hf_generate_batch(model, spec["prompts"], spec["max_new_tokens"], **spec["config"])
    result, tokens = hf_generate_batch(model, spec["prompts"], spec["max_new_tokens"], **spec["config"])
    Path(out_path).write_text(json.dumps({"result": asdict(result), "tokens": tokens}))


if __name__ == "__main__":  # the child process of hf_in_own_process
    _hf_child(sys.argv[1], sys.argv[2])


def alternating_pairs(engine, prompts, modes: list[str], pairs: int, max_new_tokens: int, **kw):
    """Run `modes` `pairs` times, in turn forwards and backwards, so that neither always goes first (the
    demo; notebook 06, section 5, does the same). Every run must give the same tokens. Returns the last
    pair's results, timelines and tokens, and each pair's wall-time ratio, last mode / first mode."""
    ratios, outs = [], None
    for i in range(pairs):
        order = modes if i % 2 == 0 else modes[::-1]
        runs = {mode: run_mode(engine, prompts, mode, max_new_tokens, **kw) for mode in order}
        for mode, (_, _, o) in runs.items():
            if outs is not None and o != outs:
                raise SystemExit(f"error: pair {i + 1}: mode {mode} gave different tokens than the first run")
            outs = o
        if len(modes) > 1:
            ratios.append(runs[modes[-1]][0].wall_s / runs[modes[0]][0].wall_s)
    return [runs[m][0] for m in modes], [runs[m][1] for m in modes], outs, ratios


def agreement_line(mode: str, ref: str, same: int, total: int, dtype: torch.dtype) -> str:
    """'mode: same/total requests with the same tokens as ref', and why, where a difference is expected.

    Our own modes must agree exactly (same kernels, same batches). transformers' generate_batch runs other
    kernels: in float32 its greedy tokens equal ours (tests/test_cli.py; HF generate: tests/test_parity.py), but in bf16/fp16 with random
    weights the logits are nearly flat, so near-ties round differently and flip a token, and every token
    after it differs."""
    line = f"{mode}: {same}/{total} requests with the same tokens as {ref}"
    if same == total:
        return line
    if mode.startswith("hf") and dtype != torch.float32:
        return (line + f" (expected in {str(dtype).removeprefix('torch.')}: transformers runs other kernels, and "
                "near-tied logits of random weights round to other tokens; in float32 the tokens agree)")
    return line + " (NOT expected: our modes must agree token for token)"
