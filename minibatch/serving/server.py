"""The OpenAI-compatible HTTP server: a thin FastAPI + uvicorn layer over the engine's `submit`.

    python -m minibatch serve --model tiny [--mode async] [--port 8000]

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (with `"stream": true`, server-sent
events: one `data: {...}` chunk per token, then `data: [DONE]`), `GET /v1/models`, `GET /health`
(the engine's KV blocks, free and in all, its running and waiting requests, and how many requests were
cancelled because their client hung up; 503 with the reason once the engine is dead). The request
bodies (pydantic models) and their checks are protocol.py's; what is checked before them (api key,
content type, Host, body size and time) and the engine's watchdog are guard.py's.

One engine, sized once, runs its loop in a background thread for the server's whole life (FastAPI's
lifespan); each request is one `Serving.submit(...)` (loop.py), and its stream is read on the event loop without
blocking it. A client that hangs up cancels its request (the engine frees its KV blocks at the next
update); a full queue answers 503 with Retry-After. SIGINT or SIGTERM: the listening socket closes,
running requests get `--grace-period` seconds to finish, the rest end (finish_reason "abort"), and the
process exits with status 0. Exit status 1: the server could not start; 2: a bad flag or a port in use;
3: its engine died.

Notebook 08 explains the server; bench_serve.py measures it.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic_core import from_json
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..core.engine import Engine
from ..core.timeline import Timeline
from .diagnostics import gc_pauses
from .loop import TIMELINE_LIMIT, QueueFull, Serving
from . import guard, protocol
from .guard import EXIT_ENGINE_DEAD, ServeOptions
from .protocol import BadRequest, ChatRequest, CompletionRequest

# engine argument names -> the OpenAI parameter a client sent
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt": "prompt", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "stop": "stop"}


class EngineDead(RuntimeError):
    """The engine behind the server failed or stopped answering: no request can be served any more."""


class ServerState:
    """What the endpoints share: the model, its engine, the streams still open, and how it stands."""

    def __init__(self, model, name: str, eos, serving: dict, options: ServeOptions):
        self.model, self.name, self.eos, self.serving, self.options = model, name, eos, serving, options
        self.served = None  # the Serving the endpoints submit to, while the engine serves
        self.timeline = None  # its Timeline, saved as the server stops
        self.open: set = set()  # streams not yet finished or given up
        self.cancelled = 0  # requests cancelled because their client hung up
        self.created = int(time.time())
        self.dead: str | None = None  # why the engine can serve no more
        self.draining = False  # SIGTERM: no new requests, the running ones finish
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="minibatch-tokenizer")  # (INLINE_BODY)

    def refuse_new(self) -> None:
        """503 for a new request while the server stops or after its engine died."""
        if self.dead is not None:
            raise BadRequest(f"the engine is not running: {self.dead}", None, "engine_dead", 503, "server_error")
        if self.draining or self.served is None:
            raise BadRequest("the server is shutting down", None, "shutting_down", 503, "server_error")

    def die(self, reason: str) -> None:
        """The engine is dead: every open stream ends with an error, and no request is taken from now on."""
        self.dead = reason
        now, error = time.perf_counter(), EngineDead(reason)
        for s in list(self.open):
            if not s.done:
                s.fail(error, now)

    def cancel_all(self) -> None:
        for s in list(self.open):
            s.cancel()

    def close(self, s) -> None:
        """A request's answer is over (sent, or its client gone): cancel it if the engine is still on it."""
        if s in self.open:
            self.open.discard(s)
            if not s.done:
                s.cancel()
                self.cancelled += 1

    def tokens(self, p: CompletionRequest | ChatRequest) -> tuple[list[int], list[str]]:
        """The prompt's token ids, and stop strings a chat template adds."""
        tok, vocab = self.model.tokenizer, self.model.vocab_size
        if isinstance(p.prompt, list) and not p.chat:
            bad = [t for t in p.prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token id {bad[0]} of 'prompt' is outside the vocabulary [0, {vocab})", "prompt")
            return list(p.prompt), []
        if tok is None:
            raise BadRequest(f"model {self.name!r} has no tokenizer: send 'prompt' as a list of token ids",
                             "messages" if p.chat else "prompt")
        if p.chat:
            return protocol.chat_prompt(tok, p.prompt)
        return list(tok.encode(p.prompt)), []

    def submit(self, p: CompletionRequest | ChatRequest):
        """Check the request against the model, then hand it to the engine -> (stream, prompt length)."""
        ids, extra_stop = self.tokens(p)
        if (p.stop or extra_stop) and self.model.tokenizer is None:
            raise BadRequest("'stop' needs a tokenizer, and this model has none", "stop")
        context = self.model.max_positions or 2**31
        if len(ids) >= context:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the model's context is {context}", "prompt",
                             "context_length_exceeded")
        max_tokens = context - len(ids) if p.max_new_tokens is None else p.max_new_tokens
        if len(ids) + max_tokens > context:
            raise BadRequest(f"'max_tokens' is {max_tokens}, but the prompt's {len(ids)} tokens leave room for "
                             f"{context - len(ids)} in the model's context of {context}", "max_tokens",
                             "context_length_exceeded")
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
        self.refuse_new()
        try:
            s = self.served.submit(ids, p.sampling(max_tokens, self.eos, seed, extra_stop))
        except ValueError as e:  # the engine names its argument: translate it to the client's name
            param = next((v for k, v in _PARAM_NAMES.items() if k in str(e)), None)
            raise BadRequest(str(e), param) from None
        except QueueFull as e:
            raise BadRequest(f"the server is at capacity: {e}", None, "queue_full", 503, "server_overloaded",
                             {"Retry-After": "1"}) from None
        self.open.add(s)
        return s, len(ids)


