"""One run's configuration: every limit and size, its default computed once and checked once (notebook 00).

A run (an offline `generate` call, or an engine's serving context) is fixed by a few limits: the
loop (`mode`), the step's token budget (`max_batch_tokens`), how many requests run at once
(`max_batch_size`), the KV cache (`block_size`, `num_blocks`), the IO slots (`num_slots`), CUDA
graphs and torch.compile. `make_config` takes them as the user gave them (None: the default), checks
each, fills in the defaults, sizes the cache and the slots (memory.py) and refuses a run that cannot
fit in free memory, all before anything is allocated. The engine, the loops and the serving thread
only read the `RunConfig` it returns.

Offline, the cache is sized for the prompts of the call; a serving context does not know its
requests in advance, so it is sized for `max_batch_size` requests of the model's whole context.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..args import _bool, _int, _number
from .memory import check_memory, run_sizes

MODES = ("sync", "async")
DEFAULT_BLOCK_SIZE = 16  # generate's default, which a model with a shorter context shrinks
STAGES = ("H2D", "compute", "D2H")


class Shape(NamedTuple):
    """Everything that fixes the sizes (and so the addresses) of a run's cache, slots and graphs: an
    engine keeps the resources of a shape for the next run of the same shape."""

    num_blocks: int
    block_size: int
    max_tokens: int  # the IO slots' capacities (batching/slots.py): tokens, keys and sampled rows of the largest step
    max_keys: int
    rows: int
    num_slots: int
    cuda_graphs: bool | str  # True, False or "decode" (decode steps only)
    compiled: bool | str = False  # False, True or "dynamic" (one compile for every row count: compiled.py)
    decode: tuple = ()  # the model's decode attention and key bucket: graphs captured with others don't fit


@dataclass(frozen=True)
class RunConfig:
    """The checked limits of one run, defaults filled in; `shape` sizes its resources."""

    mode: str
    max_batch_tokens: int
    max_batch_size: int
    shape: Shape
    timeout: float | None  # every host wait on the device, seconds (None: no limit)
    inject_delays: dict = field(default_factory=dict)  # {"H2D" | "compute" | "D2H": seconds before each step}


def serving_config(model, mode: str = "async", *, max_batch_size: Any = 8, max_batch_tokens: Any = 256,
                   block_size: Any = 16, num_blocks: Any = None, reusable_bytes: int = 0, **limits) -> RunConfig:
    """A serving run's RunConfig: sized once, for `max_batch_size` requests of the model's whole context
    (or `num_blocks` KV blocks), and checked as make_config checks any run. `Engine.serving` opens its run
    with it; a server calls it before it listens, so bad limits are refused before any client connects.

    CUDA graphs default to decode steps only here (`cuda_graphs="decode"`), where an offline run
    graphs every step: a serving run's prefill and mixed steps take their shapes from when requests
    happened to arrive, so most of those shapes come up a few times at most, and capturing one (an
    eager run, a drained device, the capture, the replay) costs more than its replays save. Decode
    shapes recur for as long as the batch keeps its size. Measured in BENCHMARKS.md (Serving).

    `compile=True` means "dynamic" here: one compile of the decode step for every row count
    (runner/compiled.py), where a static compile per row count would stall every request each time
    the traffic brings a batch size it has not seen."""
    if limits.get("cuda_graphs") is None and model.device.type == "cuda":
        limits["cuda_graphs"] = "decode"
    if limits.get("compile") is True and model.device.type == "cuda":  # (elsewhere refused below, as asked)
        limits["compile"] = "dynamic"
    max_batch_size, block_size = _int("max_batch_size", max_batch_size), _int("block_size", block_size)
    context = model.max_positions or 2048  # (a model that names no context: sized for 2048 tokens)
    if num_blocks is not None:  # a given cache: requests longer than it holds are refused at submit
        context = min(context, _int("num_blocks", num_blocks) * block_size)
    return make_config(model, mode, [context] * max_batch_size, 1, max_batch_size=max_batch_size,
                       max_batch_tokens=max_batch_tokens, block_size=block_size, num_blocks=num_blocks,
                       reusable_bytes=reusable_bytes, **limits)


def make_config(model, mode: str, lengths: list[int], max_new_tokens: int, *, max_batch_size: Any = None,
                max_batch_tokens: Any = 256, block_size: Any = 16, num_blocks: Any = None, num_slots: Any = None,
                cuda_graphs: Any = None, compile: Any = False, inject_delays: Any = None, timeout: Any = 600.0,
                allow_races: Any = False, reusable_bytes: int = 0) -> RunConfig:
    """Check a run's limits, fill in the defaults, size the run for requests of `lengths` prompt tokens
    and `max_new_tokens` new ones, and check that it fits in free memory (ValueError/TypeError naming
    the first bad argument)."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
    cuda = model.device.type == "cuda"
    max_batch_tokens = _int("max_batch_tokens", max_batch_tokens)
    block_size = _block_size(model, block_size)
    max_batch_size = min(32, max_batch_tokens) if max_batch_size is None else _int("max_batch_size", max_batch_size)
    if max_batch_tokens < max_batch_size:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_batch_size ({max_batch_size}): "
                         "every running request needs room for its decode token")
    compile = _compile(compile)
    if compile and not cuda:
        raise ValueError(f"compile={compile!r} is for CUDA models; this model is on {model.device} (the CPU path stays "
                         "eager: compiling would take longer than the tiny model's whole run)")
    cuda_graphs = _cuda_graphs(cuda_graphs, cuda, model.device)
    num_slots = (2 if mode == "async" else 1) if num_slots is None else _int("num_slots", num_slots, 1, 2)
    _bool("allow_races", allow_races)
    if mode == "async" and num_slots == 1 and not allow_races:
        raise ValueError("num_slots=1 in the async loop races: the host writes step N+1's inputs into the only "
                         "IO slot while the device may still read step N's, and tokens come out wrong without "
                         "an error (notebook 04). Use num_slots=2 (the default), or pass allow_races=True to "
                         "show the race on purpose")
    timeout, delays = _timeout(timeout), _delays(inject_delays)
    num_blocks = None if num_blocks is None else _int("num_blocks", num_blocks)
    sizes = run_sizes(model, lengths, max_new_tokens, max_batch_size, max_batch_tokens, block_size, num_blocks,
                      min_rows=2 if compile == "dynamic" else 1)
    check_memory(model, *sizes, block_size, num_slots, given_blocks=num_blocks is not None, reusable=reusable_bytes)
    shape = Shape(sizes[0], block_size, *sizes[1:], num_slots, cuda_graphs, compile,
                  decode=(model.decode_attention, model.decode_kv_bucket))
    return RunConfig(mode, max_batch_tokens, max_batch_size, shape, timeout, delays)


