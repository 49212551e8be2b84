"""A request's tokens as they are made: `TokenStream`, read from any thread or from asyncio (notebook 08).

    engine loop thread                         caller (any thread, or an asyncio task)
    ── step N: update ──▶ stream.put(chunk) ──▶ for chunk in stream:        (blocks on a condition)
                                          └──▶ async for chunk in stream:  (woken through the event
                                                                            loop's call_soon_threadsafe)

The engine's loop runs in one background thread; it hands each request's new tokens to its stream at
the update that learns them. A stream keeps every chunk, so a reader may start late and still sees
everything from the first token on; any number of readers may iterate it. Nothing here ever blocks
the engine's loop: `put` only appends under a lock and wakes whoever waits.

Text is decoded on the host as tokens arrive (`Detokenizer`), a few tokens at a time, so that stop
strings can be matched on text and each chunk carries the text its tokens added. Times are
`time.perf_counter()` seconds: `arrival` (submit), `first_scheduled` (admitted into a batch),
`token_times` (one per token, when the host learned it) and `finished_at`, enough to compute time
to first token and the gaps between tokens from the stream alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ..core.device import safe_wait_for


@dataclass(frozen=True)
class Chunk:
    """What one update added to a stream: its new tokens and text; `finish_reason` on the last chunk."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: tuple = ()  # a TokenLogprob per token, where the request asked for logprobs


class Detokenizer:
    """Incremental decoding and stop strings: text grows by the difference of two short decodes.

    Decoding the whole output at every token would cost O(n) per token. Here only the tokens since
    `prefix` are decoded, twice (up to `read`, and up to the end), and the difference is the new
    text: a token that is only part of a character (a byte-level tokenizer's half of a UTF-8
    sequence decodes to U+FFFD) adds nothing until the rest arrives. With stop strings, the last
    few characters (one fewer than the longest stop string) are held back until the next token shows
    whether they begin a stop string: text already handed to a reader cannot be taken back.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.full = ""  # everything decoded so far
        self.text = ""  # what was handed out: `full` less what is held back or cut
        self.searched = 0  # where in `full` the next search for a stop string starts
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text they add (cut before a stop string, which sets `stopped`)."""
        self.ids += token_ids
        if self.tokenizer is None or self.stopped:
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        full = decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or not full.startswith(before):
            return ""  # a character split across tokens: wait for the rest
        self.prefix, self.read = self.read, len(self.ids)
        return self._grow(full[len(before):], hold=self.hold)

    def flush(self) -> str:
        """At the request's end: whatever was held back (a split character, a possible stop string's start)."""
        if self.tokenizer is None or self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids)
        new = full[len(self.full):] if full.startswith(self.full) else ""
        return self._grow(new, hold=0)

    def _grow(self, new: str, hold: int) -> str:
        self.full += new
        if self.stop:
            found = [i for i in (self.full.find(s, self.searched) for s in self.stop) if i >= 0]
            if found:
                self.stopped = True
                return self._emit(min(found))
            self.searched = max(0, len(self.full) - self.hold)  # a stop string may straddle the next token
        return self._emit(len(self.full) - hold)

    def _emit(self, upto: int) -> str:
        out = self.full[len(self.text):upto] if upto > len(self.text) else ""
        self.text += out
        return out


class Wakeups:
    """Event loops to wake after an update, each once, however many of its streams got a chunk.

    Waking an asyncio reader from the engine's thread goes through `call_soon_threadsafe`, which
    writes a byte to the event loop's self-pipe (a system call) and costs the loop a turn to read it.
    A server streaming to 64 clients would pay that 64 times per step; gathered, it pays once.
    """

    def __init__(self) -> None:
        self.events: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}

    def add(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
        for loop, event in waiters:
            self.events.setdefault(loop, []).append(event)

    def send(self) -> None:
        events, self.events = self.events, {}
        for loop, batch in events.items():
            try:
                loop.call_soon_threadsafe(_set_all, batch)
            except RuntimeError:  # that event loop has closed: nobody is waiting there any more
                pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


@dataclass(eq=False)
class TokenStream:
    """One submitted request's output: iterate it (blocking or `async for`), or `wait()` for the end."""

    rid: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    error: BaseException | None = None  # the engine failed: reading on raises it
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token (SamplingParams.logprobs)
    prompt_ids: list[int] = field(default_factory=list)
    # the prompt's tokens 1.. scored (SamplingParams.prompt_logprobs): complete before the first chunk arrives
    prompt_logprobs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._chunks: list[Chunk] = []
        self._cond = threading.Condition(threading.Lock())
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancel = None  # set by the engine: asks its loop to end this request

    # --- the engine's side (its loop thread) ----------------------------------------------------------
    def put(self, chunk: Chunk, now: float, wakeups: "Wakeups | None" = None) -> None:
        """Append a chunk and wake its readers: threads now, event loops now or, given `wakeups`, when
        the caller sends them (one wake-up per event loop for a whole update)."""
        with self._cond:
            self.token_ids += chunk.token_ids
            self.logprobs += chunk.logprobs
            self.text += chunk.text
            self.token_times += [now] * len(chunk.token_ids)
            if chunk.finish_reason is not None:
                self.finish_reason, self.finished_at = chunk.finish_reason, now
            self._chunks.append(chunk)
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        if wakeups is None:
            wakeups = Wakeups()
            wakeups.add(waiters)
            wakeups.send()
        else:
            wakeups.add(waiters)

    def fail(self, error: BaseException, now: float) -> None:
        """The engine's loop failed: the request ends, and readers get the error after its chunks."""
        self.error = error
        self.put(Chunk([], "", "cancelled"), now)

    # --- the caller's side ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Ask the engine to stop this request: at most two more chunks arrive (the tokens of the step
        in flight, then the last one, with finish_reason "cancelled"); its KV blocks are freed."""
        if not self.done and self._cancel is not None:
            self._cancel(self)

    def wait(self, timeout: float | None = None) -> "TokenStream":
        """Block until the request has finished (TimeoutError after `timeout` seconds)."""
        with self._cond:
            if not safe_wait_for(self._cond, lambda: self.done, timeout):  # (a Ctrl-C comes back as itself)
                raise TimeoutError(f"request {self.rid} has not finished after {timeout} s")
        self._raise_error()
        return self

    async def wait_async(self) -> "TokenStream":
        """`wait` from asyncio: until the request has finished, without blocking the event loop."""
        async for _ in self:
            pass
        return self

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"request {self.rid}: the engine failed") from self.error

    def _checked(self, chunk: Chunk) -> Chunk:
        """A chunk for a reader; the last one of a request whose engine failed raises its error instead."""
        if chunk.finish_reason is not None:
            self._raise_error()
        return chunk

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                safe_wait_for(self._cond, lambda: i < len(self._chunks))
                chunk = self._chunks[i]
            i += 1
            yield self._checked(chunk)
            if chunk.finish_reason is not None:
                return

    async def __aiter__(self):
        i, loop = 0, asyncio.get_running_loop()
        while True:
            with self._cond:
                ready = i < len(self._chunks)
                if not ready:
                    event = asyncio.Event()
                    self._async_waiters.append((loop, event))
            if not ready:
                await event.wait()
                continue
            chunk = self._chunks[i]
            i += 1
            yield self._checked(chunk)
            if chunk.finish_reason is not None:
                return

    @property
    def ttft(self) -> float | None:
        """Seconds from submit to the first token (None before it)."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive tokens, in seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"<TokenStream {self.rid}: {len(self.token_ids)} tokens, {state}>"
