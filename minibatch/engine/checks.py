"""The argument checks of `generate` and `load_model`: one pass each, before any work starts.

Why a separate pass: a bad value that gets past the top of `generate` surfaces much later and far
from its cause: a float `top_k` silently truncated, a `seed` that overflows int64 in batch.py, a
`timeout=nan` that busy-waits forever, a `max_batch_tokens=10**9` that allocates gigabytes of IO
buffers, or (worst) the async loop with one IO slot, which returns wrong tokens without a word
(notebook 04's race). Here every argument is checked for its type (ints are ints, not floats or
bools), finiteness, range and size; each error names the argument, the value and what is allowed.

Memory is checked by estimate (memory.py): the KV cache and the IO slots are sized from the
arguments and compared with the memory free on the model's device, so a run that cannot fit fails at
once with the number, instead of swapping or dying in the allocator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..args import INT64_MAX, _bool, _int, _number
from .memory import check_memory, run_sizes
from ..timeline import Timeline

MODES = ("sync", "async")
STAGES = ("H2D", "compute", "D2H")


def token_lists(prompts: Any, model) -> list[list[int]]:
    """Prompts as lists of token ids: strings go through the model's tokenizer; bytes are refused."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a string), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (bytes, bytearray)):  # else taken as raw byte ids: say what to pass instead
            raise TypeError(f"prompt {i} is {type(p).__name__}: pass a string (decoded text) or a list of token ids")
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but model {model.name!r} has no tokenizer: "
                                 "pass token ids instead")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt {i} cannot be encoded as UTF-8 text (character {e.start}: {e.reason}, "
                                 "e.g. a lone surrogate)") from None
            p = list(model.tokenizer.encode(p))
        if isinstance(p, torch.Tensor):
            p = p.tolist() if p.dim() == 1 and not p.is_floating_point() else [p]
        if not isinstance(p, Sequence) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                  for t in p):
            raise TypeError(f"prompt {i} must be a string or a list of int token ids")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {model.vocab_size})")
        out.append([int(t) for t in p])
    return out


def eos_ids(eos: Any, vocab_size: int) -> int | frozenset[int] | None:
    """None, one id, or several (Llama-3's generation config lists several), each inside the vocabulary."""
    if eos is None:
        return None
    one = isinstance(eos, numbers.Integral) and not isinstance(eos, bool)
    ids = [eos] if one else list(eos) if isinstance(eos, (list, tuple, set, frozenset)) else None
    if not ids or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return int(ids[0]) if one else frozenset(int(t) for t in ids)


class GenerateArgs(NamedTuple):
    """`generate`'s arguments after the checks, with every size the run will allocate."""

    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_k: int  # clamped to the vocabulary size: a larger top_k keeps every token, as top_k=0 does
    top_p: float
    seed: int
    eos_token_id: int | frozenset[int] | None
    arrival_steps: list[int]
    max_batch_size: int
    max_batch_tokens: int
    block_size: int
    num_blocks: int
    num_slots: int
    cuda_graphs: bool | str
    inject_delays: dict[str, float]
    timeout: float | None  # None: no limit
    max_tokens: int  # the IO slots' capacities (slots.py): tokens, keys and sampled rows of the largest step
    max_keys: int
    rows: int


DEFAULT_BLOCK_SIZE = 16  # generate's default, which a model with a shorter context shrinks


