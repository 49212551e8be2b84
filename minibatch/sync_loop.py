"""The synchronous continuous-batching loop: the CPU and the device take turns (notebook 01).

    CPU      ██prepare██                                     ██update██ ██prepare██
    H2D                 █                                               █
    compute              ███████ forward + sample ███████                ████ …
    D2H                                                  █
                        ◀──────── CPU waits ────────────▶ ◀─device idle─▶

Each step: the scheduler plans the batch and the host builds its tensors (prepare), they go to the
device (H2D), the model runs and samples (compute), the new tokens come back (D2H), and the
scheduler hands them to their requests (update). While one side works the other waits; the
asynchronous loop (notebook 06) removes most of that waiting.

Spans are timed on the host clock; on a GPU the loop synchronizes after each stage so that every
span covers its stage's device work (it waits for the device at each stage anyway, being synchronous).
"""

from __future__ import annotations

import torch

from .batch import build_batch
from .kv_cache import PagedKVCache
from .model import Model
from .scheduler import Scheduler
from .timeline import Timeline


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_sync(model: Model, scheduler: Scheduler, cache: PagedKVCache, timeline: Timeline,
             on_step=None) -> None:
    """Run until every request has finished. `on_step(plan, newly_finished)` is called after each step."""
    dev = model.device
    while scheduler.has_work():
        step = scheduler.step
        with timeline.span("CPU", "prepare", step):
            plan = scheduler.schedule()
            if not plan.chunks:
                raise RuntimeError("the scheduler planned an empty step while requests are waiting: "
                                   "no request can be admitted (is the KV cache too small?)")
            host = build_batch(plan, cache, model.kv_bucket)
        with timeline.span("H2D", "H2D", step):
            batch = host.to(dev)
            _sync(dev)
        with timeline.span("compute", "compute", step):
            tokens = model.step(batch, cache)
            _sync(dev)
        with timeline.span("D2H", "D2H", step):
            sampled = tokens.cpu().tolist()
        with timeline.span("CPU", "update", step):
            done = scheduler.update(plan, sampled)
        if on_step is not None:
            on_step(plan, done)
