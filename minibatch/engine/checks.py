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

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..args import INT64_MAX, _bool, _int, _number
from .config import MODES, RunConfig, make_config
from ..timeline import Timeline



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
    """`generate`'s per-request arguments after the checks, and the run's configuration."""

    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_k: int  # clamped to the vocabulary size: a larger top_k keeps every token, as top_k=0 does
    top_p: float
    seed: int
    eos_token_id: int | frozenset[int] | None
    arrival_steps: list[int]
    config: RunConfig


class RequestArgs(NamedTuple):
    """One request's arguments after the checks (`check_request`)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos_token_id: int | frozenset[int] | None
    stop: tuple[str, ...]


def check_sampling(model, n: int, max_new_tokens, temperature, top_k, top_p, seed) -> tuple:
    """(max_new_tokens, temperature, top_k, top_p, seed) checked, for `n` requests seeded seed .. seed + n - 1."""
    max_new_tokens = _int("max_new_tokens", max_new_tokens)
    temperature = _number("temperature", temperature, ">= 0 (0 is greedy)", lambda v: v >= 0)
    top_k = min(_int("top_k", top_k, low=0), model.vocab_size)
    top_p = _number("top_p", top_p, "in (0, 1]", lambda v: 0 < v <= 1)
    seed = _int("seed", seed, low=0, high=INT64_MAX - (n - 1))  # request i samples with seed + i
    return max_new_tokens, temperature, top_k, top_p, seed


def check_lengths(model, token_ids: list[list[int]], max_new_tokens: int) -> None:
    limit = model.max_positions
    for i, p in enumerate(token_ids):
        if limit and len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it would "
                             f"exceed the model's context of {limit} positions (max_position_embeddings)")


def check_generate(model, prompts, *, max_new_tokens, mode, temperature, top_k, top_p, seed, eos_token_id,
                   timeline, progress, arrival_steps, on_step, reusable_bytes: int = 0, **limits) -> GenerateArgs:
    """Check every argument of `generate` (see its docstring); raise TypeError/ValueError naming the first
    bad one. `limits` are the run's (config.make_config)."""
    from ..model.model import Model

    if not isinstance(model, Model):
        raise TypeError(f"model must come from minibatch.load_model, got {type(model).__name__}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
    token_ids = token_lists(prompts, model)
    n = len(token_ids)
    max_new_tokens, temperature, top_k, top_p, seed = check_sampling(model, n, max_new_tokens, temperature,
                                                                     top_k, top_p, seed)
    eos = eos_ids(eos_token_id, model.vocab_size)
    check_lengths(model, token_ids, max_new_tokens)
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
    config = make_config(model, mode, [len(p) for p in token_ids], max_new_tokens, reusable_bytes=reusable_bytes,
                         **limits)
    return GenerateArgs(token_ids, max_new_tokens, temperature, top_k, top_p, seed, eos, arrival_steps, config)


def check_request(model, prompt, *, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                  stop) -> RequestArgs:
    """Check one submitted request's arguments (`Engine.submit`), as `generate` checks its own."""
    (ids,) = token_lists([prompt], model)
    max_new_tokens, temperature, top_k, top_p, seed = check_sampling(model, 1, max_new_tokens, temperature,
                                                                     top_k, top_p, seed)
    eos = eos_ids(eos_token_id, model.vocab_size)
    check_lengths(model, [ids], max_new_tokens)
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"stop must be a string, a list of non-empty strings or None, got {stop!r}")
    if stop and model.tokenizer is None:
        raise ValueError(f"stop strings need a tokenizer to decode text, and model {model.name!r} has none")
    return RequestArgs(ids, max_new_tokens, temperature, top_k, top_p, seed, eos, tuple(stop))
