"""CUDA graphs: one capture per slot and shape, all in one shared memory pool (notebook 04).

An eager decode step of an 8B model launches hundreds of small kernels one by one from Python; on
an H200 the CPU needs longer to launch them than the GPU needs to run them (BENCHMARKS.md). A CUDA
graph records the whole step once and replays it with one launch.

    eager    CPU  |l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|l|        (one launch per kernel)
             GPU    █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █ █      (waits for each launch)
    graph    CPU  |replay|
             GPU   ███████████████████████████                      (back to back)

A graph replays fixed kernels on fixed addresses with fixed shapes. Hence:
  * the step reads and writes only the slot's preallocated buffers (slots.py), so a graph belongs
    to one slot: two slots, two graphs per shape;
  * shapes come from buckets: decode steps are padded to a row count from ROW_BUCKETS and a key
    length that is a multiple of the model's decode_kv_bucket (kv_bucket for compiled steps, which
    compile once per shape; batch.py, decode layout); mixed
    prefill/decode steps stay eager (they are few);
  * the carry-over ops (carry_over.py) run inside the graph, before the forward pass.
All graphs share one memory pool: they never run at the same time (one compute stream), so the
memory one graph uses for its intermediate tensors can be reused by the next. Two slots' graphs
then cost about as much as one (the article's observation; measured in BENCHMARKS.md).

Graphs are captured lazily, the first time a (slot, shape) comes up: that step runs eagerly once
(warm-up), is captured, and is replayed for its real results and for every later step of that
shape. On the CPU backend there are no graphs: the runner calls the eager step, the same code path
minus the capture.
"""

from __future__ import annotations

import torch

from .batch import build_batch
from .scheduler import BatchPlan
from .slots import StepArgs, forward_step

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class StepRunner:
    """Builds a step's host batch and runs its device work: eagerly, or through CUDA graphs."""

    def __init__(self, model, cache, use_graphs: bool = False, compiled: bool = False) -> None:
        if use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; this model is on " + str(model.device))
        if compiled and model.device.type != "cuda":
            raise ValueError("compile=True is for CUDA models (decode steps through torch.compile); this model "
                             "is on " + str(model.device))
        self.model, self.cache, self.use_graphs, self.compiled = model, cache, use_graphs, compiled
        # the decode layout is what makes graph shapes few; without graphs it is still cheaper on a GPU
        self.decode_layout = model.decode_layout
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.captures: list[dict] = []  # one record per capture: key and pool memory growth

    def build(self, plan: BatchPlan):
        # rows are padded on a GPU with or without graphs, so eager and graph runs use the same shapes
        # (this did not make bf16 eager and graph runs bit-identical on the H200: BENCHMARKS.md)
        rows = ROW_BUCKETS if self.model.device.type == "cuda" else ()
        # compiled steps compile once per shape (model.compiled_step): coarser key buckets, fewer shapes
        decode_bucket = self.model.kv_bucket if self.compiled else self.model.decode_kv_bucket
        return build_batch(plan, self.cache, self.model.kv_bucket, self.decode_layout, rows, decode_bucket)

    def __call__(self, args: StepArgs) -> None:
        """Compute work of one step (called on the compute stream)."""
        if not (self.use_graphs and args.batch.decode_rows):
            forward_step(self.model, self.cache, args, self.compiled)
            return
        graph = self.graphs.get(args.key)
        if graph is not None:
            graph.replay()
            return
        forward_step(self.model, self.cache, args, self.compiled)  # warm-up run, eagerly
        graph = self.graphs[args.key] = self._capture(args)
        # the step's results come from the graph too, so that every graphed step uses the graph's
        # kernels (bf16 eager and graph kernels may round differently); running the step again is
        # harmless: it writes the same KV cells and outputs, and carry-over is out of place
        graph.replay()

    def _capture(self, args: StepArgs) -> torch.cuda.CUDAGraph:
        # torch.cuda.graph empties the allocator's cache as it starts; do it first, so that the growth
        # measured below is the graph's own (and never negative)
        torch.cuda.synchronize(self.model.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.model.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # synchronizes the device first
            forward_step(self.model, self.cache, args, self.compiled)
        grew = torch.cuda.memory_reserved(self.model.device) - before
        self.captures.append({"key": args.key, "reserved_growth": grew})
        return graph


def pool_memory(model, rows: int = 32, context: int = 512, shared: bool = True) -> list[int]:
    """Bytes the GPU's reserved memory grew by while capturing slot A's decode graph, then slot B's.

    shared=True captures both into one pool (what the loops do); shared=False gives each graph its
    own pool. The article's claim: with one pool, the second graph costs about nothing.
    """
    from .device import get_device
    from .kv_cache import PagedKVCache  # noqa: F401  (the cache comes from the model)
    from .requests import Request
    from .scheduler import Scheduler
    from .slots import IOSlot

    block = 16
    cache = model.make_cache(rows * (context // block + 2), block)
    sched = Scheduler(cache.allocator, rows * (context + 1), rows)
    for i in range(rows):
        sched.add(Request(i, [1] * context, 4))
    prefill = sched.schedule()
    runner = StepRunner(model, cache, use_graphs=True)
    with get_device(str(model.device)) as dev:
        width = -(-(context + 2) // model.kv_bucket) * model.kv_bucket
        slots = [IOSlot(dev, i, rows * (context + 1), max(cache.num_cells + model.kv_bucket, rows * width), rows,
                        model.device) for i in range(2)]
        slots[0].load(runner.build(prefill), [])
        slots[0].copy_in(dict(slots[0].sizes))
        runner(slots[0].bind(None))  # prefill, eager
        sched.update(prefill, [2] * rows)
        decode = sched.schedule()
        if not shared:
            runner.pool = None  # torch then gives each capture a pool of its own
        for slot, other in ((slots[0], slots[1]), (slots[1], slots[0])):
            slot.load(runner.build(decode), [])
            slot.copy_in(dict(slot.sizes))
            runner(slot.bind(other))  # eager run + capture
        dev.synchronize()
    return [c["reserved_growth"] for c in runner.captures]
