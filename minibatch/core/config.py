"""One run's configuration: EngineConfig, every option of a run checked once, and the RunConfig sized from it (notebook 00).

A run (an offline `generate` call, or an engine's serving context) is fixed by a few limits: the
loop (`mode`), the step's token budget (`max_batch_tokens`), how many requests run at once
(`max_batch_size`), the KV cache (`block_size`, `num_blocks`), the IO slots (`num_slots`), CUDA
graphs and torch.compile. `EngineConfig` lists them, with their defaults (None: computed for the
run), and checks each as it is made; `make_config` checks them against the model, fills in the
defaults, sizes the cache and the slots (memory.py) and refuses a run that cannot fit in free
memory, all before anything is allocated. The engine, the loops and the serving thread only read
the `RunConfig` it returns.

Offline, the cache is sized for the prompts of the call; a serving context does not know its
requests in advance, so it is sized for `max_batch_size` requests of the model's whole context.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .args import _bool, _int, _number
from .requests import FIELDS as SAMPLING_FIELDS, SamplingParams
from .device import platform
from .memory import check_memory, run_sizes

MODES = ("sync", "async")
DEFAULT_BLOCK_SIZE = 16  # generate's default, which a model with a shorter context shrinks
SERVING_BATCH_SIZE = 8  # a serving run's max_batch_size unless given: it is sized for the whole context
STAGES = ("H2D", "compute", "D2H")


class Shape(NamedTuple):
    """Everything that fixes the sizes (and so the addresses) of a run's cache, slots and graphs: an
    engine keeps the resources of a shape for the next run of the same shape."""

    num_blocks: int
    block_size: int
    max_tokens: int  # the IO slots' capacities (core/slots.py): tokens, keys and sampled rows of the largest step
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
    prefix_caching: bool = True  # requests share the KV blocks of a common prompt start (prefix_cache.py)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs: the one list of per-run options, checked once, here (every value that does
    not need the model; `make_config` checks the rest against it and sizes the run).

    `mode` picks the loop. `max_batch_tokens` is a step's token budget (prefill chunks are cut to
    fit it); `max_batch_size` caps the requests running at once (None: min(32, max_batch_tokens)
    offline, 8 serving); `block_size` and `num_blocks` size the paged KV cache (None: enough for the
    run's requests). `num_slots` IO slots (None: 1 sync, 2 async); `cuda_graphs` (None: on for a
    CUDA model; "decode": decode steps only) and `compile` (True, or "dynamic": one compile for
    every row count) are CUDA's. `inject_delays` ({"H2D" | "compute" | "D2H": seconds slept on that
    stream before each step}) and `allow_races` (one slot in the async loop) show notebook 04's race.
    `timeout` bounds every host wait on the device (seconds; None or inf: no limit).
    `prefix_caching`: requests share the KV blocks of a prompt start they have in common (on by
    default; the tokens are the same either way: core/prefix_cache.py).
    """

    mode: str = "sync"
    max_batch_tokens: int = 256
    max_batch_size: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    num_slots: int | None = None
    cuda_graphs: bool | str | None = None
    compile: bool | str = False
    inject_delays: Mapping | None = None
    timeout: float | None = 600.0
    allow_races: bool = False
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: the checked (normalised) values replace what was given
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: use one of {MODES}")
        put(self, "max_batch_tokens", _int("max_batch_tokens", self.max_batch_tokens))
        if self.max_batch_size is not None:
            put(self, "max_batch_size", _int("max_batch_size", self.max_batch_size))
            if self.max_batch_tokens < self.max_batch_size:
                raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_batch_size "
                                 f"({self.max_batch_size}): every running request needs room for its decode token")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, numbers.Integral):
            _int("block_size", self.block_size)  # raises, naming it (its upper bound is the model's: _block_size)
        if self.num_blocks is not None:
            put(self, "num_blocks", _int("num_blocks", self.num_blocks))
        if self.num_slots is not None:
            put(self, "num_slots", _int("num_slots", self.num_slots, 1, 2))
        _bool("allow_races", self.allow_races)
        _bool("prefix_caching", self.prefix_caching)
        if self.mode == "async" and self.num_slots == 1 and not self.allow_races:
            raise ValueError("num_slots=1 in the async loop races: the host writes step N+1's inputs into the only "
                             "IO slot while the device may still read step N's, and tokens come out wrong without "
                             "an error (notebook 04). Use num_slots=2 (the default), or pass allow_races=True to "
                             "show the race on purpose")
        if self.cuda_graphs is not None and self.cuda_graphs != "decode" and not isinstance(self.cuda_graphs, bool):
            raise TypeError(f'cuda_graphs must be True, False, "decode" or None, got {self.cuda_graphs!r}')
        if self.compile != "dynamic" and not isinstance(self.compile, bool):
            raise TypeError(f'compile must be True, False or "dynamic", got {self.compile!r}')
        put(self, "timeout", _timeout(self.timeout))
        put(self, "inject_delays", _delays(self.inject_delays))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with some options changed (checked again)."""
        return dataclasses.replace(self, **changes)


FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def serving_config(model, config: EngineConfig, reusable_bytes: int = 0) -> RunConfig:
    """A serving run's RunConfig: sized once, for `max_batch_size` requests (default 8) of the model's
    whole context (or `num_blocks` KV blocks), and checked as make_config checks any run.
    `Serving` (minibatch/serving/service.py) opens its run with it; a server calls it before it
    listens, so bad limits are refused before any client connects.

    CUDA graphs default to decode steps only here (`cuda_graphs="decode"`), where an offline run
    graphs every step: a serving run's prefill and mixed steps take their shapes from when requests
    happened to arrive, so most of those shapes come up a few times at most, and capturing one (an
    eager run, a drained device, the capture, the replay) costs more than its replays save. Decode
    shapes recur for as long as the batch keeps its size. Measured in BENCHMARKS.md (Serving).

    `compile=True` means "dynamic" here: one compile of the decode step for every row count
    (speed/compiled.py), where a static compile per row count would stall every request each time
    the traffic brings a batch size it has not seen."""
    changes = {}
    if config.max_batch_size is None:
        changes["max_batch_size"] = SERVING_BATCH_SIZE
    if config.cuda_graphs is None and platform(model.device).graphs:
        changes["cuda_graphs"] = "decode"
    if config.compile is True and platform(model.device).compiles:  # (elsewhere refused by make_config, as asked)
        changes["compile"] = "dynamic"
    config = config.replace(**changes) if changes else config
    context = model.max_positions or 2048  # (a model that names no context: sized for 2048 tokens)
    if config.num_blocks is not None:  # a given cache: requests longer than it holds are refused at submit
        context = min(context, config.num_blocks * config.block_size)
    return make_config(model, config, [context] * config.max_batch_size, 1, reusable_bytes)


def make_config(model, config: EngineConfig, lengths: list[int], max_new_tokens: int,
                reusable_bytes: int = 0) -> RunConfig:
    """Check `config` against the model (compile and CUDA graphs need a CUDA model, a KV block holds at
    most its context), fill in the defaults, size the run for requests of `lengths` prompt tokens and
    `max_new_tokens` new ones, and check that it fits in free memory (ValueError/TypeError naming
    the first bad option). `reusable_bytes`: memory an engine's kept resources would give back."""
    can = platform(model.device)
    block_size = _block_size(model, config.block_size)
    max_batch_size = config.max_batch_size or min(32, config.max_batch_tokens)
    compile = config.compile
    if compile and not can.compiles:
        raise ValueError(f"compile={compile!r} is for CUDA models; this model is on {model.device} (the CPU path stays "
                         "eager: compiling would take longer than the tiny model's whole run)")
    cuda_graphs = can.graphs if config.cuda_graphs is None else config.cuda_graphs
    if cuda_graphs and not can.graphs:
        raise ValueError(f"cuda_graphs={cuda_graphs!r} needs a CUDA model; this model is on {model.device}")
    num_slots = config.num_slots or (2 if config.mode == "async" else 1)
    sizes = run_sizes(model, config, lengths, max_new_tokens, max_batch_size, block_size)
    shape = Shape(sizes[0], block_size, *sizes[1:], num_slots, cuda_graphs, compile,
                  decode=(model.decode_attention, model.decode_kv_bucket))
    check_memory(model, shape, given_blocks=config.num_blocks is not None, reusable=reusable_bytes)
    return RunConfig(config.mode, config.max_batch_tokens, max_batch_size, shape, config.timeout,
                     config.inject_delays, config.prefix_caching)


