"""The compute stage of a step: `StepRunner` builds a step's host batch and runs its device work
eagerly (launch.forward_step) or as a CUDA graph replay (notebook 04).

CUDA graphs. An eager decode step launches hundreds of small kernels one by one from Python; on a
fast GPU the CPU needs longer to launch them than the GPU needs to run them. A CUDA graph records the
whole step once and replays it with one launch:

    eager    CPU  |l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|        (one launch per kernel)
             GPU    █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █      (waits for each launch)
    graph    CPU  |replay|
             GPU   ███████████████████████████                      (back to back)

A graph replays fixed kernels on fixed addresses with fixed shapes. Hence:
  * the step reads and writes only the slot's preallocated buffers (slots.py), so a graph belongs
    to one slot: two slots, two graphs per shape;
  * shapes come from buckets: decode steps are padded to a row count from ROW_BUCKETS and a key
    length that is a multiple of the model's decode_kv_bucket (kv_bucket for compiled steps, which
    compile once per shape; batch.py, decode layout); prefill and mixed steps are padded to a token
    count from TOKEN_BUCKETS, a key count from KEY_BUCKETS and the slot's rows (pad_flat, below), and
    the few that do not fit those (more keys than KEY_BUCKETS holds) stay eager (a server that
    captures its graphs at start-up pads to coarser sets: speed/startup_graphs.py);
  * the carry-over ops (carry_over.py) run inside the graph, before the forward pass.
All graphs share one memory pool: they never run at the same time (one compute stream), so the
memory one graph uses for its intermediate tensors can be reused by the next. Two slots' graphs
then cost about as much as one (the article's observation; measured in BENCHMARKS.md).

Graphs are captured lazily, the first time a (slot, shape) comes up: that step runs eagerly once
(warm-up), is captured, and is replayed for its real results and for every later step of that
shape. On the CPU there are no graphs: the runner calls the eager step, the same code path minus
the capture.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .batch import Batch, build_batch
from .buckets import KEY_BUCKETS, ROW_BUCKETS, TOKEN_BUCKETS, bucket
from .penalties import pad_rows
from .requests import MAX_BANNED
from .scheduler import BatchPlan
from .slots import StepArgs
from .device import platform, resident
from .launch import forward_step

if TYPE_CHECKING:
    from ..speed.compiled import CompiledStep


@resident
class StepRunner:
    """Builds a step's host batch and runs its device work: eagerly, or through CUDA graphs."""

    def __init__(self, model, cache, use_graphs: bool = False, compiled: CompiledStep | None = None,
                 capacity: tuple[int, int, int] | None = None) -> None:
        can = platform(model.device)
        if use_graphs and not can.graphs:
            raise ValueError("CUDA graphs need a CUDA device; this model is on " + str(model.device))
        if compiled is not None and not can.compiles:
            raise ValueError("compile=True is for CUDA models (decode steps through torch.compile); this model "
                             "is on " + str(model.device))
        self.model, self.cache, self.use_graphs, self.compiled = model, cache, use_graphs, compiled
        # (tokens, keys, rows) an IO slot holds: with it, prefill and mixed steps on a GPU are padded to
        # bucketed sizes (pad_flat, below), so that they can be graphs too
        self.capacity = capacity
        # the (token, key) sizes those steps are padded to: a server that captures their graphs at
        # start-up sets coarser ones (speed/startup_graphs.py); a graph's key holds the padded sizes, so
        # graphs captured with either set stay right
        self.flat_buckets = (TOKEN_BUCKETS, KEY_BUCKETS)
        # the decode layout is what makes graph shapes few; without graphs it is still cheaper on a GPU
        self.decode_layout = model.decode_layout
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.captures: list[dict] = []  # one record per capture: key, pool memory growth, seconds

    def build(self, plan: BatchPlan):
        # rows are padded on a GPU with or without graphs, so eager and graph runs use the same shapes
        rows = ROW_BUCKETS if platform(self.model.device).padded else ()
        if rows and self.compiled is not None and self.compiled.dynamic_rows:
            rows = rows[1:]  # one row padded to two: torch.compile would specialize a single row (compiled.py)
        # steps compiled for a fixed number of keys compile once per shape: coarser key buckets
        coarse = self.compiled is not None and not self.compiled.dynamic_keys
        decode_bucket = self.model.kv_bucket if coarse else self.model.decode_kv_bucket
        batch = build_batch(plan, self.cache, self.model.kv_bucket, self.decode_layout, rows, decode_bucket)
        if rows and self.capacity is not None and not batch.decode_rows:  # as rows: with or without graphs
            tokens, keys, max_rows = self.capacity
            batch = pad_flat(batch, self.cache.scratch_cell, *self.flat_buckets, max_rows, tokens, keys)
        return batch

    def graphed(self, batch: Batch) -> bool:
        """Does this batch's step run as a CUDA graph (captured the first time its shape comes up)?"""
        # (a penalized step's history has a length of its own every step: eager)
        return self.use_graphs and bool(batch.decode_rows or batch.padded) and not batch.penalized

    def launch_bound(self, batch: Batch, key: tuple) -> bool:
        """Will launching this batch's step (graph key `key`) hold the host for about as long as the step
        runs, or longer? On a GPU: an eager step, or a graph still to capture. The async loop then hands
        over the step before it first (core/async_loop.py)."""
        return platform(self.model.device).host_launches and (not self.graphed(batch) or key not in self.graphs)

    def __call__(self, args: StepArgs) -> None:
        """Compute work of one step (called on the compute stream)."""
        if not self.graphed(args.batch):
            forward_step(self.model, self.cache, args, self.compiled)
            return
        graph = self.graphs.get(args.key)
        if graph is not None:
            graph.replay()
            return
        started = time.perf_counter()
        forward_step(self.model, self.cache, args, self.compiled)  # warm-up run, eagerly
        graph = self.graphs[args.key] = self._capture(args, started)
        # the step's results come from the graph too, so that every graphed step uses the graph's
        # kernels (bf16 eager and graph kernels may round differently); running the step again is
        # harmless: it writes the same KV cells and outputs, and carry-over is out of place
        graph.replay()

    def _capture(self, args: StepArgs, started: float) -> torch.cuda.CUDAGraph:
        # torch.cuda.graph empties the allocator's cache as it starts; do it first, so that the growth
        # measured below is the graph's own (and never negative)
        torch.cuda.synchronize(self.model.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.model.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # synchronizes the device first
            forward_step(self.model, self.cache, args, self.compiled)
        grew = torch.cuda.memory_reserved(self.model.device) - before
        # seconds: host time the capture held the loop since `started`: the warm-up step (with a compile if
        # the shape is new to torch.compile), the device drained, the capture itself
        self.captures.append({"key": args.key, "reserved_growth": grew, "seconds": time.perf_counter() - started})
        return graph


def pad_flat(batch: Batch, scratch: int, tokens: tuple[int, ...], keys: tuple[int, ...], rows: int,
             max_tokens: int, max_keys: int) -> Batch:
    """A flat (prefill or mixed) batch padded to bucketed sizes, so that its step can be a CUDA graph.

    T tokens go up to a size in `tokens`, K keys up to a size in `keys` (always at least one more than
    K, see below), and the sampled rows to `rows`; the batch is returned as it is when a padded size
    would not fit in `max_tokens`, `max_keys` or `rows`. Padding never changes a real token's result:

        padding tokens   id 0 at position 0, chunk -1, K/V written to the scratch cell, past the last of
                         chunk_starts (empty chunks fill it up to rows + 1 offsets)
        padding keys     the scratch cell, chunk -1: only padding tokens see them (and at least one
                         exists, so a padding token's attention row is never empty, which would be NaN)
        padding rows     sample the last token greedily; the host reads only the real rows

    Why: an eager prefill step of a small model is bound by the host launching its kernels one by
    one, so the GPU idles between steps while the host prepares the next one (BENCHMARKS.md); a graph
    replays the step with one launch. Padding costs compute (at most an eighth more tokens above 256
    with the buckets of buckets.py, up to 32 tokens below) and a capture per new shape.
    """
    t, k, r = batch.num_tokens, batch.kv_indices.shape[0], batch.num_sampled
    if batch.decode_rows or r > rows or not t or batch.score_indices.shape[0]:  # (a scoring step: rare, eager)
        return batch
    if batch.chunk_starts.shape[0] > rows + 1:  # more chunks than rows (several that do not sample): eager
        return batch
    if not tokens or not keys or t > max(tokens) or k + 1 > max(keys):
        return batch
    t2, k2 = bucket(t, tokens), bucket(k + 1, keys)
    if t2 > max_tokens or k2 > max_keys:
        return batch

    def ext(x: torch.Tensor, n: int, value) -> torch.Tensor:
        return torch.cat([x, torch.full((n,), value, dtype=x.dtype)]) if n else x

    pt, pk, pr = t2 - t, k2 - k, rows - r
    return Batch(
        input_ids=ext(batch.input_ids, pt, 0), positions=ext(batch.positions, pt, 0), q_seq=ext(batch.q_seq, pt, -1),
        cell_mapping=ext(batch.cell_mapping, pt, scratch),
        kv_indices=ext(batch.kv_indices, pk, scratch), kv_seq=ext(batch.kv_seq, pk, -1), kv_pos=ext(batch.kv_pos, pk, 0),
        logits_indices=ext(batch.logits_indices, pr, t2 - 1), temperature=ext(batch.temperature, pr, 0.0),
        # rows + 1 offsets whatever the chunk count, as a graph needs: empty chunks at the end (padding
        # tokens and keys lie past the last offset, in no chunk)
        chunk_starts=ext(batch.chunk_starts, rows + 1 - batch.chunk_starts.shape[0], int(batch.chunk_starts[-1])),
        key_starts=ext(batch.key_starts, rows + 1 - batch.key_starts.shape[0], int(batch.key_starts[-1])),
        top_k=ext(batch.top_k, pr, 0), top_p=ext(batch.top_p, pr, 1.0), seed=ext(batch.seed, pr, 0),
        counter=ext(batch.counter, pr, 0), score_indices=batch.score_indices, score_targets=batch.score_targets,
        banned=ext(batch.banned, pr * MAX_BANNED if batch.bans else 0, -1), bans=batch.bans,
        history_rows=batch.history_rows, history_ids=batch.history_ids, history_output=batch.history_output,
        penalties=pad_rows(batch.penalties, pr), penalized=batch.penalized,
        all_greedy=bool(r == 0 or batch.all_greedy), unfiltered=batch.unfiltered, padded=True,
        logprobs=batch.logprobs,
    )
