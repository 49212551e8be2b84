"""`minibatch.generate`: check the input (checks.py), set up cache, slots and scheduler, run a loop (notebook 00;
the loops themselves are notebooks 01 and 06).

The sync and async loops share everything here; `mode` only picks which loop runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .async_loop import run_async
from .checks import MODES, check_generate
from .device import get_device
from .graphs import StepRunner
from .model import Model
from .requests import Request, SamplingParams
from .scheduler import Scheduler
from .slots import IOSlot
from .sync_loop import run_sync
from .timeline import Timeline

__all__ = ["MODES", "generate"]


def generate(
    model: Model,
    prompts,
    max_new_tokens: int = 64,
    mode: str = "sync",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    timeline: Timeline | None = None,
    max_batch_size: int | None = None,
    max_batch_tokens: int = 256,
    block_size: int = 16,
    num_blocks: int | None = None,
    progress: bool = False,
    arrival_steps: Sequence[int] | None = None,
    on_step: Callable | None = None,
    cuda_graphs: bool | None = None,
    compile: bool = False,
    num_slots: int | None = None,
    allow_races: bool = False,
    inject_delays: dict[str, float] | None = None,
    timeout: float | None = 600.0,
) -> list[list[int]]:
    """Continue every prompt; return the new tokens of each, in prompt order.

    Greedy when temperature == 0. Request i samples with seed `seed + i`, so results do not depend
    on batching. Generation of a request stops at `eos_token_id` (included in its output) or after
    `max_new_tokens`. `max_batch_tokens` is the token budget of one step (prefill chunks are cut to
    fit it); `max_batch_size` caps the requests running at once (default min(32, max_batch_tokens));
    `num_blocks` sizes the paged KV cache (default: enough for `max_batch_size` of the longest
    requests). Every argument is checked before any work (checks.py), including that the KV cache
    and IO slots fit in free memory. `top_k` larger than the vocabulary keeps every token, as 0 does.
    `timeout` bounds every host wait on the device (seconds; None or inf: no limit): a device that
    stops making progress raises instead of hanging. `arrival_steps[i]` (optional) is the step at
    which prompt i reaches the server, to simulate requests arriving while the loop runs.
    `cuda_graphs` (default: on for a CUDA model) replays decode steps as CUDA graphs (graphs.py).
    `compile=True` (CUDA only) runs decode steps through torch.compile first (Model.compiled_step).
    `num_slots` (default 1 for sync, 2 for async) and `inject_delays` ({"H2D" | "compute" | "D2H":
    seconds slept on that stream before each step's work) exist to show the race of notebook 04: one
    slot in the async loop gives wrong tokens, so it needs `allow_races=True` as well.
    `on_step(plan, finished)` is called on the host after each step's tokens are applied (live plots).
    """
    a = check_generate(model, prompts, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, timeline=timeline,
                       max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens, block_size=block_size,
                       num_blocks=num_blocks, progress=progress, arrival_steps=arrival_steps, on_step=on_step,
                       cuda_graphs=cuda_graphs, compile=compile, num_slots=num_slots, allow_races=allow_races,
                       inject_delays=inject_delays, timeout=timeout)
    requests = [
        Request(i, p, a.max_new_tokens, SamplingParams(a.temperature, a.top_k, a.top_p, a.seed + i), a.eos_token_id,
                arrival_step=step)
        for i, (p, step) in enumerate(zip(a.prompts, a.arrival_steps))
    ]
    shape = _Shape(a.num_blocks, a.block_size, max_tokens=a.max_tokens, max_keys=a.max_keys, rows=a.rows,
                   num_slots=a.num_slots, cuda_graphs=a.cuda_graphs, compiled=compile,
                   decode=(model.decode_attention, model.decode_kv_bucket))
    timeline = timeline if timeline is not None else Timeline()
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(requests), desc=f"generate ({mode})", unit="req")

    def step_done(plan, done):
        if bar is not None and done:
            bar.update(len(done))
        if on_step is not None:
            on_step(plan, done)

    loop = run_sync if mode == "sync" else run_async
    try:
        with get_device(str(model.device), timeline) as dev:
            cache, slots, runner = _resources(model, dev, shape)
            scheduler = Scheduler(cache.allocator, a.max_batch_tokens, a.max_batch_size)
            for r in requests:
                scheduler.add(r)
            streams = (dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H"))
            loop(runner, scheduler, timeline, dev, streams, slots, step_done, a.timeout, a.inject_delays)
            dev.flush_timeline()
    finally:
        if bar is not None:
            bar.close()
    assert cache.allocator.num_free == cache.allocator.num_blocks, "KV blocks leaked"
    return [r.output for r in requests]


_KEEP = 4  # resource sets kept on a CUDA model (see _resources)


class _Shape(NamedTuple):
    """Everything that fixes the sizes (and so the addresses) of a run's cache, slots and graphs."""

    num_blocks: int
    block_size: int
    max_tokens: int
    max_keys: int
    rows: int
    num_slots: int
    cuda_graphs: bool
    compiled: bool = False
    decode: tuple = ()  # the model's decode attention and key bucket: graphs captured with others don't fit


def _resources(model: Model, dev, shape: _Shape):
    """KV cache, IO slots and step runner for one run.

    CUDA graphs are bound to the addresses of the cache and the slots, so on a GPU the last _KEEP sets
    are kept on the model and reused by the next call of the same shape: graphs are captured once, not
    per call (a server keeps its engine alive the same way). CUDA events carry no tie to the device
    object, so the slots work with each call's new device. The cpu backend builds everything afresh.
    """
    if model.device.type != "cuda":
        return _build(model, dev, shape)
    kept: dict = model.__dict__.setdefault("_resources", {})  # shape -> (cache, slots, runner)
    if shape in kept:
        cache = kept[shape][0]
        if cache.allocator.num_free == cache.allocator.num_blocks:  # not left dirty by a failed run
            return kept[shape]
    kept.pop(shape, None)
    while len(kept) >= _KEEP:  # e.g. sync and async, each with and without compile; free older ones first
        kept.pop(next(iter(kept)))
    kept[shape] = _build(model, dev, shape)
    return kept[shape]


def _build(model: Model, dev, shape: _Shape):
    cache = model.make_cache(shape.num_blocks, shape.block_size)
    slots = [IOSlot(dev, i, shape.max_tokens, shape.max_keys, shape.rows, model.device)
             for i in range(shape.num_slots)]
    return cache, slots, StepRunner(model, cache, use_graphs=shape.cuda_graphs, compiled=shape.compiled)