def split_options(params, config, options: Mapping[str, Any], where: str) -> tuple[SamplingParams, "EngineConfig"]:
    """(a SamplingParams, an EngineConfig): `params` and `config` (or their defaults) with the keyword
    `options` applied, each name to the one of the two that has it; a name that neither has is refused
    as Python refuses an unexpected keyword argument, naming both lists."""
    unknown = sorted(set(options) - SAMPLING_FIELDS - FIELDS)
    if unknown:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}: per-request options are "
                        f"{sorted(SAMPLING_FIELDS)} (SamplingParams), per-run options {sorted(FIELDS)} (EngineConfig)")
    return (with_options(SamplingParams, params, {k: v for k, v in options.items() if k in SAMPLING_FIELDS}, where),
            with_options(EngineConfig, config, {k: v for k, v in options.items() if k in FIELDS}, where))


def with_options(cls, given, options: Mapping[str, Any], where: str):
    """`given` (a `cls`: SamplingParams or EngineConfig; None for its defaults) with `options` (fields
    of `cls` by name) changed, checked again."""
    if given is not None and not isinstance(given, cls):
        raise TypeError(f"{where} takes a minibatch {cls.__name__} or None, got {given!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}: its options are "
                        f"{sorted(fields)} ({cls.__name__})")
    return (given or cls()).replace(**options)


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
