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

import enum
from dataclasses import dataclass, field


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature == 0 means greedy (argmax).

    Sampling is seeded per request: the random numbers for a request's k-th generated token depend
    only on (seed, k), never on which other requests share the batch, so a sync run and an async run
    (whose batches differ) give the same tokens.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(eq=False)
class Request:
    """One prompt and the tokens generated for it so far.

    `num_computed` counts the tokens whose keys/values are already in the KV cache; the next step
    processes tokens from there on. A prompt of 10 tokens with a 4-token chunk budget takes three
    prefill steps (4 + 4 + 2); the last one also samples the first new token.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | frozenset[int] | None = None  # one id, or several
    state: RequestState = RequestState.WAITING
    num_computed: int = 0  # tokens whose KV is written (or being written by a batch in flight)
    num_sampled: int = 0  # tokens sampled or being sampled by a batch in flight
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # KV block table: logical block i -> physical block
    finish_reason: str | None = None  # "eos", "length"; online also "stop" or "cancelled"
    arrival_step: int = 0  # the request reaches the scheduler at this step (to simulate live traffic)
    scheduled_at: float | None = None  # time.perf_counter() when the scheduler first admitted it
    # (block table, block size, cell of every position): kept by batch.py, so a step does not redo it
    cell_table: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by what was generated: the sequence whose KV the cache holds."""
        return self.prompt + self.output

    @property
    def max_len(self) -> int:
        """The most tokens this request can ever hold in the KV cache.

        The last generated token is never fed back, so its KV is never written.
        """
        return len(self.prompt) + self.max_new_tokens - 1

    def append_token(self, token: int) -> None:
        """Record one sampled token and finish the request if it hit EOS or its length."""
        assert self.state == RequestState.DECODING, self.state
        self.output.append(token)
        eos = self.eos_token_id
        if eos is not None and (token == eos if isinstance(eos, int) else token in eos):
            self.finish("eos")
        elif len(self.output) >= self.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
