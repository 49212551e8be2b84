"""The engine: one model's device, KV cache, IO slots, step runner and CUDA graphs (notebook 00; the
loops it steps are notebooks 01 and 06, serving is notebook 08).

    engine = Engine(model)                      # opens the device, like a CUDA context
    engine.start(requests, mode="async")        # a run of Request objects: scheduler, cache, slots, runner
    while engine.has_work():
        engine.step()                           # schedule -> launch -> update (one loop turn)
    engine.finish()                             # synchronize, check that every KV block came back
    engine.close()

`engine.generate(prompts, ...)` does all of that, and `minibatch.generate(model, ...)` is a thin
wrapper that builds an engine for one call. `engine.serving(...)` opens a run sized once for
requests that arrive while it lasts: its loop turns in a background thread, `engine.submit(...)`
hands it a request from any thread and returns a TokenStream of its tokens (serving_loop.py, stream.py);
`generate` called meanwhile submits into it. Keep an engine to keep its resources: CUDA graphs are
bound to the addresses of the cache and the slots, so an engine keeps the resource sets of its last
`keep` shapes (least recently used first out) and the next run of a kept shape captures nothing.
Resources are dropped only after the device has finished with them.
Weights loaded into the model between two runs are noticed (`_weights_changed`): the next run
starts from a fresh device and captures again, since graphs and the cpu device process would
otherwise keep computing with the old ones.

The sync and async loops share everything here; `mode` only picks which step function runs
(sync_loop.sync_step or async_loop.async_step). One engine runs one run at a time: a second
`generate` from another thread (or from inside `on_step`) is refused with a clear error, unless the
engine is serving, where every call becomes a submit.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .requests import Request, SamplingParams
from .scheduler import Scheduler
from .slots import IOSlot
from .device import DeviceError, deferred_interrupts, open_device
from .graphs import StepRunner
from .timeline import Timeline
from .async_loop import async_step
from .checks import check_prompts, check_run
from .config import EngineConfig, RunConfig, Shape, make_config, serving_config, split_options
from .serving_loop import ServingLoop
from .stream import TokenStream
from .sync_loop import sync_step

SERVING_TIMELINE_LIMIT = 100_000  # spans a serving run's timeline keeps by default: it may serve for hours

STEPS = {"sync": sync_step, "async": async_step}
# what the engine asks of a model (minibatch.model.Model has it all): a model is plugged in, not imported
MODEL_NEEDS = ("device", "vocab_size", "tokenizer", "max_positions", "make_cache", "next_tokens", "compiled_step",
               "pack_weights", "weights_seen")


@dataclass
class Resources:
    """What a run of one shape allocates: the KV cache, the IO slots and the step runner (with its graphs)."""

    cache: object
    slots: list
    runner: StepRunner


@dataclass
class Run:
    """One run in progress: what the step functions of the two loops read and update."""

    scheduler: Scheduler
    requests: list
    timeline: Timeline
    streams: tuple
    slots: list
    runner: StepRunner
    config: RunConfig
    on_step: Callable | None
    in_flight: tuple | None = None  # async: (plan, slot) of the batch the device is running
    launched: int = 0  # async: steps launched so far (picks the slot)
    applied: object | None = None  # the plan whose tokens the last step applied (a serving loop delivers them)

    @property
    def mode(self) -> str:  # which loop's step function advances it (STEPS)
        return self.config.mode

    @property
    def timeout(self) -> float | None:
        return self.config.timeout

    @property
    def delays(self) -> dict:
        return self.config.inject_delays

    def stepped(self, plan, done) -> None:
        """The step functions' last word: `plan`'s tokens are applied, `done` finished with them."""
        self.applied = plan
        if self.on_step is not None:
            self.on_step(plan, done)


class Engine:
    """One model's inference engine. Use it in a `with` block, or call `close()`."""

    def __init__(self, model, keep: int = 4) -> None:
        if not all(hasattr(model, name) for name in MODEL_NEEDS):
            raise TypeError(f"model must come from minibatch.load_model, got {type(model).__name__}")
        self.model, self.keep = model, keep
        self.dev = None  # opened on first use, kept until close()
        self.kept: OrderedDict[Shape, Resources] = OrderedDict()
        self.run: Run | None = None
        self.loop: ServingLoop | None = None  # while serving
        self._busy = threading.Lock()  # held by the run in progress (a generate, or a serving context)
        self._compiled = None  # the model's compiled decode step, made at the first compiled run
        self._weights_seen: tuple | None = None  # where the weights were, and their versions, at the last run

    # --- a run, step by step ------------------------------------------------------------------------
    def start(self, requests: list[Request], mode: str | None = None, config: EngineConfig | None = None, *,
              timeline: Timeline | None = None, on_step: Callable | None = None, **options) -> Run:
        """Set up a run of `requests` (minibatch.core.requests.Request objects, e.g.
        `Request(0, token_ids, SamplingParams(max_new_tokens=8))`); `step()` then advances it.
        `config` (an EngineConfig) and `options` (its fields by name) say how; `mode` ("sync", the
        default, or "async") is one of them, first for short."""
        if not requests or not all(isinstance(r, Request) for r in requests):
            raise TypeError("start takes a non-empty list of Request objects (generate takes prompts)")
        config = _made(EngineConfig, config, options if mode is None else {**options, "mode": mode}, "start()")
        run_config = make_config(self.model, config, [len(r.prompt) for r in requests],
                                 max(r.max_new_tokens for r in requests))
        return self._open(run_config, requests, timeline, on_step)

    def _open(self, config: RunConfig, requests: list[Request], timeline: Timeline | None,
              on_step: Callable | None) -> Run:
        self._weights_changed()
        dev = self._device()
        timeline = timeline if timeline is not None else Timeline()
        dev.set_timeline(timeline)
        res = self._resources(config.shape)
        scheduler = Scheduler(res.cache.allocator, config.max_batch_tokens, config.max_batch_size)
        for r in requests:
            scheduler.add(r)
        streams = (dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H"))
        self.run = Run(scheduler, requests, timeline, streams, res.slots, res.runner, config, on_step)
        return self.run

    def has_work(self) -> bool:
        return self.run is not None and self.run.scheduler.has_work()

    def step(self) -> list[Request]:
        """One turn of the loop: schedule, launch, update. Returns the requests that finished."""
        return STEPS[self.run.mode](self.run)

    def finish(self) -> list[Request]:
        """End the run: wait for the device, check that every KV block came back; its requests, in order."""
        run = self.run
        self.dev.synchronize(run.timeout)
        cache = self.kept[run.config.shape].cache
        if cache.allocator.num_free != cache.allocator.num_blocks:
            raise RuntimeError(f"KV blocks leaked: {cache.allocator.num_blocks - cache.allocator.num_free} "
                               "still owned after the run")
        self.run = None
        return run.requests

    def generate(self, prompts, params: SamplingParams | None = None, config: EngineConfig | None = None, *,
                 timeline: Timeline | None = None, progress: bool = False, arrival_steps: Sequence[int] | None = None,
                 on_step: Callable | None = None, **options) -> list[list[int]]:
        """Continue every prompt; return the new tokens of each, in prompt order.

        How each prompt is continued is a SamplingParams (`params`), how the run goes an EngineConfig
        (`config`); `options` change their fields by name, so `generate(prompts, max_new_tokens=32,
        temperature=0.7, mode="async")` needs neither. Their docstrings list every option and its
        default (greedy, 64 new tokens, the sync loop). Request i samples with seed `seed + i`, so
        results do not depend on batching. Everything is checked before any work, including that the
        KV cache and IO slots fit in free memory.

        `arrival_steps[i]` (optional) is the step at which prompt i reaches the scheduler, to
        simulate requests arriving while the loop runs. `on_step(plan, finished)` is called on the
        host after each step's tokens are applied (live plots); `progress` shows a bar over finished
        requests. While the engine is serving, the prompts are submitted to it (its mode and limits
        apply).
        """
        params, config = _options(params, config, options, "generate()")
        if self.loop is not None:
            return self._generate_online(prompts, params, config)
        token_ids, params = check_prompts(self.model, prompts, params)
        arrival_steps = check_run(len(token_ids), arrival_steps=arrival_steps, timeline=timeline, on_step=on_step,
                                  progress=progress)
        run_config = make_config(self.model, config, [len(p) for p in token_ids], params.max_new_tokens,
                                 sum(r.cache.nbytes for r in self.kept.values()))
        requests = [Request(i, p, params.replace(seed=params.seed + i), arrival_step=step)
                    for i, (p, step) in enumerate(zip(token_ids, arrival_steps))]
        with self._exclusive(), _progress(progress, len(requests), config.mode) as bar:
            try:
                run = self._open(run_config, requests, timeline, on_step)
                while run.scheduler.has_work():
                    finished = self.step()
                    if bar is not None and finished:
                        bar.update(len(finished))
                self.finish()
            except BaseException:
                self._abandon()
                raise
        return [r.output for r in requests]

    def _generate_online(self, prompts, params: SamplingParams, config: EngineConfig) -> list[list[int]]:
        if config.mode != self.loop.run.mode:
            raise ValueError(f"this engine is serving in {self.loop.run.mode!r} mode; generate(mode={config.mode!r}) "
                             "cannot run beside it (leave serving() first, or use its mode)")
        token_ids, params = check_prompts(self.model, prompts, params)
        streams = [self.submit(p, params.replace(seed=params.seed + i)) for i, p in enumerate(token_ids)]
        return [s.wait().token_ids for s in streams]

    # --- serving: requests that arrive while the loop runs -------------------------------------------
    @contextmanager
    def serving(self, mode: str | None = None, config: EngineConfig | None = None, *, max_queue: int | None = None,
                timeline: Timeline | None = None, **options):
        """Serve requests submitted while the `with` block lasts, from a loop in a background thread.

        The run is sized once, for `max_batch_size` requests (default 8) of the model's whole context
        (or `num_blocks` KV blocks), and checked against free memory; its KV cache, IO slots and CUDA
        graphs serve every request. `config` and `options` are generate's run options (EngineConfig),
        except that CUDA graphs default to decode steps only (config.serving_config says why).
        `mode` is "async" unless `config` or `mode` says otherwise. `max_queue` bounds the requests
        waiting for a seat (submit raises QueueFull beyond it). Leaving the block ends every open
        stream ("cancelled") and joins the thread.
        """
        mode = mode or (config.mode if config is not None else "async")
        config = _made(EngineConfig, config, {**options, "mode": mode}, "serving()")
        run_config = serving_config(self.model, config, sum(r.cache.nbytes for r in self.kept.values()))
        with self._exclusive():
            run = self._open(run_config, [], timeline if timeline is not None else Timeline(limit=SERVING_TIMELINE_LIMIT),
                             None)
            self.loop = ServingLoop(self, run, max_queue)
            self.loop.start_thread()
            try:
                yield self
            finally:
                loop, self.loop = self.loop, None
                loop.close()
                if loop.error is None:
                    self.finish()
                else:
                    self._abandon()

    def submit(self, prompt, params: SamplingParams | None = None, **options) -> TokenStream:
        """Hand one request to the serving loop, from any thread; returns its TokenStream at once.

        `params` (a SamplingParams) and `options` (its fields by name) mean what they mean in
        `generate`: a request submitted with seed S gives the tokens `generate([prompt], seed=S)`
        gives; `stop` strings end it when its text contains one (the text ends before it). A request
        that could never fit in the KV cache is refused here.
        """
        loop = self.loop
        if loop is None:
            raise RuntimeError("submit needs a serving engine: `with engine.serving(): engine.submit(...)`")
        params = _made(SamplingParams, params, options, "submit()")
        (ids,), params = check_prompts(self.model, [prompt], params)
        request = Request(next(loop.rids), ids, params)
        allocator = loop.run.scheduler.allocator
        if allocator.blocks_for(request.max_len) > allocator.num_blocks:
            raise ValueError(f"this request needs {request.max_len} tokens of KV cache but the serving cache holds "
                             f"{allocator.num_blocks * allocator.block_size}: it could never run (raise num_blocks)")
        return loop.submit(request, TokenStream(request.rid, len(ids)), self.model.tokenizer)

    def stats(self) -> dict:
        """The serving run's KV blocks, requests, steps and CUDA graph captures so far (a snapshot, read
        without stopping the loop). A graph is captured the first time a step shape comes up: captures
        that keep growing under load are steps that ran slower than a replay would, and
        `graph_capture_s` is the host time they held the loop (warm-up step, drain, capture; with
        compile=True also the torch.compile of a new shape, which happens in the warm-up step).
        `loop_cpu_s`: the CPU seconds the loop's thread has run (a server's HTTP thread shares the
        interpreter's lock with it: together they tell how much of it was left)."""
        if self.loop is None:
            return {"serving": False}
        run = self.loop.run
        s = run.scheduler
        return {"serving": True, "mode": run.mode, "kv_blocks": s.allocator.num_blocks,
                "kv_blocks_free": s.allocator.num_free, "running": len(s.running),
                "waiting": len(s.waiting) + len(self.loop.inbox), "steps": s.step,
                "graph_captures": len(run.runner.captures),
                "graph_capture_s": round(sum(c["seconds"] for c in run.runner.captures), 3),
                "loop_cpu_s": round(self.loop.cpu_s, 3)}

    @contextmanager
    def _exclusive(self):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this engine is busy with another run (a generate from another thread or from "
                               "inside on_step, or a serving context): one engine runs one run at a time. "
                               "To serve several callers, open `with engine.serving():` and submit or generate "
                               "from any thread")
        try:
            yield
        finally:
            self._busy.release()

    # --- resources ----------------------------------------------------------------------------------
    def _device(self):
        if self.dev is None:
            with deferred_interrupts():  # an interrupt must not orphan the device between opening and keeping it
                self.dev = open_device(str(self.model.device), inherit=(self.model,))  # the weights stay where they are
        return self.dev

    def _resources(self, shape: Shape) -> Resources:
        """The kept resources of this shape (most recently used now), or new ones; the least recently
        used set beyond `keep` is dropped, after the device has finished with it."""
        if shape in self.kept:
            self.kept.move_to_end(shape)
            return self.kept[shape]
        if len(self.kept) >= self.keep:
            self.dev.synchronize()  # nothing in flight may still use what we drop
            while len(self.kept) >= self.keep:
                self.kept.popitem(last=False)
        model, dev = self.model, self.dev
        compiled = None
        if shape.compiled:
            dynamic = shape.compiled == "dynamic"
            if self._compiled is None or self._compiled.dynamic_rows != dynamic:
                self._compiled = model.compiled_step(dynamic_rows=dynamic)
            compiled = self._compiled
        cache = model.make_cache(shape.num_blocks, shape.block_size, alloc=dev.empty)
        slots = [IOSlot(dev, i, shape.max_tokens, shape.max_keys, shape.rows) for i in range(shape.num_slots)]
        # with the slots' capacity the runner pads prefill steps so that they can be graphs ("decode": not)
        capacity = None if shape.cuda_graphs == "decode" else (shape.max_tokens, shape.max_keys, shape.rows)
        runner = StepRunner(model, cache, bool(shape.cuda_graphs), compiled, capacity)
        self.kept[shape] = Resources(cache, slots, runner)
        return self.kept[shape]

    def _abandon(self) -> None:
        """After a failed or interrupted run: wait for the device (bounded), then drop what the run used.

        Its KV cache still counts blocks as owned, so the set is not reused. If the device failed or
        does not finish in time, it is closed and every resource tied to it goes with it; the next run
        opens a fresh device.
        """
        run, self.run = self.run, None
        if self.dev is None:
            return
        try:
            self.dev.synchronize(run.timeout if run is not None else None)
        except DeviceError:
            self._reset_device()
            return
        except BaseException:  # a second interrupt while waiting: still leave nothing half open
            self._reset_device()
            raise
        if run is not None:
            self.kept.pop(run.config.shape, None)

    def _weights_changed(self) -> None:
        """Weights changed since the last run (loaded into the model, or moved by `.to()` and back):
        kept CUDA graphs read them where they were, and the cpu device process computes with the copy it
        forked, so both go (Model.weights_seen)."""
        self.model.pack_weights()  # weights that moved are stacked again, as compiled steps expect
        seen = self.model.weights_seen()
        if self._weights_seen is not None and seen != self._weights_seen:
            self.close()  # the next _device() opens a fresh one
        self._weights_seen = seen

    def _reset_device(self) -> None:
        # an interrupt between letting go of the device and closing it would leave it open for good
        # (its workers keep it alive): the two happen together or not at all
        with deferred_interrupts():
            dev, self.dev = self.dev, None
            self.kept.clear()
            if dev is not None:
                dev.close()

    def close(self) -> None:
        """Wait for the device, free the kept resources, close the device."""
        try:
            if self.dev is not None:
                self.dev.synchronize(600.0)
        finally:
            self._reset_device()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Engine {self.model.name!r} on {self.model.device}, {len(self.kept)} kept shape(s)>"


@contextmanager
def _progress(on: bool, total: int, mode: str):
    """A progress bar over finished requests, or None."""
    if not on:
        yield None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"generate ({mode})", unit="req")
    try:
        yield bar
    finally:
        bar.close()


def _options(params, config, options: dict, where: str) -> tuple[SamplingParams, EngineConfig]:
    sampling, engine = split_options(options, where)
    return _made(SamplingParams, params, sampling, where), _made(EngineConfig, config, engine, where)


def _made(cls, given, options: dict, where: str):
    """`given` (a `cls`, or None for its defaults) with `options` (fields of `cls` by name) changed."""
    if given is not None and not isinstance(given, cls):
        raise TypeError(f"{where} takes a minibatch {cls.__name__} or None, got {given!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}: its options are "
                        f"{sorted(fields)} ({cls.__name__})")
    return (given or cls()).replace(**options)


def generate(model, prompts, params: SamplingParams | None = None, **options) -> list[list[int]]:
    """Continue every prompt with `model` (from load_model) or an Engine; see `Engine.generate` (options:
    SamplingParams' and EngineConfig's fields, e.g. max_new_tokens, temperature, mode="sync" | "async",
    and timeline, on_step, progress, arrival_steps). Given a model, an engine is built for this call
    and closed after it."""
    if isinstance(model, Engine):
        return model.generate(prompts, params, **options)
    with Engine(model) as engine:
        return engine.generate(prompts, params, **options)