def check_generate(model, prompts, *, max_new_tokens, mode, temperature, top_k, top_p, seed, eos_token_id,
                   timeline, max_batch_size, max_batch_tokens, block_size, num_blocks, progress, arrival_steps,
                   on_step, cuda_graphs, compile, num_slots, allow_races, inject_delays, timeout,
                   reusable_bytes: int = 0) -> GenerateArgs:
    """Check every argument of `generate` (see its docstring); raise TypeError/ValueError naming the first bad one."""
    from ..model.model import Model

    if not isinstance(model, Model):
        raise TypeError(f"model must come from minibatch.load_model, got {type(model).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
    cuda = model.device.type == "cuda"
    max_new_tokens = _int("max_new_tokens", max_new_tokens)
    max_batch_tokens = _int("max_batch_tokens", max_batch_tokens)
    block_size = _block_size(block_size, model.max_positions)
    max_batch_size = min(32, max_batch_tokens) if max_batch_size is None else _int("max_batch_size", max_batch_size)
    if max_batch_tokens < max_batch_size:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_batch_size ({max_batch_size}): "
                         "every running request needs room for its decode token")
    temperature = _number("temperature", temperature, ">= 0 (0 is greedy)", lambda v: v >= 0)
    top_k = min(_int("top_k", top_k, low=0), model.vocab_size)
    top_p = _number("top_p", top_p, "in (0, 1]", lambda v: 0 < v <= 1)
    token_ids = token_lists(prompts, model)
    n = len(token_ids)
    seed = _int("seed", seed, low=0, high=INT64_MAX - (n - 1))  # request i samples with seed + i
    eos = eos_ids(eos_token_id, model.vocab_size)
    limit = model.max_positions
    for i, p in enumerate(token_ids):
        if limit and len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it would "
                             f"exceed the model's {limit} positions")
    if arrival_steps is None:
        arrival_steps = [0] * n
    if isinstance(arrival_steps, (str, bytes)) or not isinstance(arrival_steps, Sequence) or len(arrival_steps) != n:
        raise ValueError(f"arrival_steps needs one integer >= 0 per prompt ({n}) in a list or tuple, got "
                         f"{arrival_steps!r}")
    arrival_steps = [_int(f"arrival_steps[{i}]", a, low=0) for i, a in enumerate(arrival_steps)]
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a minibatch.Timeline or None, got {type(timeline).__name__}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function on_step(plan, finished) or None, got {on_step!r}")
    _bool("progress", progress)
    _bool("compile", compile)
    if compile and not cuda:
        raise ValueError(f"compile=True is for CUDA models; this model is on {model.device} (the CPU path stays "
                         "eager: compiling would take longer than the tiny model's whole run)")
    if cuda_graphs is None:
        cuda_graphs = cuda
    elif cuda_graphs != "decode" and not isinstance(cuda_graphs, bool):
        raise TypeError(f'cuda_graphs must be True, False, "decode" or None, got {cuda_graphs!r}')
    if cuda_graphs and not cuda:
        raise ValueError(f"cuda_graphs={cuda_graphs!r} needs a CUDA model; this model is on {model.device}")
    num_slots = (2 if mode == "async" else 1) if num_slots is None else _int("num_slots", num_slots, 1, 2)
    _bool("allow_races", allow_races)
    if mode == "async" and num_slots == 1 and not allow_races:
        raise ValueError("num_slots=1 in the async loop races: the host writes step N+1's inputs into the only "
                         "IO slot while the device may still read step N's, and tokens come out wrong without "
                         "an error (notebook 04). Use num_slots=2 (the default), or pass allow_races=True to "
                         "show the race on purpose")
    timeout = _timeout(timeout)
    delays = _delays(inject_delays)
    num_blocks = None if num_blocks is None else _int("num_blocks", num_blocks)
    sizes = run_sizes(model, token_ids, max_new_tokens, max_batch_size, max_batch_tokens, block_size, num_blocks)
    check_memory(model, *sizes, block_size, num_slots, given_blocks=num_blocks is not None, reusable=reusable_bytes)
    return GenerateArgs(token_ids, max_new_tokens, temperature, top_k, top_p, seed, eos, arrival_steps,
                        max_batch_size, max_batch_tokens, block_size, sizes[0], num_slots, cuda_graphs, delays,
                        timeout, *sizes[1:])


def _block_size(block_size: Any, context: int | None) -> int:
    """A block serves one request, so it holds at most the model's context. The default (16) shrinks to a
    shorter context; any other size beyond it is refused, naming the context as the limit."""
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
    if timeout is None:
        return None
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout == math.inf:
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
