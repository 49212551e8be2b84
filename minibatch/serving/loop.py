"""The loop that serves requests arriving while the engine runs, from a thread of its own (notebook 08).

A plug-in: the core's Engine knows nothing of it. `Serving` (service.py) holds the engine for as long
as a `with` block lasts, opens one run sized for requests not known in advance and steps it from a
`ServingLoop`, this module's class. Every caller goes through that loop. A turn:

    take what arrived ─▶ scheduler.add, and honour cancels     (under the lock, at a step boundary)
    one step           ─▶ engine.step(): sync_step or async_step (schedule → launch → wait → update)
      deliver          ─▶ as the step applies a batch's tokens: them to their TokenStreams; stop
                          strings end requests here

Tokens are delivered from inside the step, through the run's `on_step` hook, the moment the update
has applied them, not when `engine.step()` returns: an async step may still have a launch to do
after its update (async_loop.py: a step that is no CUDA graph updates first, then launches its
kernels one by one), and a first token held behind that launch would add a whole step to TTFT. The
hook is the engine's only call into the loop. The loop's thread turns for as long as
the `with` block lasts, so that `submit` can hand it requests from any thread at any moment; with
nothing to do it sleeps on a condition (it never spins) and `submit` wakes it. An offline `generate`
needs none of this: it steps the engine in the calling thread until its requests are done.

What overlap changes online: the async loop plans step N+1 before step N's tokens are back, so a
request that arrives now joins at the next planning, one step in flight later; and a request that
finishes (EOS, stop string, length, cancel) may still sit in the step in flight, whose token for it
is dropped by `Scheduler.update`. No token past the end ever reaches a stream.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from ..core.requests import Request, RequestState
from ..core.timeline import ARRIVAL
from .stream import Chunk, Detokenizer, TokenStream, Wakeups

TIMELINE_LIMIT = 100_000  # spans a serving run's timeline keeps by default: it may serve for hours


class QueueFull(RuntimeError):
    """`submit` refused a request: `max_queue` requests are waiting already (a server answers 503)."""


class ServingLoop:
    """One run's turns (engine.Run), and what callers hand it: new requests and cancels."""

    def __init__(self, engine, run, max_queue: int | None = None) -> None:
        self.engine, self.run, self.max_queue = engine, run, max_queue
        self.cond = threading.Condition(threading.Lock())
        self.inbox: deque[tuple[Request, TokenStream]] = deque()
        self.cancels: list[TokenStream] = []
        self.streams: dict[Request, TokenStream] = {}  # online requests still running, and their streams
        self.closing = False
        self.error: BaseException | None = None
        self.turn_started: float | None = None  # time.monotonic() as the turn under way began (None: idle)
        self.thread: threading.Thread | None = None
        self._cpu_s = 0.0  # CPU seconds of the background thread as of its last turn (see cpu_s)
        self._clock: int | None = None  # that thread's CPU clock, where the OS lends one
        self.rids = itertools.count()
        run.on_step = self._stepped  # tokens reach their streams as the update applies them (see the module)

    # --- callers (any thread) ---------------------------------------------------------------------
    def submit(self, request: Request, stream: TokenStream, tokenizer) -> TokenStream:
        stream._request, stream._cancel = request, self.cancel
        stream._detok = Detokenizer(tokenizer, request.params.stop)
        stream.prompt_ids, stream.prompt_logprobs = request.prompt, request.prompt_logprobs  # (filled by the loop)
        with self.cond:
            self._check_open()
            if self.max_queue is not None and len(self.inbox) + len(self.run.scheduler.waiting) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already (max_queue): try again later")
            self.inbox.append((request, stream))
            self.cond.notify()
        return stream

    def cancel(self, stream: TokenStream) -> None:
        with self.cond:
            self.cancels.append(stream)
            self.cond.notify()

    def _check_open(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine's loop has failed ({type(self.error).__name__}: {self.error}); "
                               "leave the Serving block and open a new one") from self.error
        if self.closing:
            raise RuntimeError("the engine is not serving any more: submit inside `with Serving(engine) as server:`")

    # --- the loop (one thread) --------------------------------------------------------------------
    def turn(self) -> int:
        """Take what arrived, run one step if there is work (its tokens are delivered as it applies
        them: `_stepped`). Returns how many requests finished."""
        self._take_arrivals()
        if self.run.scheduler.has_work():
            self.engine.step()
        finished = self.run.scheduler.finished
        n = len(finished)
        finished.clear()  # the streams and the callers hold what they need
        return n

    def _take_arrivals(self) -> None:
        with self.cond:
            arrived, self.inbox = list(self.inbox), deque()
            cancels, self.cancels = self.cancels, []
        scheduler, timeline = self.run.scheduler, self.run.timeline
        for request, stream in arrived:
            request.arrival_step = scheduler.step  # here and now
            scheduler.add(request)
            self.streams[request] = stream
            timeline.mark(f"{ARRIVAL}{request.rid}", stream.arrival)
        for stream in cancels:
            request = stream._request
            if scheduler.finish(request, "cancelled"):
                self._end(request, stream, Chunk([], "", "cancelled"))

    def _stepped(self, plan, done) -> None:  # run.on_step: a step has applied `plan`'s tokens
        self.deliver(plan)

    def deliver(self, plan) -> None:
        """As a step applies a batch: each online request's new tokens from `plan` to its stream; the
        event loops reading them are woken once, at the end (stream.Wakeups)."""
        wakeups = Wakeups()
        try:
            self._deliver(plan, wakeups)
        finally:
            wakeups.send()

    def _deliver(self, plan, wakeups: Wakeups) -> None:
        now, scheduler = time.perf_counter(), self.run.scheduler
        for chunk in plan.sampling_chunks + plan.ending:  # (ending: prompts scored, nothing generated)
            r = chunk.request
            stream = self.streams.get(r)
            if stream is None:
                continue  # offline, or ended already
            if stream.first_scheduled is None:  # its first token: the timeline's marks say where TTFT went
                stream.first_scheduled = r.scheduled_at
                self.run.timeline.mark(f"scheduled {r.rid}", r.scheduled_at)
                self.run.timeline.mark(f"first {r.rid}", now)
            new = r.output[len(stream.token_ids):]
            logprobs = tuple(r.logprobs[len(stream.logprobs):len(r.output)])
            detok = stream._detok
            text = detok.add(new)
            if detok.stopped and r.state is not RequestState.FINISHED:
                scheduler.finish(r, "stop")
            if r.finish_reason is None:
                stream.put(Chunk(new, text, None, logprobs), now, wakeups)
            else:
                text += detok.flush()
                reason = "stop" if detok.stopped else r.finish_reason
                self._end(r, stream, Chunk(new, text, reason, logprobs), now, wakeups)

    def _end(self, request: Request, stream: TokenStream, chunk: Chunk, now: float | None = None,
             wakeups: Wakeups | None = None) -> None:
        self.streams.pop(request, None)
        stream.put(chunk, time.perf_counter() if now is None else now, wakeups)

    @property
    def cpu_s(self) -> float:
        """CPU seconds the background thread has run (a server's GIL budget: Serving.stats()): read from
        the thread's own CPU clock now where the OS lends it (`time.pthread_getcpuclockid`: Linux and
        other POSIX systems, not macOS), else as of the thread's last turn, which leaves out a turn in
        progress. The clock is taken by the thread itself: an ident read from outside may already
        belong to another thread."""
        if self._clock is not None and self.thread is not None and self.thread.is_alive():
            try:
                return max(self._cpu_s, time.clock_gettime(self._clock))
            except OSError:  # the thread ended in between (its clock is gone: EINVAL)
                pass
        return self._cpu_s

    # --- the background thread --------------------------------------------------------------------
    def start_thread(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="minibatch-engine-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        scheduler = self.run.scheduler
        if hasattr(time, "pthread_getcpuclockid"):  # this thread's clock, for cpu_s to read from any thread
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
        try:
            while True:
                with self.cond:  # sleep until there is something to do: a submit or a cancel wakes us
                    self.cond.wait_for(lambda: self.closing or self.inbox or self.cancels or scheduler.has_work())
                    if self.closing:
                        return
                self.turn_started = time.monotonic()
                self.turn()
                self.turn_started = None
                self._cpu_s = time.thread_time()
        except BaseException as e:  # noqa: BLE001 — every reader must learn of it, not wait forever
            self.error = e
        finally:
            self._end_all()
            self._cpu_s = time.thread_time()  # all of it, the last turn and the leaving included

    def _end_all(self) -> None:
        """Leaving: every request still open ends ("cancelled", or the loop's error) and frees its blocks."""
        with self.cond:
            self.closing = True
            left = list(self.inbox)
            self.inbox.clear()
        now = time.perf_counter()
        for request, stream in left + list(self.streams.items()):
            self.run.scheduler.finish(request, "cancelled")
            if self.error is not None:
                stream.fail(self.error, now)
            else:
                stream.put(Chunk([], "", "cancelled"), now)
        self.streams.clear()

    def failure(self, stall_s: float) -> str | None:
        """Why this loop serves no more, read from any thread: its error, its thread gone, or a turn
        under way for more than `stall_s` seconds (a device that stopped answering); None while it
        works. An idle loop waits for work, which is no stall."""
        if self.error is not None:
            return f"the engine's loop failed: {type(self.error).__name__}: {self.error}"
        dev = self.engine.dev
        why = dev.failure() if dev is not None else None
        if why is not None:
            return why
        if self.thread is not None and not self.thread.is_alive() and not self.closing:
            return "the engine's loop has ended"
        started = self.turn_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"the engine has not come back from a step for {time.monotonic() - started:.0f} s"
        return None

    def close(self) -> None:
        """Stop the thread (the step in flight completes first) and end every open stream."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

