"""One step on the device: its launch on three streams, and its compute work, eagerly or as a CUDA
graph replay (notebook 04).

    host     load slot ─ launch H2D, compute, D2H ─ (free: prepare the next batch) ─ wait d2h_done
    H2D      ██ copy the slot's used prefixes ██ ●h2d_done
    compute                                      ╎ carry-over + forward + sample ●compute_done
    D2H                                                                          ╎ copy ids ●d2h_done

`launch_step` enqueues the three stages, chained by the slot's events, and returns at once.
`StepRunner` is the compute stage: it builds a step's host batch, and runs its device work through
`forward_step`, or replays a CUDA graph of it.

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

import sys

import torch

from .batch import build_batch, pad_flat
from .carry_over import apply_carry_over
from .scheduler import BatchPlan
from .slots import IOSlot, StepArgs, bound_args, copy_in, copy_out

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Prefill and mixed steps (batch.pad_flat). Tokens: a step is usually exactly the token budget (prefill
# chunks are cut to fill it), so the buckets only need to be fine enough that the other steps waste
# little: at most 1/8 of the tokens above 256 (a large model's prefill is compute-bound: padding costs
# what it adds). Keys: the flat layout's attention costs tokens x keys, so half-octave buckets
# (at most 1.5x the keys); above KEY_BUCKETS' largest a step stays eager (its [T, K] mask alone would
# be hundreds of MB, and such steps are long enough to keep the GPU busy without a graph).
TOKEN_BUCKETS = (*range(32, 257, 32), *range(320, 1025, 64), *range(1152, 4097, 128), *range(4352, 8193, 256))
KEY_BUCKETS = tuple(sorted(b << i for b in (256, 384) for i in range(8)))  # 256 ... 49152


class CompiledStep:
    """The decode step (forward + sampling) through torch.compile, one per engine.

    Why: an eager step is a long chain of small elementwise kernels (RMSNorm, rotary embedding, MLP
    activations), each a separate read and write of a [rows, hidden] tensor; Inductor fuses them.
    What it costs: compilation, once per decode shape (rows, greedy or not, cache size, and keys per
    row unless the attention is Triton's). Static shapes, so a shape always gets the same kernels:
    with PyTorch's "automatic dynamic" shapes the kernels that served a shape depended on the order
    shapes came up in, and sync and async runs (which see shapes in different orders) gave different
    bf16 tokens. The one exception is made where it cannot change a kernel: the Triton decode
    attention is a custom operator (triton_decode.paged_decode) that Inductor calls as it is, and the
    key tensors go nowhere else, so their length is marked dynamic: one compile serves every context
    length, and compiled steps pad keys as finely as eager ones (decode_kv_bucket). With the other
    attentions, the keys' length shapes the compiled kernels, and compiled runs pad decode rows to
    the coarser kv_bucket keys to keep compiles few (StepRunner.build). bf16 tokens may differ from
    the eager step's (other kernels round differently): compare compiled runs with compiled runs.
    With `merge` (the default) q/k/v and gate/up run as one matrix product each (siblings.py); its
    bf16 tokens may differ from an unmerged compiled step's for the same reason.
    """

    def __init__(self, model, mode: str | None = None, merge: bool = True) -> None:
        self.model = model
        self.mode = mode  # torch.compile's mode; without CUDA graphs of its own: the runner captures them
        # one matrix product for sibling projections (q/k/v, gate/up) whose weights Model stacked: siblings.py
        self.merge = merge
        self.attention = model.decode_attention
        self.shapes: set[tuple] = set()
        self._fn = None

    @property
    def merged(self) -> list[int]:
        """Per compile (of any CompiledStep of this mode): linear calls merged into a sibling's."""
        from .siblings import backend

        return backend(self.mode).merged if self.merge else []

    @property
    def dynamic_keys(self) -> bool:
        """Whether one compile serves every number of keys per row (see the class doc)."""
        return self.attention == "triton"

    def __call__(self, batch, cache) -> torch.Tensor:
        width = None if self.dynamic_keys else batch.kv_indices.shape[0] // batch.decode_rows
        shape = (batch.decode_rows, width, batch.all_greedy, cache.num_cells, batch.unfiltered)
        if shape not in self.shapes:  # a long silent pause otherwise: say what is happening
            self.shapes.add(shape)
            keys = "any number of" if width is None else str(width)
            print(f"torch.compile: decode step for {shape[0]} rows x {keys} keys"
                  f"{' (greedy)' if shape[2] else ''}: compiling, once per shape", file=sys.stderr, flush=True)
        import torch._dynamo as dynamo

        if self.dynamic_keys:
            for t in (batch.kv_indices, batch.kv_seq, batch.kv_pos):
                dynamo.mark_dynamic(t, 0)
        if self._fn is None:
            for name in ("recompile_limit", "cache_size_limit"):  # renamed in newer PyTorch
                if hasattr(dynamo.config, name):  # one compile per shape: room for a few dozen
                    setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
            if self.merge:
                from .siblings import backend

                self._fn = torch.compile(self.model.forward_sample, dynamic=False, backend=backend(self.mode))
            else:
                self._fn = torch.compile(self.model.forward_sample, dynamic=False, mode=self.mode)
        with torch.inference_mode():
            return self._fn(batch, cache, self.attention)


def forward_step(model, cache, args: StepArgs, compiled: CompiledStep | None = None) -> None:
    """Device work of one step: patch in carried-over tokens, forward, sample into the slot's output.

    Fixed buffers in, fixed buffers out, no host sync: the same call can be captured as a CUDA graph.
    """
    apply_carry_over(args.patched_ids, args.input_ids, args.source, args.carry)
    if compiled is not None and args.batch.decode_rows:
        tokens = compiled(args.batch, cache)
    else:
        tokens = model.step(args.batch, cache)
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
    d2h.launch(copy_out, slot.buffers, slot.sizes["logits_indices"], name="D2H", lane="D2H", **tag)
    d2h.record(slot.d2h_done)


def run_bound(runner, buffers, prev, used: tuple, layout: tuple) -> None:
    """The compute work of launch_step: `runner` on the step's arguments (slots.bound_args)."""
    runner(bound_args(buffers, prev, used, layout))


class StepRunner:
    """Builds a step's host batch and runs its device work: eagerly, or through CUDA graphs."""

    def __init__(self, model, cache, use_graphs: bool = False, compiled: CompiledStep | None = None,
                 capacity: tuple[int, int, int] | None = None) -> None:
        if use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; this model is on " + str(model.device))
        if compiled is not None and model.device.type != "cuda":
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
        self.captures: list[dict] = []  # one record per capture: key and pool memory growth

    def build(self, plan: BatchPlan):
        # rows are padded on a GPU with or without graphs, so eager and graph runs use the same shapes
        rows = ROW_BUCKETS if self.model.device.type == "cuda" else ()
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
        if not (self.use_graphs and (args.batch.decode_rows or args.batch.padded)):
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
    from .requests import Request
    from .scheduler import Scheduler

    block = 16
    cache = model.make_cache(rows * (context // block + 2), block)
    sched = Scheduler(cache.allocator, rows * (context + 1), rows)
    for i in range(rows):
        sched.add(Request(i, [1] * context, 4))
    prefill = sched.schedule()
    runner = StepRunner(model, cache, use_graphs=True)
    with get_device(str(model.device)) as dev:
        width = -(-(context + 2) // model.kv_bucket) * model.kv_bucket
        slots = [IOSlot(dev, i, rows * (context + 1), max(cache.num_cells + model.kv_bucket, rows * width), rows)
                 for i in range(2)]
        slots[0].load(runner.build(prefill), [])
        copy_in(slots[0].buffers, slots[0].used())
        runner(slots[0].bind(None))  # prefill, eager
        sched.update(prefill, [2] * rows)
        decode = sched.schedule()
        if not shared:
            runner.pool = None  # torch then gives each capture a pool of its own
        for slot, other in ((slots[0], slots[1]), (slots[1], slots[0])):
            slot.load(runner.build(decode), [])
            copy_in(slot.buffers, slot.used())
            runner(slot.bind(other))  # eager run + capture
        dev.synchronize()
    return [c["reserved_growth"] for c in runner.captures]
