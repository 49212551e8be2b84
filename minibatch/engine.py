"""`minibatch.generate`: check the input, set up cache, slots and scheduler, run a loop (notebook 00;
the loops themselves are notebooks 01 and 06).

The sync and async loops share everything here; `mode` only picks which loop runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .async_loop import run_async
from .batch import bucket
from .device import get_device
from .graphs import ROW_BUCKETS, StepRunner
from .model import Model
from .requests import Request, SamplingParams
from .scheduler import Scheduler
from .slots import IOSlot
from .sync_loop import run_sync
from .timeline import Timeline

MODES = ("sync", "async")


def _as_token_lists(prompts, model: Model) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a string), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but model {model.name!r} has no tokenizer: "
                                 "pass token ids instead")
            p = list(model.tokenizer.encode(p))
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise TypeError(f"prompt {i} must be a string or a list of int token ids")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {model.vocab_size})")
        out.append(list(p))
    return out


def _eos_ids(eos, vocab_size: int) -> int | frozenset[int] | None:
    """None, one id, or several (Llama-3's generation config lists several), each inside the vocabulary."""
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else list(eos) if isinstance(
        eos, (list, tuple, set, frozenset)) else None
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids[0] if isinstance(eos, int) else frozenset(ids)


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
    inject_delays: dict[str, float] | None = None,
    timeout: float | None = 600.0,
) -> list[list[int]]:
    """Continue every prompt; return the new tokens of each, in prompt order.

    Greedy when temperature == 0. Request i samples with seed `seed + i`, so results do not depend
    on batching. Generation of a request stops at `eos_token_id` (included in its output) or after
    `max_new_tokens`. `max_batch_tokens` is the token budget of one step (prefill chunks are cut to
    fit it); `max_batch_size` caps the requests running at once (default min(32, max_batch_tokens));
    `num_blocks` sizes the paged KV cache (default: enough for `max_batch_size` of the longest
    requests). `timeout` bounds every host wait on the device (seconds): a device that
    stops making progress raises instead of hanging. `arrival_steps[i]` (optional) is the step at
    which prompt i reaches the server, to simulate requests arriving while the loop runs.
    `cuda_graphs` (default: on for a CUDA model) replays decode steps as CUDA graphs (graphs.py).
    `compile=True` (CUDA only) runs decode steps through torch.compile first (Model.compiled_step).
    `num_slots` (default 1 for sync, 2 for async) and `inject_delays` ({"H2D" | "compute" | "D2H":
    seconds slept on that stream before each step's work) exist to show the race of notebook 04.
    `on_step(plan, finished)` is called on the host after each step's tokens are applied (live plots).
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must come from minibatch.load_model, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
    for name, value in (("max_new_tokens", max_new_tokens), ("max_batch_tokens", max_batch_tokens),
                        ("block_size", block_size), ("max_batch_size", max_batch_size), ("num_blocks", num_blocks)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_batch_size is None:
        max_batch_size = min(32, max_batch_tokens)
    if max_batch_tokens < max_batch_size:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_batch_size ({max_batch_size}): "
                         "every running request needs room for its decode token")
    token_lists = _as_token_lists(prompts, model)
    eos_token_id = _eos_ids(eos_token_id, model.vocab_size)
    limit = model.max_positions
    for i, p in enumerate(token_lists):
        if limit and len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it would "
                             f"exceed the model's {limit} positions")
    if arrival_steps is None:
        arrival_steps = [0] * len(token_lists)
    if len(arrival_steps) != len(token_lists) or any(
            not isinstance(a, int) or isinstance(a, bool) or a < 0 for a in arrival_steps):
        raise ValueError("arrival_steps needs one integer >= 0 per prompt")
    requests = [
        Request(i, p, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed + i), eos_token_id,
                arrival_step=a)
        for i, (p, a) in enumerate(zip(token_lists, arrival_steps))
    ]
    if num_slots is None:
        num_slots = 2 if mode == "async" else 1
    if num_slots not in (1, 2):
        raise ValueError(f"num_slots must be 1 or 2, got {num_slots!r}")
    if inject_delays and set(inject_delays) - {"H2D", "compute", "D2H"}:
        raise ValueError(f"inject_delays keys must be 'H2D', 'compute' or 'D2H', got {sorted(inject_delays)}")
    if cuda_graphs is None:
        cuda_graphs = model.device.type == "cuda"
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if compile and model.device.type != "cuda":
        raise ValueError(f"compile=True is for CUDA models; this model is on {model.device} (the CPU path stays "
                         "eager: compiling would take longer than the tiny model's whole run)")
    if num_blocks is None:
        need = sorted((-(-r.max_len // block_size) for r in requests), reverse=True)
        num_blocks = sum(need[:max_batch_size])
    # capacities of the IO slots: the largest step, with the padding the graph layout may add (batch.py)
    rows = bucket(max_batch_size, ROW_BUCKETS)
    longest = max(r.max_len + 1 for r in requests)
    width = max(-(-longest // b) * b for b in (model.kv_bucket, model.decode_kv_bucket))
    shape = _Shape(num_blocks, block_size, max_tokens=max(max_batch_tokens, rows),
                   max_keys=max(num_blocks * block_size + model.kv_bucket, rows * width), rows=rows,
                   num_slots=num_slots, cuda_graphs=cuda_graphs, compiled=bool(compile),
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
            scheduler = Scheduler(cache.allocator, max_batch_tokens, max_batch_size)
            for r in requests:
                scheduler.add(r)
            streams = (dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H"))
            loop(runner, scheduler, timeline, dev, streams, slots, step_done, timeout, inject_delays)
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
