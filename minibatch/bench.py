"""Measurements: one workload, each mode, in one process; a table and JSON (notebook 07).

Every number is a ratio measured side by side in the same run, never compared across runs or
machines. For each mode we report wall time, generated tokens per second, the device-busy fraction
from the recorded timeline, and the mean time per step.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
import transformers

from .engine import generate
from .model import Model
from .timeline import Timeline


@dataclass
class Result:
    mode: str
    wall_s: float
    new_tokens: int
    tokens_per_s: float
    device_busy: float
    ms_per_step: float
    steps: int


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def run_mode(model: Model, prompts, mode: str, max_new_tokens: int, **kw) -> tuple[Result, Timeline, list]:
    tl = Timeline()
    t0 = time.perf_counter()
    outs = generate(model, prompts, max_new_tokens=max_new_tokens, mode=mode, timeline=tl, **kw)
    wall = time.perf_counter() - t0
    steps = len({s.step for s in tl.spans if s.step >= 0})
    n = sum(len(o) for o in outs)
    return Result(mode, wall, n, n / wall, tl.device_busy(), 1e3 * wall / max(steps, 1), steps), tl, outs


def environment(model: Model) -> dict:
    dev = str(model.device)
    if model.device.type == "cuda":
        dev = torch.cuda.get_device_name(model.device)
    return {"device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "model": model.name, "dtype": str(model.dtype),
            "command": " ".join(["python -m minibatch", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d")}


def format_table(results: list[Result]) -> str:
    base = results[0].wall_s
    rows = [f"{'mode':<8}{'wall s':>9}{'tok/s':>10}{'busy':>7}{'ms/step':>9}{'steps':>7}{'wall ratio':>12}"]
    for r in results:
        rows.append(f"{r.mode:<8}{r.wall_s:>9.2f}{r.tokens_per_s:>10.1f}{r.device_busy:>7.0%}"
                    f"{r.ms_per_step:>9.2f}{r.steps:>7}{r.wall_s / base:>12.2f}")
    return "\n".join(rows)


def save_json(path, model: Model, results: list[Result], workload: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(model), "workload": workload,
                   "results": [asdict(r) for r in results]}, f, indent=2)
