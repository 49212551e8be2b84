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

The loop runs on the device layer (notebooks 02-03): the three device stages are launched on three
streams chained by events, and the host waits for the last event before it updates. It uses one IO
slot; `async_loop.py` shares all of this and differs only in the loop itself.
"""

from __future__ import annotations

from .slots import IOSlot, launch_step


def run_sync(runner, scheduler, timeline, dev, streams, slots: list[IOSlot], on_step=None,
             timeout: float | None = None, delays: dict | None = None) -> None:
    """Run until every request has finished. `on_step(plan, newly_finished)` is called after each step."""
    slot = slots[0]
    while scheduler.has_work():
        step = scheduler.step
        with timeline.span("CPU", "prepare", step, slot.index):
            plan = scheduler.schedule()
            if not plan.chunks:
                raise RuntimeError("the scheduler planned an empty step while requests are waiting: "
                                   "no request can be admitted (is the KV cache too small?)")
            slot.load(runner.build(plan), [])
        launch_step(runner, streams, slot, None, step, delays)
        with timeline.span("CPU", "wait", step, slot.index):
            slot.d2h_done.synchronize(timeout)
        with timeline.span("CPU", "update", step, slot.index):
            done = scheduler.update(plan, slot.sampled(len(plan.sampling_chunks)))
        if on_step is not None:
            on_step(plan, done)
    dev.synchronize(timeout)
