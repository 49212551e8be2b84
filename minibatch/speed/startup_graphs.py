"""CUDA graphs captured before the first request: no capture on a request's path (notebook 08).

A run captures a step's CUDA graph the first time its shape comes up (core/graphs.py). For an
offline run that is fine; for a server it is not: a capture holds the loop for about two eager
launches of the step (the warm-up run, then the recording), and every stream in the batch waits for
it. Those captures are a serving run's longest steps, and so the tail of its inter-token latency
(BENCHMARKS.md, "Serving latency: how the 8B server got here").

`capture_startup_graphs(engine, context)` captures, up front, the graphs a server meets with
requests of up to `context` tokens (prompt and output together), for each pairing of slots the loop
launches (sync: one slot; async: A after B, and B after A, and for flat steps either slot after none,
as an idle loop launches a new request's prefill), greedy and sampled (top-k and top-p off: the
default of every OpenAI client):

  decode steps   every row bucket the run's slots hold (ROW_BUCKETS) times every key width up to
                 `context` (multiples of the model's decode key bucket); each a step whose rows are
                 all padding, as the scheduler pads a real batch's rows: one token at position 0
                 that writes and reads only the KV cache's scratch cell;
  flat steps     (prefill chunks, alone or beside decode rows) only where the run graphs them
                 (cuda_graphs=True; a server's default graphs decode steps only, and runs the others
                 eagerly): every (tokens, keys) bucket pair a step within the token budget and
                 `context` can take. An eager flat step of a large model is bound by the host
                 launching its kernels one by one (~40 ms for the 8B shape whatever its token count,
                 BENCHMARKS.md), which makes it the step a new request waits for and the next tail of
                 inter-token latency. The fine buckets an offline run pads to (core/buckets.py) would
                 be well over a thousand captures, so the run's flat steps are padded to the coarser
                 FLAT_TOKEN_BUCKETS x FLAT_KEY_BUCKETS from then on. Each capture is a batch of
                 padding tokens in empty chunks, reading padding keys: the scratch cell again.

A capture goes through the path a real step takes (slot.load, launch_step, StepRunner), which is
what makes its graph the one a real step of that shape replays; it writes nothing a request will
read. The cost is start-up time, one capture per shape, most of them never used by a given
workload: `context` chooses how far to go. Steps with a top-k or top-p filter, logprobs, bans
(min_tokens) or penalties are still captured (or run eagerly) as they come.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..core.batch import Batch
from ..core.buckets import KEY_BUCKETS, ROW_BUCKETS, bucket
from ..core.launch import launch_step
from ..core.penalties import history

_EMPTY = torch.zeros(0, dtype=torch.int64)


def _full(n: int, value, dtype=torch.int64) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)

# half-octave tokens (a flat step of a few hundred tokens is bound by reading the weights, so padding
# it costs little; above, at most 1.5x the tokens), octave keys (the extra keys of the flat layout are
# gathered, not attended to: the varlen kernel reads each chunk's own); the largest as KEY_BUCKETS'
FLAT_TOKEN_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
FLAT_KEY_BUCKETS = (*(1024 << i for i in range(6)), KEY_BUCKETS[-1])  # 1024 ... 32768, 49152


def padding_decode_batch(rows: int, width: int, scratch: int, greedy: bool) -> Batch:
    """A decode-layout batch of `rows` padding rows and a key table `width` wide: every row one token
    at position 0 in the scratch cell, reading only that cell (the rest of its row: padding, kv_seq -1)."""
    kv_seq = np.full((rows, width), -1, np.int64)
    kv_seq[:, 0] = np.arange(rows)
    return Batch(
        input_ids=_full(rows, 0), positions=_full(rows, 0), q_seq=torch.arange(rows), cell_mapping=_full(rows, scratch),
        kv_indices=_full(rows * width, scratch), kv_seq=torch.from_numpy(kv_seq.reshape(-1)),
        kv_pos=_full(rows * width, 0), logits_indices=torch.arange(rows), chunk_starts=_EMPTY, key_starts=_EMPTY,
        temperature=_full(rows, 0.0 if greedy else 1.0, torch.float32), top_k=_full(rows, 0),
        top_p=_full(rows, 1.0, torch.float32), seed=_full(rows, 0), counter=_full(rows, 0),
        score_indices=_EMPTY, score_targets=_EMPTY, banned=_EMPTY,
        **history([], [], rows),  # no row penalized: history_*, penalties and the flag as build_batch sets them
        decode_rows=rows, all_greedy=greedy, unfiltered=True,
    )


def decode_shapes(run, context: int) -> list[tuple[int, int]]:
    """(rows, width) of every decode step of requests up to `context` tokens that the run's slots hold."""
    shape, bucket = run.config.shape, run.runner.model.decode_kv_bucket
    widths = range(bucket, -(-context // bucket) * bucket + 1, bucket)
    return [(r, w) for r in ROW_BUCKETS if r <= shape.rows for w in widths if r * w <= shape.max_keys]


def padding_flat_batch(tokens: int, keys: int, rows: int, scratch: int, greedy: bool) -> Batch:
    """A flat batch as graphs.pad_flat leaves one, `tokens` tokens, `keys` keys and `rows` sampled rows,
    all of them padding: every chunk empty, every token at position 0 writing the scratch cell, every
    key that cell, every row sampling the last token."""
    return Batch(
        input_ids=_full(tokens, 0), positions=_full(tokens, 0), q_seq=_full(tokens, -1),
        cell_mapping=_full(tokens, scratch),
        kv_indices=_full(keys, scratch), kv_seq=_full(keys, -1), kv_pos=_full(keys, 0),
        logits_indices=_full(rows, tokens - 1), chunk_starts=_full(rows + 1, 0), key_starts=_full(rows + 1, 0),
        temperature=_full(rows, 0.0 if greedy else 1.0, torch.float32), top_k=_full(rows, 0),
        top_p=_full(rows, 1.0, torch.float32), seed=_full(rows, 0), counter=_full(rows, 0),
        score_indices=_EMPTY, score_targets=_EMPTY, banned=_EMPTY,
        **history([], [], rows), all_greedy=greedy, unfiltered=True, padded=True,
    )


def flat_buckets(max_tokens: int, max_keys: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FLAT_TOKEN_BUCKETS and FLAT_KEY_BUCKETS cut to what an IO slot holds, the slot's capacity the last
    bucket where the sets go past it (so that every flat step the slot holds has a bucket)."""
    def cut(sizes, most):
        most = min(most, sizes[-1])
        return (*(b for b in sizes if b < most), most)

    return cut(FLAT_TOKEN_BUCKETS, max_tokens), cut(FLAT_KEY_BUCKETS, max_keys)


def flat_shapes(run, context: int) -> list[tuple[int, int]]:
    """(tokens, keys) of every padded flat step of requests up to `context` tokens within the run's token
    budget, on the runner's flat buckets. A step's keys include its own tokens' (k >= t), so a token
    bucket pairs only with key buckets that can hold more keys than the bucket below it held tokens."""
    runner = run.runner
    rows = runner.capacity[2]
    token_sizes, key_sizes = runner.flat_buckets
    most_tokens = bucket(run.config.max_batch_tokens, token_sizes)
    # at most a chunk per row, each reading at most `context` keys, plus the key list's padding (batch.py)
    most_keys = min(bucket(rows * context + runner.model.kv_bucket + 1, key_sizes), max(key_sizes))
    tokens = [b for b in token_sizes if b <= most_tokens]
    shapes = []
    for below, t in zip([0, *tokens], tokens):
        shapes += [(t, k) for k in key_sizes if below + 2 <= k <= most_keys]
    return shapes


def check_capture(device, cuda_graphs, compile, name: str = "capture_up_to") -> None:
    """Refuse start-up captures a run cannot make: they need a CUDA device, CUDA graphs on (cuda_graphs
    None, "decode" or True) and no torch.compile (compiled decode steps compile per shape as they come).
    `name`: the option as the caller spells it (Serving's keyword, serve's flag)."""
    from ..core.device import platform

    if not platform(device).graphs or cuda_graphs is False or compile:
        raise ValueError(f"{name} captures CUDA graphs: it needs a CUDA device, CUDA graphs on and no compile "
                         f"(here: device {device}, cuda_graphs={cuda_graphs!r}, compile={compile!r})")


def capture_startup_graphs(engine, context: int, progress=None) -> int:
    """Capture the graphs of requests up to `context` tokens for the engine's open run, before any
    request comes (module doc): decode steps', and flat steps' where the run graphs them. Returns how
    many it captured; `progress(done, total)` is called after each shape. Needs a run on a CUDA device
    with CUDA graphs on, and nothing running."""
    run = engine.run
    if run is None:
        raise RuntimeError("capture_startup_graphs needs an open run (engine.open_run, or inside Serving)")
    runner = run.runner
    if not (runner.use_graphs and runner.decode_layout):
        raise ValueError("capturing graphs at start-up needs CUDA graphs on a CUDA device "
                         f"(this run: cuda_graphs={run.config.shape.cuda_graphs!r}, device {runner.model.device})")
    if runner.compiled is not None:
        raise ValueError("capturing graphs at start-up is not for compiled decode steps (compile=True): "
                         "they compile per shape as they come")
    if run.in_flight is not None or run.scheduler.has_work():
        raise RuntimeError("capture_startup_graphs runs before the first request, with nothing in flight")
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    slots = run.slots
    # the (slot, previous slot) pairs the loop launches: sync one slot after none; async each slot after
    # the other (one slot: after itself, the race notebook 04 shows)
    pairs = [(slots[0], None)] if run.mode == "sync" else [(a, b) for a in slots for b in slots
                                                           if a is not b or len(slots) == 1]
    scratch = runner.cache.scratch_cell
    work = [(p, functools.partial(padding_decode_batch, r, w, scratch), g)
            for p in pairs for r, w in decode_shapes(run, context) for g in (True, False)]
    if runner.capacity is not None:  # flat steps are graphs in this run (padded: core/graphs.py)
        runner.flat_buckets = flat_buckets(*runner.capacity[:2])
        # an idle async loop launches its next step, a new request's prefill, after none (either slot)
        after_none = [(s, None) for s in slots] if run.mode == "async" else []
        work += [(p, functools.partial(padding_flat_batch, t, k, runner.capacity[2], scratch), g)
                 for p in pairs + after_none for t, k in flat_shapes(run, context) for g in (True, False)]
    done = 0
    engine.dev.set_timeline(None)  # the captures are not the run's steps: kept off its timeline
    try:
        for i, ((slot, prev), make, greedy) in enumerate(work):
            slot.load(make(greedy), [])
            if slot.key(prev) not in runner.graphs:
                launch_step(runner, run.streams, slot, prev, -1)
                slot.d2h_done.synchronize(run.timeout)
                done += 1
            if progress is not None:
                progress(i + 1, len(work))
    finally:
        engine.dev.set_timeline(run.timeline)
    return done

