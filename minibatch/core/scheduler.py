"""The CPU side of continuous batching: who runs in the next step, and how many tokens each (notebook 01).

Every step the scheduler

  1. gives each DECODING request one token (its last sampled token goes back in),
  2. continues PREFILLING requests with the next chunk of their prompt,
  3. admits WAITING requests, first come first served, while there is room,

all under two limits: `max_batch_tokens` (the token budget: how many tokens one forward pass may
process) and `max_batch_size` (how many requests may run at once). A long prompt is cut into chunks
that fit what is left of the budget ("chunked prefill"), so one big prompt never stalls the decoding
requests. Prefill chunks and decode tokens share one ragged batch ("mixed batches").

The scheduler advances its bookkeeping (`num_computed`, `num_sampled`) when it *plans* a step, not
when the step's results come back. The synchronous loop calls `update` before the next `schedule`,
so the difference does not show. The asynchronous loop (notebook 06) plans step N+1 before step N's
tokens are back: a request that will reach `max_new_tokens` is known in advance and not planned
again, but one that hits EOS in step N may already sit in step N+1; `update` then drops its extra
token.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .kv_cache import BlockAllocator
from .prefix_cache import PrefixCache
from .requests import Request, RequestState, TokenLogprob


class ScheduledChunk(NamedTuple):
    """Request `request` processes its tokens start..end-1 in this step; `sample` = a new token comes out.

    (A named tuple: immutable and several times cheaper to make than a frozen dataclass, which
    matters with one chunk per running request per step.)
    """

    request: Request
    start: int
    end: int
    sample: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class BatchPlan:
    step: int
    chunks: list[ScheduledChunk]
    # prompt logprobs (requests.SamplingParams): (index in chunks, chunk) of the chunks whose positions
    # score the prompt's next token, and the chunks that end a prompt that generates nothing
    scoring: list[tuple[int, ScheduledChunk]] = field(default_factory=list)
    ending: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @functools.cached_property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        """The chunks that sample, in the order of the step's output rows (asked for several times a step)."""
        return [c for c in self.chunks if c.sample]


