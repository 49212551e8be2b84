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

One exception to that order: a step that is not a CUDA graph, on a GPU (a prefill or mixed step of a
server, which graphs decode steps only), or one whose graph is still to capture. The host launches its
kernels one by one, which takes about as long as the GPU takes to run them (a capture, longer), so
launching it first would hold batch N's tokens, long computed, until the launch is over: every
stream's next token, and a new request's first, would wait one whole extra step. Before such a step
the host waits for batch N and updates first (steps 3, then 2); the GPU idles only for the update,
and the carry-over works as before (the batch was planned with placeholders). `StepRunner.launch_bound`
says which steps those are. A run with one slot keeps the plain order always: it exists to show
notebook 04's race, which updating first would hide.

Being one step behind has two consequences, both handled here and in the scheduler:
  * a request that hits EOS in batch N may already sit in batch N+1: `Scheduler.update` drops that
    extra token, so its output stops exactly where the sync loop's does;
  * its KV blocks are freed at the update of batch N, while batch N+1 (in flight) still writes its
    extra token into them. That is harmless: the compute stream runs batch N+1 before any later batch
    can hand those blocks to a new request, and a new owner only reads slots it has written itself.
"""

from __future__ import annotations

from .carry_over import carry_over_mask
from .launch import launch_step


def async_step(run) -> list:
    """One turn of the loop: plan and launch batch N+1, then wait for batch N and update with it.

    `run` (engine.Run) holds the scheduler, streams, slots and runner, and the batch in flight.
    Returns the requests that finished with batch N.
    """
    scheduler, timeline, in_flight = run.scheduler, run.timeline, run.in_flight
    launched, done = None, []
    if scheduler.has_unplanned_work():
        step = scheduler.step
        slot = run.slots[run.launched % len(run.slots)]  # two slots alternate (one: the race of notebook 04)
        with timeline.span("CPU", "prepare", step, slot.index):
            plan = scheduler.schedule()
            if plan.chunks:
                prev_plan = in_flight[0] if in_flight else None
                batch = run.runner.build(plan)
                slot.load(batch, carry_over_mask(prev_plan, plan))
        if plan.chunks:
            prev_slot = in_flight[1] if in_flight else None
            update_first = (in_flight is not None and len(run.slots) > 1  # (one slot: notebook 04's race)
                            and run.runner.launch_bound(batch, slot.key(prev_slot)))
            if update_first:
                done, in_flight = _update(run, in_flight), None  # batch N first (the module says why)
            launch_step(run.runner, run.streams, slot, prev_slot, step, run.delays)
            launched = (plan, slot)
            run.launched += 1
    if run.in_flight is None and launched is None:
        raise RuntimeError("the scheduler planned an empty step while nothing is in flight: "
                           "no request can be admitted (is the KV cache too small?)")
    if in_flight is not None:
        done = _update(run, in_flight)
    run.in_flight = launched
    return done


def _update(run, in_flight) -> list:
    """Wait for batch N (the loop's one wait on the device) and update its requests with its tokens."""
    plan_n, slot_n = in_flight
    with run.timeline.span("CPU", "wait", plan_n.step, slot_n.index):
        slot_n.d2h_done.synchronize(run.timeout)
    with run.timeline.span("CPU", "update", plan_n.step, slot_n.index):
        rows = len(plan_n.sampling_chunks)
        done = run.scheduler.update(plan_n, slot_n.sampled(rows), slot_n.logprobs(rows))
    run.stepped(plan_n, done)
    return done
