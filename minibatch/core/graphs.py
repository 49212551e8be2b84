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
    count from TOKEN_BUCKETS, a key count from KEY_BUCKETS and the slot's rows (batch.pad_flat), and
    the few that do not fit those (more keys than KEY_BUCKETS holds) stay eager;
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

from .batch import build_batch, pad_flat
from .buckets import KEY_BUCKETS, ROW_BUCKETS, TOKEN_BUCKETS
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
        # bucketed sizes (batch.pad_flat), so that they can be graphs too
        self.capacity = capacity
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
            batch = pad_flat(batch, self.cache.scratch_cell, TOKEN_BUCKETS, KEY_BUCKETS, max_rows, tokens, keys)
        return batch

    def __call__(self, args: StepArgs) -> None:
        """Compute work of one step (called on the compute stream)."""
        batch = args.batch  # (a penalized step's history has a length of its own every step: eager)
        if not (self.use_graphs and (batch.decode_rows or batch.padded)) or batch.penalized:
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