class Scheduler:
    """Plans every step (module doc). `prefix_caching`: requests share the KV blocks of a common prompt
    start (prefix_cache.py); a request then starts its prefill after the shared blocks."""

    def __init__(self, allocator: BlockAllocator, max_batch_tokens: int, max_batch_size: int,
                 prefix_caching: bool = False) -> None:
        if max_batch_tokens < 1 or max_batch_size < 1:
            raise ValueError(
                f"max_batch_tokens and max_batch_size must be >= 1, got {max_batch_tokens}, {max_batch_size}"
            )
        self.allocator = allocator
        self.prefix = PrefixCache(allocator, prefix_caching)  # every request's blocks come from it, shared or not
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.pending: list[Request] = []  # not arrived yet (arrival_step in the future)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, not finished, in admission order
        self.retiring: list[Request] = []  # last token in flight: seat and KV blocks already given back
        self.finished: list[Request] = []
        self.step = 0

    def add(self, request: Request) -> None:
        need = self.allocator.blocks_for(request.max_len)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request {request.rid} needs {request.max_len} tokens of KV cache ({need} blocks) but the "
                f"cache only has {self.allocator.num_blocks} blocks of {self.allocator.block_size}: it could never run"
            )
        if request.arrival_step > self.step:
            self.pending.append(request)
            self.pending.sort(key=lambda r: r.arrival_step)
        else:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending or self.retiring)

    def has_unplanned_work(self) -> bool:
        """Is there anything a new step could do? (False while only in-flight tokens are pending.)"""
        return bool(self.waiting or self.pending) or any(self._wants_tokens(r) for r in self.running)

    def _arrivals(self) -> None:
        if self.pending and not self.waiting and not self.running:
            self.step = max(self.step, self.pending[0].arrival_step)  # idle: skip ahead to the next arrival
        while self.pending and self.pending[0].arrival_step <= self.step:
            self.waiting.append(self.pending.pop(0))

    @staticmethod
    def _wants_tokens(r: Request) -> bool:
        if r.state == RequestState.PREFILLING:
            return True
        return r.state == RequestState.DECODING and r.num_sampled < r.max_new_tokens

    def schedule(self) -> BatchPlan:
        """Plan the next step and advance the bookkeeping as if it had already run."""
        self._arrivals()
        self._retire_length_finished()
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        # 1. decoding requests first: one token each, so ongoing generations never stall
        decoding, prefilling = RequestState.DECODING, RequestState.PREFILLING
        for r in self.running:  # (its bookkeeping done here: this loop runs for every decoding request)
            if budget > 0 and r.state is decoding and r.num_sampled < r.max_new_tokens:
                n = r.num_computed
                chunks.append(ScheduledChunk(r, n, n + 1, True))
                r.num_computed, r.num_sampled = n + 1, r.num_sampled + 1
                budget -= 1
        decode_chunks = len(chunks)
        # 2. requests in the middle of their prompt
        for r in self.running:
            if r.state is prefilling and budget > 0:
                chunks.append(self._prefill_chunk(r, budget))
                budget -= chunks[-1].num_tokens
        # 3. admit newcomers while there is budget, a free seat and enough KV blocks
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            r = self.waiting[0]
            need = self.allocator.blocks_for(r.max_len)
            got = self.prefix.admit(r, need)
            if got is None:
                break  # first come, first served: later requests wait too
            r.blocks, r.num_computed = got  # (num_computed: the tokens of the blocks it shares, computed already)
            self.waiting.popleft()
            r.state = RequestState.PREFILLING
            r.scheduled_at = time.perf_counter()
            self.running.append(r)
            chunks.append(self._prefill_chunk(r, budget))
            budget -= chunks[-1].num_tokens
        plan = BatchPlan(self.step, chunks)
        for i in range(decode_chunks, len(chunks)):  # prefill chunks: advance; the last one of a prompt samples
            c = chunks[i]
            r = c.request
            r.num_computed = c.end
            self.prefix.kept(r, c.end)
            if r.params.prompt_logprobs is not None:
                self._score(plan, i, c)
            if c.sample:
                r.num_sampled += 1
                r.state = decoding
        self.step += 1
        return plan

    @staticmethod
    def _score(plan: BatchPlan, i: int, c: ScheduledChunk) -> None:
        """Chunk i scores its prompt (prompt_logprobs): each position but the prompt's last scores the
        next token; a prompt that generates nothing ends with its last chunk (and is retired as one whose
        length is reached)."""
        prompt = c.request.prompt
        if c.start < len(prompt) - 1:
            plan.scoring.append((i, c))
        if c.end == len(prompt) and not c.sample:
            plan.ending.append(c)
            c.request.state = RequestState.DECODING

    def _retire_length_finished(self) -> None:
        """Give back the seat and blocks of requests whose last token is being sampled right now.

        Only the async loop meets such requests here (the sync loop has applied every token before it
        plans). Their length is known, so they need no more KV cache and no seat, exactly as in the sync
        loop, where they are gone by now: both loops then plan the same batches, token for token, until
        an EOS surprises the async one. Handing their blocks to a newcomer in the next step is safe: the
        device runs the step in flight, the last one that writes them for the old owner, first.
        """
        decoding = RequestState.DECODING  # (the cheap test first: this runs over every request every step)
        for r in [r for r in self.running if r.num_sampled >= r.max_new_tokens and r.state is decoding]:
            self.running.remove(r)
            self.prefix.free(r)
            self.retiring.append(r)

    def finish(self, r: Request, reason: str) -> bool:
        """End a request early, wherever it is (a stop string or a cancel, notebook 08); False if it
        had finished already. Its seat and KV blocks are given back now.

        In the async loop the request may sit in the batch in flight: `update` then drops the token
        that batch samples for it, as for an EOS found one step late, and the blocks it still writes
        are safe to hand out for the same reason (see `_retire_length_finished`).
        """
        if r.state is RequestState.FINISHED:
            return False
        if r in self.running:
            self.running.remove(r)
            self.prefix.free(r)
        elif r in self.retiring:
            self.retiring.remove(r)  # its blocks went back when its last token was planned
        elif r in self.waiting:
            self.waiting.remove(r)
        elif r in self.pending:
            self.pending.remove(r)
        r.finish(reason)
        self.finished.append(r)
        return True

    @staticmethod
    def _prefill_chunk(r: Request, budget: int) -> ScheduledChunk:
        end = min(len(r.prompt), r.num_computed + budget)
        return ScheduledChunk(r, r.num_computed, end, sample=end == len(r.prompt) and r.max_new_tokens > 0)

    def update(self, plan: BatchPlan, sampled: list[int], logprobs=None) -> list[Request]:
        """Hand each sampled token (and its logprobs: `logprobs`, from IOSlot.logprobs) to its request;
        retire the finished. Returns newly finished requests."""
        sampling = plan.sampling_chunks
        if len(sampled) != len(sampling):
            raise RuntimeError(f"step {plan.step}: {len(sampling)} tokens expected, {len(sampled)} came back")
        done = []
        finished = RequestState.FINISHED
        rows = itertools.repeat(None)
        if logprobs:  # (the prompt's first: a chunk that scores its prompt's end may finish it with its token)
            _prompt_logprobs(plan.scoring, logprobs[1])
            rows = _logprob_rows(sampling, sampled, logprobs[0])
        for chunk, token, logprob in zip(sampling, sampled, rows):
            r = chunk.request
            if r.state is finished:
                continue  # async only: it hit EOS one step earlier; this token is past its end
            r.append_token(int(token), logprob)
            if r.state is finished:
                done.append(r)
        for c in plan.ending:  # prompts scored, nothing to generate
            if c.request.state is not finished:
                c.request.finish("length")
                done.append(c.request)
        for r in done:
            if r in self.retiring:
                self.retiring.remove(r)  # seat and blocks were given back when it was planned
            else:
                self.prefix.free(r)
                self.running.remove(r)
            self.finished.append(r)
        return done

    @property
    def num_free_blocks(self) -> int:
        """KV blocks a new request could get now (with prefix caching: the cache's idle ones too)."""
        return self.prefix.num_free

    def close(self) -> None:
        """The run is over: blocks the prefix cache keeps go back to the allocator."""
        self.prefix.clear()


