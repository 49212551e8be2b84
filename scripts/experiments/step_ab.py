"""Where does a graphed decode step's time go, and which change moves it? (H200, 8B shape, batch 32)

    python3 scripts/experiments/step_ab.py OUTDIR            # on a GPU machine; writes OUTDIR/step_ab.txt
    python3 scripts/experiments/step_ab.py OUTDIR --compile  # only: the same step through torch.compile (OUTDIR/compile.txt)

Each variant's decode step is captured in a CUDA graph and timed over 20 replays (CUDA events), so
launch overhead is out and what is left is the kernels and the gaps between them. Variants:
  decode attention  "einsum" (gathered keys, float32 scores in memory) vs "sdpa" (one fused kernel)
                    vs "triton" (triton_decode.py: reads the cache in place, no gathered copy)
  sampling          the full sampler (sort over the vocabulary) vs the all-greedy argmax fast path
  decode bucket     keys per row padded to a multiple of 256 / 128 / 64
Also: the weight-streaming floor at the same batch, kernels per step and their summed time inside a
graph replay (sum < step time means gaps between kernels), and the eager kernel table.
"""
import os
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import minibatch  # noqa: E402
from minibatch.tools import floors  # noqa: E402
from minibatch.core.batch import build_batch  # noqa: E402
from minibatch.core.buckets import ROW_BUCKETS  # noqa: E402
from minibatch.core.requests import Request, SamplingParams  # noqa: E402
from minibatch.core.scheduler import Scheduler  # noqa: E402

OUT = Path(next((a for a in sys.argv[1:] if not a.startswith("--")), "."))
OUT.mkdir(parents=True, exist_ok=True)
B = 32
lines: list[str] = []


def say(s: str) -> None:
    print(s, flush=True)
    lines.append(s)
    (OUT / ("compile.txt" if "--compile" in sys.argv else "step_ab.txt")).write_text("\n".join(lines) + "\n")


def decode_setup(model, ctx: int):
    """A cache holding B requests of `ctx` tokens each, and the plan of the next (decode) step."""
    new = 64
    cache = model.make_cache(B * (-(-(ctx + new) // 16) + 1) + 8, 16)  # admission reserves ctx + new per request
    sched = Scheduler(cache.allocator, B * ctx, B)
    for i in range(B):
        sched.add(Request(i, [1 + i] * ctx, SamplingParams(max_new_tokens=new)))
    plan = sched.schedule()  # prefill of all B prompts in one step
    assert len(plan.chunks) == B and all(c.num_tokens == ctx for c in plan.chunks), "prefill did not fit"
    model.next_tokens(build_batch(plan, cache, model.kv_bucket).to("cuda"), cache)
    sched.update(plan, [2] * B)
    return cache, sched.schedule()


def graph_ms(fn, n: int = 20) -> float:
    fn(); fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    fn.graph = g
    return start.elapsed_time(end) / n


def eager_ms(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def kernel_stats(run, reps: int = 3):
    """(kernels per call, summed kernel ms per call) of `run`, from torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(ks) / reps, sum(e.time_range.end - e.time_range.start for e in ks) / reps / 1e3, prof


def main() -> None:
    model = minibatch.load_model(os.environ.get("MODEL", "llama3-8b-shape"), device="cuda")
    say(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
        f"{torch.cuda.get_device_name()}, model {model.name} {model.dtype}, batch {B}")
    if "--compile" in sys.argv:
        return compiled(model)
    say(f"weight floor at batch {B}: {floors.weight_floor_ms(model, B):.2f} ms")
    results = {}
    for ctx in (383, 1023):
        cache, plan = decode_setup(model, ctx)
        variants = [("einsum", False, 256), ("einsum", True, 256), ("sdpa", True, 256), ("triton", True, 256)]
        if ctx == 383:
            variants += [("sdpa", False, 256), ("sdpa", True, 128), ("sdpa", True, 64), ("triton", True, 64)]
        for attn, greedy_fast, bucket in variants:
            batch = build_batch(plan, cache, model.kv_bucket, True, ROW_BUCKETS, bucket).to("cuda")
            batch.all_greedy = greedy_fast
            model.decode_attention = attn

            def fn(batch=batch, cache=cache):
                return model.next_tokens(batch, cache)

            ms = graph_ms(fn)
            n, ksum, _ = kernel_stats(fn.graph.replay)
            L = batch.kv_indices.shape[0] // batch.decode_rows
            results[(ctx, attn, greedy_fast, bucket)] = ms
            say(f"ctx {ctx:4d} L {L:4d} attn {attn:6s} greedy-fast {greedy_fast!s:5s} bucket {bucket:3d}: "
                f"graph {ms:6.2f} ms/step, {n:5.0f} kernels, kernel sum {ksum:6.2f} ms "
                f"(gaps {ms - ksum:5.2f} ms)")
            del fn.graph
        if ctx == 383:  # eager timing and the kernel table of the new default
            batch = build_batch(plan, cache, model.kv_bucket, True, ROW_BUCKETS, 256).to("cuda")
            batch.all_greedy, model.decode_attention = True, "sdpa"
            say(f"eager step (sdpa, greedy fast): {eager_ms(lambda: model.next_tokens(batch, cache)):.2f} ms wall")
            _, _, prof = kernel_stats(lambda: model.next_tokens(batch, cache), reps=2)
            say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
        del cache
        torch.cuda.empty_cache()


def compiled(model) -> None:
    """The sdpa + greedy decode step through torch.compile (step.CompiledStep, as generate(compile=True))."""
    import torch._dynamo

    cache, plan = decode_setup(model, 383)
    batch = build_batch(plan, cache, model.kv_bucket, True, ROW_BUCKETS, 256).to("cuda")
    batch.all_greedy = True
    model.decode_attention = "sdpa"

    from minibatch.speed.compiled import CompiledStep

    compiled_step = CompiledStep(model)
    t = time.perf_counter()
    with torch.inference_mode():
        ref = model.next_tokens(batch, cache)
        got = compiled_step(batch, cache)
        torch.cuda.synchronize()
        say(f"compile: first call {time.perf_counter() - t:.1f} s; same tokens as eager: "
            f"{torch.equal(ref, got)} ({(ref == got).float().mean().item():.0%})")
        counters = torch._dynamo.utils.counters
        say(f"  graph breaks: {sum(counters['graph_break'].values())} {dict(counters['graph_break'])}"[:600])
        fn = lambda: compiled_step(batch, cache)  # noqa: E731
        ms = graph_ms(fn)
        n, ksum, _ = kernel_stats(fn.graph.replay)
        say(f"compiled step in a CUDA graph: {ms:.2f} ms/step, {n:.0f} kernels, kernel sum {ksum:.2f} ms")


if __name__ == "__main__":
    main()
