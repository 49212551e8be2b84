"""Decode graphs captured before the first request: no capture on a request's path (notebook 08).

A run captures a step's CUDA graph the first time its shape comes up (core/graphs.py). For an
offline run that is fine; for a server it is not: a capture holds the loop for about two eager
launches of the step (the warm-up run, then the recording), and every stream in the batch waits for
it. Those captures are a serving run's longest steps, and so the tail of its inter-token latency
(BENCHMARKS.md, "Serving latency after delivering tokens from the step").

`capture_decode_graphs(engine, context)` captures, up front, the decode graphs a server meets with
requests of up to `context` tokens (prompt and output together): every row bucket the run's slots
hold (ROW_BUCKETS) times every key width up to `context` (multiples of the model's decode key
bucket), greedy and sampled (top-k and top-p off: the default of every OpenAI client), for each
pairing of slots the loop launches (sync: one slot; async: A after B, and B after A). Each is a
decode step whose rows are all padding, as the scheduler pads a real batch's rows: one token at
position 0 that writes and reads only the KV cache's scratch cell. So the capture writes nothing a
request will read, and it goes through the same path a real step takes (slot.load, launch_step,
StepRunner), which is what makes its graph the one a real step of that shape replays.

The cost is start-up time, one capture per shape, most of them never used by a given workload:
`context` chooses how far to go. Steps with a top-k or top-p filter, logprobs, bans (min_tokens) or
penalties, and mixed steps, are still captured (or run eagerly) as they come.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.batch import Batch
from ..core.buckets import ROW_BUCKETS
from ..core.launch import launch_step
from ..core.penalties import history

_EMPTY = torch.zeros(0, dtype=torch.int64)


def padding_decode_batch(rows: int, width: int, scratch: int, greedy: bool) -> Batch:
    """A decode-layout batch of `rows` padding rows and a key table `width` wide: every row one token
    at position 0 in the scratch cell, reading only that cell (the rest of its row: padding, kv_seq -1)."""
    kv_seq = np.full((rows, width), -1, np.int64)
    kv_seq[:, 0] = np.arange(rows)
    t = torch.from_numpy
    return Batch(
        input_ids=torch.zeros(rows, dtype=torch.int64), positions=torch.zeros(rows, dtype=torch.int64),
        q_seq=torch.arange(rows), cell_mapping=torch.full((rows,), scratch, dtype=torch.int64),
        kv_indices=torch.full((rows * width,), scratch, dtype=torch.int64), kv_seq=t(kv_seq.reshape(-1)),
        kv_pos=torch.zeros(rows * width, dtype=torch.int64), logits_indices=torch.arange(rows),
        chunk_starts=_EMPTY, key_starts=_EMPTY,
        temperature=torch.full((rows,), 0.0 if greedy else 1.0), top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows), seed=torch.zeros(rows, dtype=torch.int64), counter=torch.zeros(rows, dtype=torch.int64),
        score_indices=_EMPTY, score_targets=_EMPTY, banned=_EMPTY,
        **history([], [], rows),  # no row penalized: history_*, penalties and the flag as build_batch sets them
        decode_rows=rows, all_greedy=greedy, unfiltered=True,
    )


def decode_shapes(run, context: int) -> list[tuple[int, int]]:
    """(rows, width) of every decode step of requests up to `context` tokens that the run's slots hold."""
    shape, bucket = run.config.shape, run.runner.model.decode_kv_bucket
    widths = range(bucket, -(-context // bucket) * bucket + 1, bucket)
    return [(r, w) for r in ROW_BUCKETS if r <= shape.rows for w in widths if r * w <= shape.max_keys]


def capture_decode_graphs(engine, context: int, progress=None) -> int:
    """Capture the decode graphs of requests up to `context` tokens for the engine's open run, before
    any request comes (module doc). Returns how many it captured; `progress(done, total)` is called
    after each shape. Needs a run on a CUDA device with CUDA graphs on for decode steps, and nothing
    running."""
    run = engine.run
    if run is None:
        raise RuntimeError("capture_decode_graphs needs an open run (engine.open_run, or inside Serving)")
    runner = run.runner
    if not (runner.use_graphs and runner.decode_layout):
        raise ValueError("capturing decode graphs at start-up needs CUDA graphs on a CUDA device "
                         f"(this run: cuda_graphs={run.config.shape.cuda_graphs!r}, device {runner.model.device})")
    if runner.compiled is not None:
        raise ValueError("capturing decode graphs at start-up is not for compiled decode steps (compile=True): "
                         "they compile per shape as they come")
    if run.in_flight is not None or run.scheduler.has_work():
        raise RuntimeError("capture_decode_graphs runs before the first request, with nothing in flight")
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    slots = run.slots
    # the (slot, previous slot) pairs the loop launches: sync one slot after none; async each slot after
    # the other (one slot: after itself, the race notebook 04 shows)
    pairs = [(slots[0], None)] if run.mode == "sync" else [(a, b) for a in slots for b in slots
                                                           if a is not b or len(slots) == 1]
    work = [(p, s, g) for p in pairs for s in decode_shapes(run, context) for g in (True, False)]
    scratch, done = runner.cache.scratch_cell, 0
    engine.dev.set_timeline(None)  # the captures are not the run's steps: kept off its timeline
    try:
        for i, ((slot, prev), (rows, width), greedy) in enumerate(work):
            slot.load(padding_decode_batch(rows, width, scratch, greedy), [])
            if slot.key(prev) not in runner.graphs:
                launch_step(runner, run.streams, slot, prev, -1)
                slot.d2h_done.synchronize(run.timeout)
                done += 1
            if progress is not None:
                progress(i + 1, len(work))
    finally:
        engine.dev.set_timeline(run.timeline)
    return done

