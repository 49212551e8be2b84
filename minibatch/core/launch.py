"""One step on the device: its launch on three streams, and its compute work (notebooks 03-06).

    host     load slot ─ launch H2D, compute, D2H ─ (free: prepare the next batch) ─ wait d2h_done
    H2D      ██ copy the slot's used prefixes ██ ●h2d_done
    compute                                      ╎ carry-over + forward + sample ●compute_done
    D2H                                                                          ╎ copy ids ●d2h_done

`launch_step` enqueues the three stages, chained by the slot's events, and returns at once. Its
compute stage calls a runner (graphs.StepRunner) on the step's bound arguments; the runner calls
`forward_step` eagerly or replays a CUDA graph of it. Both loops (core/sync_loop.py and
core/async_loop.py) launch every step through here.
"""

from __future__ import annotations

from .carry_over import apply_carry_over
from .sampling import logprobs
from .slots import IOSlot, StepArgs, bound_args, copy_in, copy_out


def forward_step(model, cache, args: StepArgs, compiled=None) -> None:
    """Device work of one step: patch in carried-over tokens, forward, sample into the slot's output.

    Fixed buffers in, fixed buffers out, no host sync: the same call can be captured as a CUDA graph.
    """
    # (a compiled step may bring the carry-over as one kernel of its own: speed/compiled.py, same ids)
    carry_over = getattr(compiled, "carry_over", None) or apply_carry_over
    carry_over(args.patched_ids, args.input_ids, args.source, args.carry)
    batch = args.batch
    if batch.logprobs:  # the logits are needed beside the tokens (sampling.logprobs)
        tokens = logprobs(model.logits, batch, cache, args.lp_values, args.lp_ids)
    elif compiled is not None and batch.decode_rows and not (batch.bans or batch.penalized):
        tokens = compiled(batch, cache)
    else:
        tokens = model.next_tokens(batch, cache)
    args.out[: tokens.shape[0]].copy_(tokens)


def launch_step(runner, streams, slot: IOSlot, prev: IOSlot | None, step: int,
                delays: dict[str, float] | None = None) -> None:
    """Enqueue one step's H2D, compute and D2H on three streams, chained by the slot's events.

    `runner(args)` is the compute work: `forward_step` eagerly, or a CUDA graph replay of it.
    Returns at once; the host learns the step is done from `slot.d2h_done`. Every argument is bound
    now, as a kernel's are. `delays` ({"H2D": s, "compute": s, "D2H": s}) makes a stream sleep
    before that stage's work: injected delays that make race conditions happen every time (notebook 04).
    """
    h2d, compute, d2h = streams
    delays = delays or {}
    tag = dict(step=step, slot=slot.index)
    for stream, stage in ((h2d, "H2D"), (compute, "compute"), (d2h, "D2H")):
        if delays.get(stage):
            stream.sleep(delays[stage], lane=stage, **tag)
    # the work gets the slot's buffers and the sizes used now (bound at launch); the views are cut
    # where it runs (slots.SlotBuffers says why)
    used, layout = slot.used(), tuple(slot.layout.items())
    h2d.launch(copy_in, slot.buffers, used, name="H2D", lane="H2D", **tag)
    h2d.record(slot.h2d_done)
    compute.wait(slot.h2d_done)  # inputs must have landed
    compute.launch(run_bound, runner, slot.buffers, prev and prev.buffers, used, layout,
                   name="compute", lane="compute", **tag)
    compute.record(slot.compute_done)
    d2h.wait(slot.compute_done)  # outputs must exist
    rows = slot.sizes["logits_indices"]
    scored = rows + slot.sizes["score_indices"] if slot.layout["logprobs"] else 0
    d2h.launch(copy_out, slot.buffers, rows, scored, name="D2H", lane="D2H", **tag)
    d2h.record(slot.d2h_done)


def run_bound(runner, buffers, prev, used: tuple, layout: tuple) -> None:
    """The compute work of launch_step: `runner` on the step's arguments (slots.bound_args)."""
    runner(bound_args(buffers, prev, used, layout))