def _block_size(model, block_size: Any) -> int:
    """A block serves one request, so it holds at most the model's context. The default (16) shrinks to a
    shorter context; any other size beyond it is refused, naming the context as the limit."""
    context = model.max_positions
    if block_size == DEFAULT_BLOCK_SIZE and not isinstance(block_size, bool) and context and context < block_size:
        return context
    try:
        return _int("block_size", block_size, high=context or None)
    except ValueError as exc:
        if context and isinstance(block_size, numbers.Integral) and block_size > context:
            raise ValueError(f"{exc}: the model's context (max_position_embeddings={context}) is the limit, as a "
                             "KV block serves one request") from None
        raise


def _compile(compile: Any) -> bool | str:
    if compile != "dynamic" and not isinstance(compile, bool):
        raise TypeError(f'compile must be True, False or "dynamic", got {compile!r}')
    return compile


def _cuda_graphs(cuda_graphs: Any, cuda: bool, device) -> bool | str:
    if cuda_graphs is None:
        return cuda
    if cuda_graphs != "decode" and not isinstance(cuda_graphs, bool):
        raise TypeError(f'cuda_graphs must be True, False, "decode" or None, got {cuda_graphs!r}')
    if cuda_graphs and not cuda:
        raise ValueError(f"cuda_graphs={cuda_graphs!r} needs a CUDA model; this model is on {device}")
    return cuda_graphs


def _timeout(timeout: Any) -> float | None:
    """None or a finite number of seconds > 0; inf means no limit (None)."""
    if timeout is None or (isinstance(timeout, float) and timeout == float("inf")):
        return None
    return _number("timeout", timeout, "of seconds > 0 (or None: no limit)", lambda v: v > 0)


def _delays(delays: Any) -> dict[str, float]:
    if delays is None:
        return {}
    if not isinstance(delays, Mapping):
        raise TypeError(f"inject_delays must be a dict like {{'H2D': 0.03}} (keys {STAGES}), got {delays!r}")
    if set(delays) - set(STAGES):
        raise ValueError(f"inject_delays keys must be 'H2D', 'compute' or 'D2H', got {sorted(map(str, delays))}")
    # a delay longer than timeout is allowed: it is how a stuck device is simulated (tests/test_faults.py)
    return {stage: _number(f"inject_delays[{stage!r}]", s, "of seconds >= 0", lambda v: v >= 0)
            for stage, s in delays.items()}
