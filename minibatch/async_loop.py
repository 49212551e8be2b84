"""The asynchronous loop: the host prepares batch N+1 while the device runs batch N (notebook 06).

    CPU      prep 0 │ prep 1 (slot B) │ wait 0 │ upd 0 │ prep 2 (slot A) │ wait 1 │ upd 1 │ prep 3 …
    H2D      █A                █B                              █A
    compute    ███ batch 0 (A) ███ ███ batch 1 (B) ███ ███ batch 2 (A) ███ ███ …
    D2H                           █A                  █B                   █A

Step 0 starts like the sync loop, in slot A. From then on, each iteration

  1. plans batch N+1 with the host's view of the requests, which is one step behind: tokens that
     batch N is sampling are not known yet, so they go in as placeholders, with a carry-over mask
     (carry_over.py) that tells the device where batch N's outputs go;
  2. writes it into the *other* slot and launches its H2D, compute (carry-over + forward + sample)
     and D2H; the compute stream runs it right after batch N, with no host round trip in between;
  3. only then waits for batch N's d2h_done and updates the requests with its tokens.

Being one step behind has two consequences, both handled here and in the scheduler:
  * a request that hits EOS in batch N may already sit in batch N+1: `Scheduler.update` drops that
    extra token, so its output stops exactly where the sync loop's does;
  * its KV blocks are freed at the update of batch N, while batch N+1 (in flight) still writes its
    extra token into them. That is harmless: the compute stream runs batch N+1 before any later batch
    can hand those blocks to a new request, and a new owner only reads slots it has written itself.
"""

from __future__ import annotations

from .carry_over import carry_over_mask
from .slots import IOSlot, launch_step


def run_async(runner, scheduler, timeline, dev, streams, slots: list[IOSlot], on_step=None,
              timeout: float | None = None, delays: dict | None = None) -> None:
    """Run until every request has finished, overlapping host work with device work."""
    in_flight = None  # (plan, slot) of the batch the device is running
    n_launched = 0
    while scheduler.has_work():
        launched = None
        if scheduler.has_unplanned_work():
            step = scheduler.step
            slot = slots[n_launched % len(slots)]  # two slots alternate (one: the race of notebook 04)
            with timeline.span("CPU", "prepare", step, slot.index):
                plan = scheduler.schedule()
                if plan.chunks:
                    prev_plan = in_flight[0] if in_flight else None
                    slot.load(runner.build(plan), carry_over_mask(prev_plan, plan))
            if plan.chunks:
                launch_step(runner, streams, slot, in_flight[1] if in_flight else None, step, delays)
                launched = (plan, slot)
                n_launched += 1
        if in_flight is None and launched is None:
            raise RuntimeError("the scheduler planned an empty step while nothing is in flight: "
                               "no request can be admitted (is the KV cache too small?)")
        if in_flight is not None:
            plan_n, slot_n = in_flight
            with timeline.span("CPU", "wait", plan_n.step, slot_n.index):
                slot_n.d2h_done.synchronize(timeout)
            with timeline.span("CPU", "update", plan_n.step, slot_n.index):
                done = scheduler.update(plan_n, slot_n.sampled(len(plan_n.sampling_chunks)))
            if on_step is not None:
                on_step(plan_n, done)
        in_flight = launched
    dev.synchronize(timeout)