def _frame(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _watch_disconnect(state: ServerState, request, s) -> None:
    """Cancel the request when its client hangs up, even before its first token is sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            state.close(s)
            return


def _engine_error(state: ServerState, s) -> BadRequest:
    """What a request whose engine failed under it is told (its stream raised)."""
    reason = state.dead or f"{type(s.error).__name__}: {s.error}"
    return BadRequest(f"the engine failed while serving this request: {reason}", None, "engine_dead", 500,
                      "server_error")


async def _sse(state: ServerState, request, s, prompt_tokens: int, p: CompletionRequest | ChatRequest):
    rid, name = protocol.new_id(p.chat), state.name
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, s))
    n = 0
    try:
        if p.chat:
            yield _frame(protocol.chunk(rid, name, True, None, role=True))
        try:
            async for c in s:
                n += len(c.token_ids)
                finish = protocol.FINISH.get(c.finish_reason) if c.finish_reason else None
                if c.token_ids or c.text or finish:
                    yield _frame(protocol.chunk(rid, name, p.chat, c.text, finish))
        except RuntimeError:
            if s.error is None:
                raise
            yield _frame(_engine_error(state, s).body())  # an error event, as OpenAI's API sends one
        else:
            if p.include_usage:
                yield _frame(protocol.chunk(rid, name, p.chat, None, use=protocol.usage(prompt_tokens, n)))
        yield "data: [DONE]\n\n"
    finally:  # also on a client that hung up (GeneratorExit / CancelledError at a yield)
        watcher.cancel()
        state.close(s)


def _error(e: BadRequest):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _parse(raw: bytes, chat: bool):
    """The body -> its request model (pydantic's own JSON parser: lone surrogates, nesting deeper than
    200 and bytes that are not UTF-8 are refused as invalid JSON, never a 500)."""
    try:
        body = from_json(raw)
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    return protocol.parse(body, chat)


# bodies up to this size are parsed and tokenized on the event loop (about a millisecond); larger ones
# in the server's one tokenizer thread, so that a long prompt stalls no other stream. Not every body
# in a thread of its own: a burst of requests would then be dozens of threads taking turns on the
# interpreter's lock with the engine's loop, each turn up to the switch interval (5 ms)
INLINE_BODY = 64 * 1024


def _parse_and_submit(state: ServerState, raw: bytes, chat: bool):
    p = _parse(raw, chat)
    if p.model not in ("", state.name):
        raise BadRequest(f"the model {p.model!r} does not exist (this server has {state.name!r})",
                         "model", "model_not_found", 404)
    return (p, *state.submit(p))


async def _handle(state: ServerState, request, chat: bool):
    """One completion or chat request: checked, tokenized and submitted (a large body off the event
    loop, INLINE_BODY), then answered whole or streamed."""
    opts = state.options
    try:
        state.refuse_new()
        guard.check_json(request.headers.get("content-type"))
        raw = await guard.read_body(request, opts.max_body, opts.body_timeout)
        if len(raw) <= INLINE_BODY:
            p, s, prompt_tokens = _parse_and_submit(state, raw, chat)
        else:
            p, s, prompt_tokens = await asyncio.get_running_loop().run_in_executor(
                state.tokenizer_thread, _parse_and_submit, state, raw, chat)
    except BadRequest as e:
        return _error(e)
    except guard.ClientGone:
        print("minibatch: a client closed its connection before its request body arrived", file=sys.stderr,
              flush=True)
        return Response(status_code=400)  # (nobody reads it)
    if p.stream:
        return StreamingResponse(_sse(state, request, s, prompt_tokens, p), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, s))  # a hang-up cancels it here too
    try:
        async for _ in s:
            pass
    except RuntimeError:
        if s.error is None:
            raise
        return _error(_engine_error(state, s))
    finally:
        watcher.cancel()
        state.close(s)
    use = protocol.usage(prompt_tokens, len(s.token_ids))
    finish = protocol.FINISH.get(s.finish_reason, s.finish_reason)
    return JSONResponse(protocol.response(protocol.new_id(chat), state.name, chat, s.text or "", finish, use))


# the sampling variants a decode step takes a path of its own for (greedy, sampled, sampled with top-k/top-p:
# sampling.py); compiled, the first two compile a token choice each and the third samples eagerly (compiled.py)
_VARIANTS = (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=8))


def _warm_up(state: ServerState) -> None:
    """Short requests before the server says it is ready, so the first clients pay no first-step cost:
    one, or with --compile one per sampling variant, one after the other, so that the forward and each
    variant's token choice are compiled, and each variant's decode graph captured, before a client waits
    on them."""
    ids = list(range(1, min(9, state.model.vocab_size)))
    for variant in _VARIANTS if state.serving.get("compile") else _VARIANTS[:1]:
        state.served.submit(ids, max_new_tokens=2, seed=0, **variant).wait()


def _freeze_heap() -> int:
    """Move every object alive now (modules, the model, compiled code, the warm-up's graphs) out of
    the garbage collector's reach -> how many. They live as long as the server; left in, each full
    collection walks all of them while holding the interpreter lock, and a streaming server allocates
    enough to run one every few thousand steps: a stall of every request at once (BENCHMARKS.md,
    Serving). Collected once first, so that no garbage of the start-up is kept for good."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _http_stack(http: str) -> str:
    """Which event loop and HTTP parser uvicorn runs (for "auto": what uvicorn found installed)."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"event loop {loop}, HTTP {http}"


def _lifespan(state: ServerState):
    """The app's lifespan: the engine serves from the warm-up to the server's stop, its timeline saved
    after; meanwhile a watchdog checks that the engine still works."""

    @asynccontextmanager
    async def lifespan(app):
        timeline = state.timeline = Timeline(limit=TIMELINE_LIMIT)  # Serving's default, held here to be saved
        try:
            with gc_pauses(timeline), Engine(state.model) as engine, Serving(engine, **state.serving,
                                                                              timeline=timeline) as served:
                state.served = served
                await asyncio.to_thread(_warm_up, state)
                frozen = f"; {_freeze_heap()} objects kept out of full garbage collections" if state.options.gc_freeze else ""
                print(f"minibatch: serving {state.name!r} ({state.serving['mode']}) on {state.model.device} "
                      f"({_http_stack(state.options.http)}); ready{frozen}", file=sys.stderr, flush=True)
                ready = time.monotonic(), time.thread_time(), served.stats()["loop_cpu_s"]
                watchdog = asyncio.ensure_future(_watch_engine(state))
                try:
                    yield
                finally:
                    watchdog.cancel()
                    state.cancel_all()
                    stats = served.stats()
                    print(f"minibatch: stopping; {stats}", file=sys.stderr, flush=True)
                    print(f"minibatch: since ready: {time.monotonic() - ready[0]:.1f} s, CPU seconds of the HTTP "
                          f"thread {time.thread_time() - ready[1]:.3f} and of the engine's loop "
                          f"{stats['loop_cpu_s'] - ready[2]:.3f} (they share one interpreter lock)",
                          file=sys.stderr, flush=True)
                    state.served = None
        finally:  # also after a failure: the steps before it are what explains it
            gc.unfreeze()  # what the engine held in reference cycles can go now
            if state.options.timeline is not None:
                _save_timeline(timeline, state.options.timeline)

    return lifespan


async def _watch_engine(state: ServerState, every: float = 0.25) -> None:
    """The watchdog: once the engine's loop has failed or a step has hung for `engine_timeout`
    seconds, the engine is dead. Open streams end with an error event (a second for them to reach
    their clients), and the process exits with EXIT_ENGINE_DEAD: a loop stuck in a device wait can
    not be joined, and a supervisor restarts a process that exits, as vLLM's does on EngineDeadError.
    The device process ends with its host (devices/lifecycle.py)."""
    while True:
        await asyncio.sleep(every)
        served = state.served
        reason = served.loop.failure(state.options.engine_timeout) if served is not None and served.loop else None
        if reason is not None:
            break
    print(f"minibatch: the engine is dead: {reason}; /health answers 503, open requests end with an error, "
          f"and the server exits with status {EXIT_ENGINE_DEAD}", file=sys.stderr, flush=True)
    state.die(reason)
    await asyncio.sleep(1.0)
    if state.options.timeline is not None and state.timeline is not None:
        _save_timeline(state.timeline, state.options.timeline)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_ENGINE_DEAD)


def _save_timeline(timeline, path: str) -> None:
    try:
        timeline.save(path)
        print(f"minibatch: wrote {len(timeline.spans)} spans and {len(timeline.marks)} arrivals to {path}",
              file=sys.stderr, flush=True)
    except OSError as e:  # never in place of the error that may be on its way out
        print(f"minibatch: warning: could not write the timeline to {path}: {e}", file=sys.stderr, flush=True)


def create_app(state: ServerState):
    """The FastAPI app: the engine opens in its lifespan and closes (ending open streams) after it.
    Guarded as guard.py says: the api key on /v1, the Host header on a loopback address, /docs only
    when asked for."""
    opts = state.options
    docs = opts.docs
    app = FastAPI(title="minibatch", lifespan=_lifespan(state), docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    if guard.is_loopback(opts.host) and ":" not in opts.host:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(guard.LOOPBACK_NAMES))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # 404, 405, ... in OpenAI's shape too
        return _error(BadRequest(str(exc.detail), None, None, exc.status_code, "invalid_request_error"))

    @app.exception_handler(BadRequest)
    async def refused(request, exc):  # what the dependencies raise
        return _error(exc)

    async def api_key(request: Request) -> None:
        if opts.key:
            guard.check_key(opts.key, request.headers.get("authorization"))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key)])

    @v1.post("/completions")
    async def completions(request: Request):
        return await _handle(state, request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(state, request, chat=True)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                            "owned_by": "minibatch", "max_model_len": state.model.max_positions}]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if state.dead is not None:
            return JSONResponse({"status": "dead", "reason": state.dead}, status_code=503)
        if state.served is None or state.draining:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", **state.served.stats(), "cancelled": state.cancelled, "gc_frozen": gc.get_freeze_count()}

    return app


def model_eos(model):
    """The ids that end a reply: the tokenizer's EOS, else the generation config's (one id or a list)."""
    tok = model.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        return tok.eos_token_id
    gen = getattr(model.hf, "generation_config", None)
    return getattr(gen, "eos_token_id", None)


def serve(model, name: str, options: ServeOptions | None = None, sock=None, **serving) -> int:
    """Run the server until SIGINT or SIGTERM -> exit status (0 after a clean stop, 1 if startup failed;
    a dead engine ends the process with status 3 instead, `_watch_engine`). `options`: how it listens
    and what it guards (guard.ServeOptions); `sock`: a socket bound already (guard.bind: the command
    line binds before it loads the model, so that a port in use fails at once); `serving`: Serving's
    options (mode, max_batch_size, ..., max_queue). Bad serving limits raise here, before the server
    listens (the engine checks them again as it opens).

    `options.timeline`: a file the engine's Timeline is written to as the server stops (every step's
    spans and each request's arrival, the most recent 100,000 to 200,000 spans; `Timeline.load` reads
    it back). `loop` and `http`: uvicorn's event loop and HTTP parser; "auto" takes uvloop and
    httptools where they are installed (the `serve` extra installs them), which cost the HTTP thread
    about a quarter less CPU per streamed token than asyncio's loop and the pure-Python h11
    (BENCHMARKS.md, Serving); that thread shares the interpreter, and so the GIL, with the engine's
    loop. `gc_freeze`: once warm, keep the objects alive then out of Python's full garbage
    collections (`_freeze_heap`); the timeline records each full collection as a "gc" span either way.

    SIGTERM (or SIGINT) drains: new requests get 503, running ones have `grace_period` seconds to
    finish, then the rest end (finish_reason "abort") and the process exits 0."""
    from ..core.config import EngineConfig, serving_config

    opts = options or ServeOptions()
    # max_queue is the serving loop's own, the rest EngineConfig's
    serving_config(model, EngineConfig(**{"mode": "async", **{k: v for k, v in serving.items() if k != "max_queue"}}))
    for option, value, module in (("loop", opts.loop, "uvloop"), ("http", opts.http, "httptools")):
        if value == module and importlib.util.find_spec(module) is None:
            raise ValueError(f"--{option} {module} needs the {module} package (pip install {module}, or "
                             "minibatch's serve extra)")
    if not guard.is_loopback(opts.host) and not opts.key:
        print(f"minibatch: WARNING: serving on {opts.host}, which other machines can reach, without an api key: "
              f"anyone who reaches this port can use the model (set --api-key or {guard.API_KEY_VAR})",
              file=sys.stderr, flush=True)
    state = ServerState(model, name, model_eos(model), serving, opts)
    server = _server(state)
    if serving.get("compile"):
        print("minibatch: compiling the decode step before the server is ready: the forward once for every "
              "batch size and sampling variant, then a small token choice each for greedy and sampled requests "
              "(top-k/top-p sample eagerly); torch's on-disk cache makes the next start shorter",
              file=sys.stderr, flush=True)
    if opts.switch_interval_ms is not None:
        sys.setswitchinterval(opts.switch_interval_ms / 1000)
    # uvicorn raises the signal it caught again once it has stopped; ignoring it then keeps the exit
    # status 0 (the default handlers would end the process with the signal instead)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=None if sock is None else [sock])
    return 0 if server.started else 1


def _server(state: ServerState):
    """uvicorn's server for the app, draining on SIGTERM/SIGINT: uvicorn stops listening and waits up to
    its graceful timeout for the requests under way; streams still open after `grace_period` are ended
    (so that their clients get their last chunk and [DONE]) just before uvicorn gives up on them."""
    import uvicorn

    opts = state.options
    config = uvicorn.Config(create_app(state), host=opts.host, port=opts.port, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=opts.grace_period + 2,
                            loop=opts.loop, http=opts.http)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            loop = self._loop
            if first and loop is not None:
                loop.call_soon_threadsafe(self._drain)

        def _drain(self):
            state.draining = True
            print(f"minibatch: stopping: {len(state.open)} request(s) running get up to {opts.grace_period:g} s "
                  "to finish", file=sys.stderr, flush=True)
            asyncio.get_running_loop().call_later(opts.grace_period, state.cancel_all)

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    server = Server(config)
    server._loop = None
    return server
