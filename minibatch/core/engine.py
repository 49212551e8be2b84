"""The engine: one model's device, KV cache, IO slots, step runner and CUDA graphs (notebook 00; the
loops it steps are notebooks 01 and 06, serving is notebook 08).

    engine = Engine(model)                      # opens the device, like a CUDA context
    engine.start(requests, mode="async")        # a run of Request objects: scheduler, cache, slots, runner
    while engine.has_work():
        engine.step()                           # schedule -> launch -> update (one loop turn)
    engine.finish()                             # synchronize, check that every KV block came back
    engine.close()

`engine.generate(prompts, ...)` does all of that, and `minibatch.generate(model, ...)` is a thin
wrapper that builds an engine for one call. Serving requests that arrive while it runs is a plug-in
(minibatch/serving/service.py, notebook 08): `Serving(engine)` opens a run sized once
(`open_run`) and steps it from a background thread. Keep an engine to keep its resources: CUDA graphs are
bound to the addresses of the cache and the slots, so an engine keeps the resource sets of its last
`keep` shapes (least recently used first out) and the next run of a kept shape captures nothing.
Resources are dropped only after the device has finished with them.
Weights loaded into the model between two runs are noticed (`_weights_changed`): the next run
starts from a fresh device and captures again, since graphs and the cpu device process would
otherwise keep computing with the old ones.

The sync and async loops share everything here; `mode` only picks which step function runs
(sync_loop.sync_step or async_loop.async_step). One engine runs one run at a time (`exclusive`): a
second `generate` from another thread (or from inside `on_step`) is refused with a clear error; to
serve many callers, serve them (`Serving(engine).submit` or `.generate`, from any thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from .requests import Request, SamplingParams
from .scheduler import Scheduler
from .slots import IOSlot
from .device import DeviceError, deferred_interrupts, open_device, platform
from .graphs import StepRunner
from .timeline import Timeline
from .async_loop import async_step
from .checks import check_prompts, check_run
from .config import EngineConfig, RunConfig, Shape, make_config, split_options, with_options
from .memory import fits_beside
from .sync_loop import sync_step


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
    applied: object | None = None  # the plan whose tokens the last step applied (what a caller stepping the run reads)

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
        config = with_options(EngineConfig, config, options if mode is None else {**options, "mode": mode}, "start()")
        run_config = make_config(self.model, config, [len(r.prompt) for r in requests],
                                 max(r.max_new_tokens for r in requests))
        return self.open_run(run_config, requests, timeline, on_step)

    @property
    def kept_bytes(self) -> int:
        """Device bytes the kept resources hold: a new run of another shape reuses or frees them."""
        return sum(r.cache.nbytes for r in self.kept.values())

    def open_run(self, config: RunConfig, requests: list[Request], timeline: Timeline | None = None,
                 on_step: Callable | None = None) -> Run:
        """Open a run of a checked RunConfig (config.make_config, or serving_config for a run that takes
        requests while it lasts: `scheduler.add`); `step()` then advances it. Hold `exclusive()` around
        it, as generate does."""
        if any(r.params.stop for r in requests):  # (a serving run's requests arrive later, through its loop)
            raise ValueError("stop strings are matched in the text streamed to a client, which a run of "
                             "generate or start has none of; use Serving(engine).generate or .submit "
                             "(minibatch.serving)")
        self._weights_changed()
        dev = self._device()
        timeline = timeline if timeline is not None else Timeline()
        dev.set_timeline(timeline)
        res = self._resources(config.shape)
        scheduler = Scheduler(res.cache.allocator, config.max_batch_tokens, config.max_batch_size,
                              config.prefix_caching)
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
        run.scheduler.close()  # (the prefix cache's idle blocks back to the allocator)
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
        requests.
        """
        params, config = split_options(params, config, options, "generate()")
        token_ids, params = check_prompts(self.model, prompts, params)
        arrival_steps = check_run(len(token_ids), arrival_steps=arrival_steps, timeline=timeline, on_step=on_step,
                                  progress=progress)
        requests = [Request(i, p, params.replace(seed=params.seed + i), arrival_step=step)
                    for i, (p, step) in enumerate(zip(token_ids, arrival_steps))]
        # the engine first: the memory check reads the device's free memory, which a run of this engine
        # in another thread may be capturing a CUDA graph meanwhile (a CUDA call then breaks the capture)
        with self.exclusive():
            run_config = make_config(self.model, config, [len(p) for p in token_ids], params.max_new_tokens,
                                     self.kept_bytes)
            with _progress(progress, len(requests), config.mode) as bar:
                self._run(run_config, requests, timeline, on_step, bar)
        return [r.output for r in requests]

    def _run(self, run_config: RunConfig, requests: list[Request], timeline, on_step, bar) -> None:
        """generate's run, start to finish, in the calling thread; a failed run leaves nothing open."""
        try:
            run = self.open_run(run_config, requests, timeline, on_step)
            while run.scheduler.has_work():
                finished = self.step()
                if bar is not None and finished:
                    bar.update(len(finished))
            self.finish()
        except BaseException:
            self.abandon()
            raise

    @contextmanager
    def exclusive(self):
        """Hold the engine for one run (a generate, or a serving context): a second is refused."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this engine is busy with another run (a generate from another thread or from "
                               "inside on_step, or a serving context): one engine runs one run at a time. "
                               "To serve several callers, open `with Serving(engine) as server:` "
                               "(minibatch.serving) and submit or generate through it from any thread")
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
        """The kept resources of this shape (most recently used now), or new ones. The least recently used
        sets go beyond `keep`, and where a new set needs their room (the memory check counted them as
        free), after the device has finished with them."""
        if shape in self.kept:
            self.kept.move_to_end(shape)
            return self.kept[shape]
        model, dev = self.model, self.dev
        if len(self.kept) >= self.keep or (self.kept and not fits_beside(model, shape)):
            dev.synchronize()  # nothing in flight may still use what we drop
            while self.kept and (len(self.kept) >= self.keep or not fits_beside(model, shape)):
                self.kept.popitem(last=False)
                platform(model.device).release_cached(model.device)
        compiled = None
        if shape.compiled:
            dynamic = shape.compiled == "dynamic"
            if self._compiled is None or self._compiled.dynamic_rows != dynamic:
                self._compiled = model.compiled_step(dynamic_rows=dynamic)
            compiled = self._compiled
        cache = model.make_cache(shape.num_blocks, shape.block_size, device=dev)
        slots = [IOSlot(dev, i, shape.max_tokens, shape.max_keys, shape.rows) for i in range(shape.num_slots)]
        # with the slots' capacity the runner pads prefill steps so that they can be graphs ("decode": not)
        capacity = None if shape.cuda_graphs == "decode" else (shape.max_tokens, shape.max_keys, shape.rows)
        runner = StepRunner(model, cache, bool(shape.cuda_graphs), compiled, capacity)
        self.kept[shape] = Resources(cache, slots, runner)
        return self.kept[shape]

    def abandon(self) -> None:
        """After a failed or interrupted run: wait for the device (bounded), then drop what the run used.

        Its KV cache still counts blocks as owned, so the set is not reused. If the device failed or
        does not finish in time, or the run failed before it was open, the device is closed and every
        resource tied to it goes with it; the next run opens a fresh device.
        """
        run, self.run = self.run, None
        if self.dev is None:
            return
        if run is None:  # failed before it opened, maybe mid-request to the device: a wait might never end
            self._reset_device()
            return
        try:
            self.dev.synchronize(run.timeout)
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
        platform(self.model.device).release_cached(self.model.device)

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


def generate(model, prompts, params: SamplingParams | None = None, **options) -> list[list[int]]:
    """Continue every prompt with `model` (from load_model) or an Engine; see `Engine.generate` (options:
    SamplingParams' and EngineConfig's fields, e.g. max_new_tokens, temperature, mode="sync" | "async",
    and timeline, on_step, progress, arrival_steps). Given a model, an engine is built for this call
    and closed after it."""
    if isinstance(model, Engine):
        return model.generate(prompts, params, **options)
    with Engine(model) as engine:
        return engine.generate(prompts, params, **options)