def _token_logprob(token: int, values, ids, k: int) -> TokenLogprob:
    """One row of a step's logprobs (slots.IOSlot.logprobs): the token's, then the top k of the row."""
    return TokenLogprob(token, float(values[0]), tuple(zip(ids[:k].tolist(), values[1:k + 1].tolist())))


def _logprob_rows(sampling: list[ScheduledChunk], sampled: list[int], rows):
    """The TokenLogprob of each sampled token whose request asked for logprobs (None for the others)."""
    values, ids = rows
    for i, (c, token) in enumerate(zip(sampling, sampled)):
        k = c.request.params.logprobs
        yield None if k is None else _token_logprob(int(token), values[i], ids[i], k)


def _prompt_logprobs(scoring: list[tuple[int, ScheduledChunk]], rows) -> None:
    """The scored prompt tokens' TokenLogprobs, in the order build_batch laid out their rows."""
    values, ids = rows
    row = 0
    for _, c in scoring:
        r = c.request
        prompt, k = r.prompt, r.params.prompt_logprobs
        for pos in range(c.start, min(c.end, len(prompt) - 1)):
            if r.state is not RequestState.FINISHED:
                r.prompt_logprobs.append(_token_logprob(prompt[pos + 1], values[row], ids[row], k))
            row += 1
