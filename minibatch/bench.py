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

from .engine import Engine, generate
from .model import Model
from .timeline import Timeline


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


def run_mode(model: Model | Engine, prompts, mode: str, max_new_tokens: int, **kw) -> tuple[Result, Timeline, list]:
    """One timed run of `prompts` in `mode` ("sync", "async", each optionally "+compile"). Pass an Engine
    to keep its resources (and CUDA graphs) from one run to the next."""
    tl = Timeline()
    decode_steps: set[int] = set()  # steps in which every chunk is one decode token

    def on_step(plan, done):
        if all(c.num_tokens == 1 and c.start >= len(c.request.prompt) for c in plan.chunks):
            decode_steps.add(plan.step)

    base = mode.removesuffix("+compile")
    t0 = time.perf_counter()
    outs = generate(model, prompts, max_new_tokens=max_new_tokens, mode=base, timeline=tl, on_step=on_step,
                    compile=base != mode, **kw)
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

    from .attention import ATTN_NAME

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
        proc = subprocess.run([sys.executable, "-m", "minibatch.bench", str(spec), str(out)], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"transformers run in its own process failed (exit {proc.returncode}): {tail}")
        got = json.loads(out.read_text())
    return Result(**got["result"]), got["tokens"]


def _hf_child(spec_path: str, out_path: str) -> None:
    from .model import load_model

    spec = json.loads(Path(spec_path).read_text())
    model = load_model(spec["model"], device=spec["device"])
    if spec["warmup"]:  # untimed, like ours: its first launches and captures
        hf_generate_batch(model, spec["prompts"], spec["max_new_tokens"], **spec["config"])
    result, tokens = hf_generate_batch(model, spec["prompts"], spec["max_new_tokens"], **spec["config"])
    Path(out_path).write_text(json.dumps({"result": asdict(result), "tokens": tokens}))


def weight_floor_ms(model: Model, batch: int, repeats: int = 20) -> float:
    """Milliseconds to push `batch` rows through every Linear layer once: a decode step's lower bound.

    On a GPU all the matmuls are captured in one CUDA graph, so launch overhead does not count; what
    is left is reading every weight once from memory.
    """
    linears = [m for m in model.hf.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {n: torch.randn(batch, n, device=model.device, dtype=model.dtype)
              for n in {m.in_features for m in linears}}

    def all_layers():
        for m in linears:
            m(inputs[m.in_features])

    with torch.inference_mode():
        all_layers()
        run = all_layers
        if model.device.type == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                all_layers()
            run = graph.replay
            run()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


# --- the full floor: every byte a decode step must read, every FLOP a prefill must do ----------------

def _time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() after one warm-up call (CUDA events on a GPU, the host clock elsewhere)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return _median(times)


def replay_ms(replay, replays: int = 20) -> float:
    """Mean milliseconds of replay() (a CUDA graph's replay) over `replays` calls between two CUDA
    events, after three untimed calls. For the GPU scripts (scripts/gpu)."""
    for _ in range(3):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def graph_replay_ms(fn, replays: int = 20) -> float:
    """Mean milliseconds of fn() captured as one CUDA graph (after a warm-up call): what a piece of a
    step costs with no launch overhead, as it runs inside a step's graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph.replay, replays)


def measure_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 20) -> float:
    """Memory bandwidth in bytes/s: a large device-to-device copy, bytes read + written over its time.

    The copy is what a decode step mostly is (stream weights and keys once), so it is the rate a
    decode step can hope for. Default size: 1 GiB on a GPU (far past its caches), 64 MiB elsewhere.
    """
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / (ms / 1e3)


def measure_matmul_rate(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, n: int | None = None,
                        repeats: int = 10) -> float:
    """Matmul throughput in FLOP/s: one large square matmul (2 n^3 FLOPs) in `dtype`."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    with torch.inference_mode():
        ms = _time_ms(lambda: a @ b, device, repeats)
    return 2 * n**3 / (ms / 1e3)


def weight_bytes(model: Model) -> int:
    """Bytes of the weights a decode step reads: every parameter except the input embedding table,
    of which a step reads only its own rows (unless it is tied to the output layer, which reads it all)."""
    hf = model.hf
    embed = hf.get_input_embeddings().weight
    out = hf.get_output_embeddings()
    tied = out is not None and out.weight is embed
    return sum(p.numel() * p.element_size() for p in hf.parameters() if p is not embed or tied)


def kv_bytes_per_token(model: Model) -> int:
    """Bytes of keys and values one token of context holds (all layers)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * torch.finfo(model.dtype).bits // 8


def decode_floor_ms(model: Model, batch: int, context: float, bandwidth: float) -> float:
    """Milliseconds a decode step of `batch` rows at mean `context` tokens needs just to read its bytes:
    the weights once, plus each row's keys and values, at `bandwidth` bytes/s (measure_bandwidth)."""
    return (weight_bytes(model) + batch * context * kv_bytes_per_token(model)) / bandwidth * 1e3


def prefill_floor_ms(model: Model, tokens: int, rate: float) -> float:
    """Milliseconds to push `tokens` prompt tokens through the weights: 2 x weights x tokens FLOPs at
    `rate` FLOP/s (measure_matmul_rate). Attention's own FLOPs are left out: small for short prompts."""
    params = weight_bytes(model) // (torch.finfo(model.dtype).bits // 8)
    return 2 * params * tokens / rate * 1e3


def floor_report(model: Model, workload: dict, results: list[Result]) -> list[str]:
    """The floors of the bench's workload, added to `workload`; returns the lines to print.

    Decode: at the workload's batch and the mean context of its decode steps (prompt + half the
    new tokens). Prefill: all prompt tokens of one batch.
    """
    batch = min(workload["max_batch_size"], workload["num_prompts"])
    context = workload["prompt_len"] + workload["max_new_tokens"] / 2
    bandwidth = measure_bandwidth(model.device)
    rate = measure_matmul_rate(model.device, model.dtype)
    decode = decode_floor_ms(model, batch, context, bandwidth)
    weights = decode_floor_ms(model, 0, 0, bandwidth)
    prefill = prefill_floor_ms(model, batch * workload["prompt_len"], rate)
    workload.update(memory_bandwidth_gbs=bandwidth / 1e9, matmul_tflops=rate / 1e12, floor_batch=batch,
                    floor_context=context, decode_floor_ms=decode, decode_weight_bytes_ms=weights,
                    prefill_floor_ms=prefill,
                    decode_step_over_floor={r.mode: r.decode_compute_ms / decode for r in results
                                            if r.decode_compute_ms == r.decode_compute_ms})
    lines = [f"memory bandwidth {bandwidth / 1e9:.3g} GB/s (copy), {model.dtype} matmul {rate / 1e12:.3g} TFLOP/s",
             f"decode floor at batch {batch}, context {context:.0f}: {decode:.2f} ms per step "
             f"(weights {weights:.2f} ms + keys/values {decode - weights:.2f} ms)",
             f"prefill floor for {batch} x {workload['prompt_len']} prompt tokens: {prefill:.2f} ms"]
    lines += [f"{m}: decode step / floor {x:.2f}x" for m, x in workload["decode_step_over_floor"].items()]
    return lines


if __name__ == "__main__":  # the child process of hf_in_own_process
    _hf_child(sys.argv[1], sys.argv[2])
