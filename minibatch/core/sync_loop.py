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
slot. `sync_step` is one turn of the loop; the engine (engine.py) calls it until every request has
finished. `async_loop.py` shares all of this and differs only in the step itself.
"""

from __future__ import annotations

from .launch import launch_step


def sync_step(run) -> list:
    """One step: prepare, launch, wait, update. Returns the requests that finished in it.

    `run` (engine.Run) holds the scheduler, the device's streams, the IO slots and the step runner.
    """
    slot, scheduler, timeline = run.slots[0], run.scheduler, run.timeline
    step = scheduler.step
    with timeline.span("CPU", "prepare", step, slot.index):
        plan = scheduler.schedule()
        if not plan.chunks:
            raise RuntimeError("the scheduler planned an empty step while requests are waiting: "
                               "no request can be admitted (is the KV cache too small?)")
        slot.load(run.runner.build(plan), [])
    launch_step(run.runner, run.streams, slot, None, step, run.delays)
    with timeline.span("CPU", "wait", step, slot.index):
        slot.d2h_done.synchronize(run.timeout)  # the loop's one wait on the device
    with timeline.span("CPU", "update", step, slot.index):
        rows = len(plan.sampling_chunks)
        done = scheduler.update(plan, slot.sampled(rows), slot.logprobs(rows))
    run.stepped(plan, done)
    return done
