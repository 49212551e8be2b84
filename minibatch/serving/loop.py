"""An engine serving requests that arrive while it runs, from a loop in a thread of its own (notebook 08).

    with Engine(model) as engine, Serving(engine, "async", max_batch_size=8) as server:
        stream = server.submit("The for statement", max_new_tokens=48)   # from any thread, at any time
        for chunk in stream:
            print(chunk.text, end="")

A plug-in: the core's Engine knows nothing of it. `Serving` holds the engine for as long as it lasts
(`engine.exclusive`), opens one run sized for requests not known in advance (`serving_config`,
`engine.open_run`) and steps it from a `ServingLoop`. Every caller goes through that loop. A turn:

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

from ..core.checks import check_prompts
from ..core.config import EngineConfig, serving_config, split_options, with_options
from ..core.requests import Request, RequestState, SamplingParams
from ..core.timeline import ARRIVAL, Timeline
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


class Serving:
    """Serve requests submitted while a `with` block lasts, from a loop in a background thread.

    The run is sized once, for `max_batch_size` requests (default 8) of the model's whole context
    (or `num_blocks` KV blocks), and checked against free memory as the Serving is made; its KV
    cache, IO slots and CUDA graphs serve every request. `config` and `options` are generate's run
    options (EngineConfig), except that CUDA graphs default to decode steps only (serving_config
    says why). The loop is `mode` if given, else `config.mode` if a config is given, else "async".
    `max_queue` bounds the requests waiting for a seat (submit raises QueueFull beyond it).
    `capture_up_to` (tokens; 0: off) captures, as the block is entered and before any request, the
    CUDA graphs of requests up to that many tokens (speed/startup_graphs.py: no capture on a request's
    path; a GPU run with CUDA graphs only): decode steps', and with cuda_graphs=True every flat step's
    too, on coarser buckets; a `capture_progress(done, total)` set on the Serving before the block is
    entered is called after each (a minute or more for an 8B model). Bad options raise as the Serving
    is made; the run is sized and checked against free memory as the block is entered. Leaving the
    block ends every open stream ("cancelled") and joins the thread.
    """

    def __init__(self, engine, mode: str | None = None, config: EngineConfig | None = None, *,
                 max_queue: int | None = None, timeline: Timeline | None = None, capture_up_to: int = 0,
                 **options) -> None:
        mode = mode or (config.mode if config is not None else "async")
        if not isinstance(capture_up_to, int) or isinstance(capture_up_to, bool) or capture_up_to < 0:
            raise ValueError(f"capture_up_to must be a number of tokens >= 0 (0: off), got {capture_up_to!r}")
        self.engine, self.max_queue, self.capture_up_to = engine, max_queue, capture_up_to
        self.capture_progress = None  # set before the block is entered: called (done, total) after each capture
        self.startup_captures = 0
        self.config = with_options(EngineConfig, config, {**options, "mode": mode}, "Serving()")
        if capture_up_to:
            from ..speed.startup_graphs import check_capture
            check_capture(engine.model.device, self.config.cuda_graphs, self.config.compile)
        self.timeline = timeline if timeline is not None else Timeline(limit=TIMELINE_LIMIT)
        self.loop: ServingLoop | None = None
        self._hold = None

    def __enter__(self) -> "Serving":
        hold = self.engine.exclusive()
        hold.__enter__()
        try:  # sized now, with the engine held: its kept resources and the free memory as they are
            run_config = serving_config(self.engine.model, self.config, self.engine.kept_bytes)
            run = self.engine.open_run(run_config, [], self.timeline)
            if self.capture_up_to:
                from ..speed.startup_graphs import capture_startup_graphs
                self.startup_captures = capture_startup_graphs(self.engine, self.capture_up_to, self.capture_progress)
            self.loop = ServingLoop(self.engine, run, self.max_queue)
            self.loop.start_thread()
        except BaseException:
            if self.engine.run is not None:  # (opened, then the captures failed)
                self.engine.abandon()
            hold.__exit__(None, None, None)
            raise
        self._hold = hold
        return self

    def __exit__(self, *exc) -> None:
        loop, self.loop = self.loop, None
        try:
            loop.close()
            if loop.error is None:
                self.engine.finish()
            else:
                self.engine.abandon()
        finally:
            loop.run.on_step = None  # (the run and the loop hold each other: let the run go as soon as it ends)
            hold, self._hold = self._hold, None
            hold.__exit__(None, None, None)

    def submit(self, prompt, params: SamplingParams | None = None, **options) -> TokenStream:
        """Hand one request to the serving loop, from any thread; returns its TokenStream at once.

        `params` (a SamplingParams) and `options` (its fields by name) mean what they mean in
        `generate`: a request submitted with seed S gives the tokens `generate([prompt], seed=S)`
        gives; `stop` strings end it when its text contains one (the text ends before it). A request
        that could never fit in the KV cache is refused here.
        """
        loop = self.loop
        if loop is None:
            raise RuntimeError("submit needs a serving engine: `with Serving(engine) as server: server.submit(...)`")
        model = self.engine.model
        params = with_options(SamplingParams, params, options, "submit()")
        (ids,), params = check_prompts(model, [prompt], params)
        request = Request(next(loop.rids), ids, params)
        allocator = loop.run.scheduler.allocator
        if allocator.blocks_for(request.max_len) > allocator.num_blocks:
            raise ValueError(f"this request needs {request.max_len} tokens of KV cache but the serving cache holds "
                             f"{allocator.num_blocks * allocator.block_size}: it could never run (raise num_blocks)")
        return loop.submit(request, TokenStream(request.rid, len(ids)), model.tokenizer)

    def generate(self, prompts, params: SamplingParams | None = None, **options) -> list[list[int]]:
        """`Engine.generate` for callers of a serving engine: each prompt submitted (prompt i seeded
        seed + i), the new tokens of each returned in order; any thread may call it at once."""
        params, config = split_options(params, None, options, "generate()")
        if "mode" in options and config.mode != self.config.mode:
            raise ValueError(f"this engine is serving in {self.config.mode!r} mode; generate(mode={config.mode!r}) "
                             "cannot run beside it (leave the Serving block first, or use its mode)")
        token_ids, params = check_prompts(self.engine.model, prompts, params)
        streams = [self.submit(p, params.replace(seed=params.seed + i)) for i, p in enumerate(token_ids)]
        return [s.wait().token_ids for s in streams]

    def stats(self) -> dict:
        """The serving run's KV blocks, requests, steps and CUDA graph captures so far (a snapshot, read
        without stopping the loop). Free KV blocks count the prefix cache's idle ones (`kv_blocks_cached`
        are all it keeps, held or idle); `prefix_cache_hit_tokens` of `prefix_cache_prompt_tokens` came
        from it. A graph is captured the first time a step shape comes up: captures
        that keep growing under load are steps that ran slower than a replay would, and
        `graph_capture_s` is the host time they held the loop (warm-up step, drain, capture; with
        compile=True also the torch.compile of a new shape, which happens in the warm-up step);
        `startup_graph_captures` of them were made before the first request (capture_up_to).
        `loop_cpu_s`: the CPU seconds the loop's thread has run (a server's HTTP thread shares the
        interpreter's lock with it: together they tell how much of it was left)."""
        loop = self.loop
        if loop is None:
            return {"serving": False}
        run = loop.run
        s = run.scheduler
        prefix = s.prefix
        return {"serving": True, "mode": run.mode, "kv_blocks": s.allocator.num_blocks,
                "kv_blocks_free": s.num_free_blocks, "running": len(s.running),
                "kv_blocks_cached": prefix.num_kept, "prefix_cache_hit_tokens": prefix.hit_tokens,
                "prefix_cache_prompt_tokens": prefix.prompt_tokens,
                "waiting": len(s.waiting) + len(loop.inbox), "steps": s.step,
                "graph_captures": len(run.runner.captures), "startup_graph_captures": self.startup_captures,
                "graph_capture_s": round(sum(c["seconds"] for c in run.runner.captures), 3),
                "loop_cpu_s": round(loop.cpu_s, 3)}
