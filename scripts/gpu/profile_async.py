"""Profile the async loop with CUDA graphs on the GPU: kernel breakdown of a decode step, and does our
device-busy fraction agree with torch.profiler's kernel timeline? (BENCHMARKS.md; the recorded output
is figures/data/gpu_profile_async_8b.txt.)

    KINETO_LOG_LEVEL=5 python3 scripts/gpu/profile_async.py OUTDIR   # on a GPU machine; writes OUTDIR/profile_async.txt
"""
import os
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import minibatch  # noqa: E402
from minibatch.tools import bench  # noqa: E402
from minibatch.core.timeline import DEVICE_LANES, Timeline, union_length as union  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
model = minibatch.load_model(os.environ.get("MODEL", "llama3-8b-shape"), device="cuda")
prompts = bench.random_prompts(32, 256, model.vocab_size)
kw = dict(max_new_tokens=64, mode="async", max_batch_size=32, max_batch_tokens=2048)
engine = minibatch.Engine(model)  # keeps the CUDA graphs of the warm-up for the profiled run
engine.generate(prompts, **kw)  # warm-up: graph captures
tl = Timeline()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    engine.generate(prompts, timeline=tl, **kw)
    torch.cuda.synchronize()


kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
k_busy = union(kernels) / (max(b for _, b in kernels) - min(a for a, _ in kernels))
dev = [(s.start, s.end) for s in tl.spans if s.lane in DEVICE_LANES]
t_busy = union(dev) / (max(b for _, b in dev) - min(a for a, _ in dev))
steps = len({s.step for s in tl.spans if s.lane == "compute"})
window = max(b for _, b in kernels) - min(a for a, _ in kernels)
bridged = ", ".join(f"{union(kernels, g) / window:.1%} (gaps < {g:g} us bridged)" for g in (5, 20, 100, 1000))
lines = [
    f"device busy over the device window: timeline {t_busy:.1%}, torch.profiler kernels {k_busy:.1%}",
    f"profiler kernels with short gaps counted as busy: {bridged}",
    f"timeline device_busy() over the whole run: {tl.device_busy():.1%}",
    f"kernels recorded: {len(kernels)} over {steps} steps ({len(kernels) / steps:.0f} per step)",
    prof.key_averages().table(sort_by="cuda_time_total", row_limit=30),
]
print("\n".join(lines[:4]))
(out / "profile_async.txt").write_text("\n".join(lines))
