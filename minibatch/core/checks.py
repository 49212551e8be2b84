"""The argument checks of `generate` and `submit` that need the model: one pass, before any work starts.

The options themselves are checked where they are defined, once: per request in SamplingParams
(core/requests.py), per run in EngineConfig (config.py). Why check at all: a bad value that gets
past the top of `generate` surfaces much later and far from its cause: a float `top_k` silently
truncated, a `seed` that overflows int64 in batch.py, a `timeout=nan` that busy-waits forever, a
`max_batch_tokens=10**9` that allocates gigabytes of IO buffers, or (worst) the async loop with one
IO slot, which returns wrong tokens without a word (notebook 04's race). Here every argument is checked for its type (ints are ints, not floats or
bools), finiteness, range and size; each error names the argument, the value and what is allowed.

Memory is checked by estimate (memory.py): the KV cache and the IO slots are sized from the
arguments and compared with the memory free on the model's device, so a run that cannot fit fails at
once with the number, instead of swapping or dying in the allocator.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from .args import INT64_MAX, _bool, _int
from .requests import SamplingParams
from .timeline import Timeline


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


def check_prompts(model, prompts: Any, params: SamplingParams) -> tuple[list[list[int]], SamplingParams]:
    """The prompts as token ids, and `params` checked against the model, for a call that continues
    each prompt with `params` (prompt i seeded seed + i): every prompt fits the model's context."""
    token_ids = token_lists(prompts, model)
    params = params.for_model(model)
    _int("seed", params.seed, low=0, high=INT64_MAX - (len(token_ids) - 1))  # request i samples with seed + i
    limit = model.max_positions
    for i, p in enumerate(token_ids):
        if limit and len(p) + params.max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={params.max_new_tokens} it would "
                             f"exceed the model's {limit} positions (its context, max_position_embeddings)")
    return token_ids, params


def check_run(n: int, *, arrival_steps, timeline, on_step, progress) -> list[int]:
    """generate's arguments that are neither per request nor per engine; the arrival step of each prompt."""
    if arrival_steps is None:
        arrival_steps = [0] * n
    if isinstance(arrival_steps, (str, bytes)) or not isinstance(arrival_steps, Sequence) or len(arrival_steps) != n:
        raise ValueError(f"arrival_steps needs one integer >= 0 per prompt ({n}) in a list or tuple, got "
                         f"{arrival_steps!r}")
    if timeline is not None and not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a minibatch.Timeline or None, got {type(timeline).__name__}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function on_step(plan, finished) or None, got {on_step!r}")
    _bool("progress", progress)
    return [_int(f"arrival_steps[{i}]", a, low=0) for i, a in enumerate(arrival_steps)]
