"""The hardware's floor under a step: how fast it could be, measured on this machine (notebook 07).

A decode step must at least read every weight once and every row's keys and values; a prefill must at
least do its matrix products' FLOPs. This module measures the rates that bound them (the copy
bandwidth, the bf16 matmul rate), turns a model and a batch into floors in milliseconds, and times
pieces of a step the way they run inside it (the Linear layers alone, a CUDA graph's replays).
`python -m minibatch bench --floor` prints the floors beside the measured steps; scripts/gpu/ uses
the rest.
"""

from __future__ import annotations

import time

import torch

from .bench import Result, _median  # (one median for every reported time)
from ..model.model import Model


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
        if model.device.type == "cuda":
            return graph_replay_ms(all_layers, repeats)
        all_layers()
        t0 = time.perf_counter()
        for _ in range(repeats):
            all_layers()
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


def pool_memory(model, rows: int = 32, context: int = 512, shared: bool = True) -> list[int]:
    """Bytes the GPU's reserved memory grew by while capturing slot A's decode graph, then slot B's.

    shared=True captures both into one pool (what the loops do); shared=False gives each graph its
    own pool. The article's claim: with one pool, the second graph costs about nothing.
    """
    from ..core.requests import Request, SamplingParams
    from ..core.scheduler import Scheduler
    from ..core.slots import IOSlot, copy_in
    from ..devices import get_device
    from ..core.graphs import StepRunner

    block = 16
    cache = model.make_cache(rows * (context // block + 2), block)
    sched = Scheduler(cache.allocator, rows * (context + 1), rows)
    for i in range(rows):
        sched.add(Request(i, [1] * context, SamplingParams(max_new_tokens=4)))
    prefill = sched.schedule()
    runner = StepRunner(model, cache, use_graphs=True)
    with get_device(str(model.device)) as dev:
        width = -(-(context + 2) // model.kv_bucket) * model.kv_bucket
        slots = [IOSlot(dev, i, rows * (context + 1), max(cache.num_cells + model.kv_bucket, rows * width), rows)
                 for i in range(2)]
        slots[0].load(runner.build(prefill), [])
        copy_in(slots[0].buffers, slots[0].used())
        runner(slots[0].bind(None))  # prefill, eager
        sched.update(prefill, [2] * rows)
        decode = sched.schedule()
        if not shared:
            runner.pool = None  # torch then gives each capture a pool of its own
        for slot, other in ((slots[0], slots[1]), (slots[1], slots[0])):
            slot.load(runner.build(decode), [])
            copy_in(slot.buffers, slot.used())
            runner(slot.bind(other))  # eager run + capture
        dev.synchronize()
    return [c["reserved_growth"] for c in runner.captures]
