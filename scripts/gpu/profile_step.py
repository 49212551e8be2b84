"""Profile one decode step of the 8B-shaped model on the GPU: where do the milliseconds go?

python3 scripts/gpu/profile_step.py  (on the GPU machine; prints tables, writes $OUT/profile.txt)
"""
import os
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import minibatch
from minibatch.batch import build_batch
from minibatch.requests import Request
from minibatch.scheduler import Scheduler

out = os.environ.get("OUT", ".")
model = minibatch.load_model(os.environ.get("MODEL", "llama3-8b-shape"), device="cuda")
B, CTX = 32, 512
cache = model.make_cache(B * (CTX + 32) // 16 + 8, 16)
sched = Scheduler(cache.allocator, B * CTX, B)
for i in range(B):
    sched.add(Request(i, [1] * CTX, 16))
plan = sched.schedule()  # prefill everything in one step
model.step(build_batch(plan, cache).to("cuda"), cache)
sched.update(plan, [2] * B)
plan = sched.schedule()  # a decode step: 32 tokens, ~16k keys
batch = build_batch(plan, cache).to("cuda")


def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


lines = [f"decode step B={B} ctx={CTX}: default {timed(lambda: model.step(batch, cache)):.2f} ms"]
for name, backends in [("efficient+math", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                       ("math", [SDPBackend.MATH]), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                       ("efficient", [SDPBackend.EFFICIENT_ATTENTION])]:
    try:
        with sdpa_kernel(backends):
            lines.append(f"  sdpa {name}: {timed(lambda: model.step(batch, cache)):.2f} ms")
    except Exception as e:  # noqa: BLE001
        lines.append(f"  sdpa {name}: failed {type(e).__name__}: {str(e)[:200]}")
# forward of all linear layers alone (the weight-streaming part), eager
x = torch.randn(1, B, model.hf.config.hidden_size, device="cuda", dtype=model.dtype)
lin = [m for m in model.hf.modules() if isinstance(m, torch.nn.Linear)]
lines.append(f"  all Linear layers eager at batch {B}: {timed(lambda: [l(x if l.in_features == x.shape[-1] else torch.randn(1, B, l.in_features, device='cuda', dtype=model.dtype)) for l in lin]):.2f} ms (incl. randn for odd inputs)")
print("\n".join(lines))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        model.step(batch, cache)
    torch.cuda.synchronize()
t1 = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
t2 = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
print(t1)
with open(f"{out}/profile.txt", "w") as f:
    f.write("\n".join(lines) + "\n\n" + t1 + "\n\n" + t2)
