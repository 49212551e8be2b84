"""Requests and their life cycle (notebook 01).

A request is one prompt the user wants continued. The scheduler moves it through four states:

    WAITING ──admit──▶ PREFILLING ──last prompt chunk──▶ DECODING ──EOS / length──▶ FINISHED
                       (one chunk of the prompt           (one new token
                        per step, under a token budget)     per step)

A request served online can also finish early from any state: a stop string found in its text, or a
cancel (`Scheduler.finish`, notebook 08).

Everything here lives on the host (CPU side). The device never sees a `Request`; it sees the flat
tensors that `batch.py` builds from the scheduler's plan.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .args import INT64_MAX, _int, _number


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued: the one list of per-request options, checked once, here.

    `generate(..., temperature=0.7)`, `Serving.submit(...)` and the HTTP server all build one of
    these, so a bad value gets the same error wherever it comes from. temperature == 0 means greedy
    (argmax); `top_k=0` and `top_p=1.0` switch those filters off. Generation stops at an
    `eos_token_id` (kept in the output), after `max_new_tokens`, or (online) where the text holds
    one of the `stop` strings. What needs the model (ids inside its vocabulary, a tokenizer for stop
    strings) is checked by `for_model`.

    `min_tokens` holds back the end-of-sequence ids (eos_token_id) until that many tokens are out.
    `logprobs=k` also returns, for every generated token, its log-probability and the k most likely
    tokens of that step with theirs (0: the token's own only; None: nothing); `prompt_logprobs=k`
    the same for every prompt token after the first, from the prefill (it scores the prompt, as
    lm-eval's loglikelihood tasks do; `max_new_tokens=0` then generates nothing). Both are computed
    on the device in the step that samples, from the model's raw logits (before temperature or
    filters), at most MAX_LOGPROBS alternatives.

    Penalties make repeats less likely (OpenAI's and vLLM's meanings; 0, 0 and 1 are off): each step,
    a token's logit loses `presence_penalty` once if it is in the output so far, and `frequency_penalty`
    for every time it is; `repetition_penalty` r divides a positive logit (multiplies a negative one)
    of every token seen in the prompt or the output (Hugging Face's and vLLM's). They apply before
    temperature and filters, and not to the logprobs (raw logits, as above). core/penalties.py.

    Sampling is seeded per request: the random numbers for a request's k-th generated token depend
    only on (seed, k), never on which other requests share the batch, so a sync run and an async run
    (whose batches differ) give the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int = 0
    max_new_tokens: int = 64
    eos_token_id: int | frozenset[int] | None = None  # one id, or several (Llama-3 lists several)
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # no end-of-sequence token before this many new tokens (its logits are set to -inf)
    logprobs: int | None = None  # top alternatives per generated token (0: its own logprob only)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: a seen token's logit is divided by it (if > 0) or multiplied

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: the checked (normalised) values replace what was given
        put(self, "temperature", _number("temperature", self.temperature, ">= 0 (0 is greedy)", lambda v: v >= 0))
        put(self, "top_k", _int("top_k", self.top_k, low=0))
        put(self, "top_p", _number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        put(self, "seed", _int("seed", self.seed, low=0, high=INT64_MAX))  # travels to the device as int64
        put(self, "max_new_tokens", _int("max_new_tokens", self.max_new_tokens, low=0))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(self, name, _int(name, getattr(self, name), low=0, high=MAX_LOGPROBS))
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_new_tokens must be an integer >= 1, got 0 (0 only scores a prompt: give "
                             "prompt_logprobs too)")
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _number(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2))
        put(self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty, "> 0 (1 is off)",
                                                lambda v: v > 0))
        # some penalty is on: the device needs this request's earlier tokens each step it samples (not a
        # field: an attribute read once per row per step, where a property's comparisons would cost more)
        put(self, "penalized", self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)
        put(self, "eos_token_id", _eos(self.eos_token_id))
        put(self, "stop", _stops(self.stop))
        put(self, "min_tokens", _int("min_tokens", self.min_tokens, low=0, high=self.max_new_tokens))
        ends = 1 if isinstance(self.eos_token_id, int) else len(self.eos_token_id or ())
        if self.min_tokens and ends > MAX_BANNED:
            raise ValueError(f"min_tokens holds back at most {MAX_BANNED} end-of-sequence ids, and this request has "
                             f"{ends} (eos_token_id and stop_token_ids)")

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some options changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def for_model(self, model) -> "SamplingParams":
        """These options checked against a model: eos ids inside its vocabulary, a tokenizer to match
        stop strings; a `top_k` beyond the vocabulary keeps every token (as 0 does), so it is clamped."""
        eos = self.eos_token_id
        bad = sorted(t for t in ([eos] if isinstance(eos, int) else eos or ()) if not 0 <= t < model.vocab_size)
        if bad:
            raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
        if self.stop and model.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer to decode text, and model {model.name!r} has none")
        return self.replace(top_k=min(self.top_k, model.vocab_size)) if self.top_k > model.vocab_size else self


FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
MAX_LOGPROBS = 20  # alternatives per token the device computes for every row of a step that asks (OpenAI's limit)
MAX_BANNED = 8  # end-of-sequence ids a row can hold back (min_tokens): a fixed width, as a CUDA graph needs


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model (raw logits, natural log), and the `top` most likely
    tokens at its position as (token id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _eos(eos: Any) -> int | frozenset[int] | None:
    if eos is None:
        return None
    one = isinstance(eos, numbers.Integral) and not isinstance(eos, bool)
    ids = [eos] if one else list(eos) if isinstance(eos, (list, tuple, set, frozenset)) else None
    if not ids or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
    return int(ids[0]) if one else frozenset(int(t) for t in ids)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise TypeError(f"stop must be a string, a list of non-empty strings or None, got {stop!r}")
    return tuple(stops)


@dataclass(eq=False)
class Request:
    """One prompt, how to continue it (`params`), and the tokens generated for it so far.

    `num_computed` counts the tokens whose keys/values are already in the KV cache; the next step
    processes tokens from there on. A prompt of 10 tokens with a 4-token chunk budget takes three
    prefill steps (4 + 4 + 2); the last one also samples the first new token.
    """

    rid: int
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0  # tokens whose KV is written (or being written by a batch in flight)
    num_sampled: int = 0  # tokens sampled or being sampled by a batch in flight
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # KV block table: logical block i -> physical block
    finish_reason: str | None = None  # "eos", "length"; online also "stop" or "cancelled"
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    arrival_step: int = 0  # the request reaches the scheduler at this step (to simulate live traffic)
    scheduled_at: float | None = None  # time.perf_counter() when the scheduler first admitted it

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"a Request's params must be a SamplingParams, e.g. Request(0, prompt, "
                            f"SamplingParams(max_new_tokens=8)), got {self.params!r}")

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def eos_token_id(self) -> int | frozenset[int] | None:
        return self.params.eos_token_id

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by what was generated: the sequence whose KV the cache holds."""
        return self.prompt + self.output

    @property
    def max_len(self) -> int:
        """The most tokens this request can ever hold in the KV cache.

        The last generated token is never fed back, so its KV is never written.
        """
        return len(self.prompt) + max(self.max_new_tokens - 1, 0)

    def append_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record one sampled token (and its logprob, if asked for) and finish the request if it hit EOS
        or its length."""
        assert self.state == RequestState.DECODING, self.state
        self.output.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        eos = self.eos_token_id
        if eos is not None and (token == eos if isinstance(eos, int) else token in eos):
            self.finish("eos")
        elif len(self.output) >= self.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
