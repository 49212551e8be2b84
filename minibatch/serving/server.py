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
import os
import signal
import sys
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..core import VERSION as __version__
from ..core.engine import Engine
from ..core.timeline import Timeline
from .diagnostics import gc_pauses
from .loop import TIMELINE_LIMIT
from .service import Serving
from . import guard, handlers
from .guard import EXIT_ENGINE_DEAD, ServeOptions
from .handlers import ServerState, error_response
from .protocol import BadRequest
from .startup import capture_progress, freeze_heap, http_stack, warm_up

def _serving(engine, state: ServerState, timeline: Timeline) -> Serving:
    """The server's Serving, which says how far its start-up captures are as it starts."""
    serving = Serving(engine, **state.serving, timeline=timeline)
    serving.capture_progress = capture_progress()
    return serving


def _lifespan(state: ServerState):
    """The app's lifespan: the engine serves from the warm-up to the server's stop, its timeline saved
    after; meanwhile a watchdog checks that the engine still works."""

    @asynccontextmanager
    async def lifespan(app):
        timeline = state.timeline = Timeline(limit=TIMELINE_LIMIT)  # Serving's default, held here to be saved
        try:
            with gc_pauses(timeline), Engine(state.model) as engine, _serving(engine, state, timeline) as served:
                state.served = served
                await asyncio.to_thread(warm_up, state)
                frozen = f"; {freeze_heap()} objects kept out of full garbage collections" if state.options.gc_freeze else ""
                if served.startup_captures:
                    frozen += f"; {served.startup_captures} CUDA graphs captured at start-up"
                print(f"minibatch: serving {state.name!r} ({state.serving['mode']}) on {state.model.device} "
                      f"({http_stack(state.options.http)}); ready{frozen}", file=sys.stderr, flush=True)
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
        print(f"minibatch: wrote {len(timeline.spans)} spans and {len(timeline.arrivals())} arrivals to {path}",
              file=sys.stderr, flush=True)
    except OSError as e:  # never in place of the error that may be on its way out
        print(f"minibatch: warning: could not write the timeline to {path}: {e}", file=sys.stderr, flush=True)


def create_app(state: ServerState):
    """The FastAPI app: the engine opens in its lifespan and closes (ending open streams) after it.
    Guarded as guard.py says: the api key on /v1 and the tokenizer's routes, the Host header on a
    loopback address, /docs only when asked for. /health, /metrics and /version stay open."""
    opts = state.options
    app = FastAPI(title="minibatch", version=__version__, lifespan=_lifespan(state),
                  docs_url="/docs" if opts.docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if opts.docs else None)
    if guard.is_loopback(opts.host) and ":" not in opts.host:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(guard.LOOPBACK_NAMES))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # 404, 405, ... in OpenAI's shape too
        return error_response(BadRequest(str(exc.detail), None, None, exc.status_code, "invalid_request_error"))

    @app.exception_handler(BadRequest)
    async def refused(request, exc):  # what the dependencies raise
        return error_response(exc)

    async def api_key(request: Request) -> None:
        if opts.key:
            guard.check_key(opts.key, request.headers.get("authorization"))

    app.include_router(_v1(state, Depends(api_key)))
    app.include_router(_open_routes(state))
    return app


def _v1(state: ServerState, key) -> APIRouter:
    """The OpenAI routes, and the tokenizer's: each behind the api key."""
    v1 = APIRouter(dependencies=[key])

    def post(path: str, answer, **how) -> None:
        async def endpoint(request: Request):
            return await answer(state, request, **how)
        v1.add_api_route(path, endpoint, methods=["POST"], name=path.strip("/").replace("/", "_"))

    post("/v1/completions", handlers.handle, chat=False)
    post("/v1/chat/completions", handlers.handle, chat=True)
    post("/tokenize", handlers.tokens, back=False)
    post("/detokenize", handlers.tokens, back=True)

    def card() -> dict:
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "minibatch",
                "max_model_len": state.model.max_positions}

    @v1.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @v1.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.name:
            raise BadRequest(f"the model {model_id!r} does not exist (this server has {state.name!r})", "model",
                             "model_not_found", 404)
        return card()

    return v1


def _open_routes(state: ServerState) -> APIRouter:
    """What a supervisor or a Prometheus server asks, without a key: /health, /metrics, /version."""
    routes = APIRouter()

    @routes.get("/health")
    async def health():
        if state.dead is not None:
            return JSONResponse({"status": "dead", "reason": state.dead}, status_code=503)
        if state.served is None or state.draining:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", **state.served.stats(), "cancelled": state.cancelled, "gc_frozen": gc.get_freeze_count()}

    @routes.get("/metrics")
    async def metrics():
        body, kind = state.metrics.scrape()
        return Response(body, media_type=kind)

    @routes.get("/version")
    async def version():
        return {"version": __version__}

    return routes


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
    collections (`startup.freeze_heap`); the timeline records each full collection as a "gc" span either way.

    SIGTERM (or SIGINT) drains: new requests get 503, running ones have `grace_period` seconds to
    finish, then the rest end (finish_reason "abort") and the process exits 0."""
    from ..core.config import EngineConfig, serving_config

    opts = options or ServeOptions()
    # max_queue and capture_up_to are Serving's own, the rest EngineConfig's
    own = ("max_queue", "capture_up_to")
    serving_config(model, EngineConfig(**{"mode": "async", **{k: v for k, v in serving.items() if k not in own}}))
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
    if serving.get("capture_up_to"):
        from ..speed.startup_graphs import check_capture
        check_capture(model.device, serving.get("cuda_graphs"), serving.get("compile"), "--capture-up-to")
        steps = "every step's" if serving.get("cuda_graphs") is True else "the decode steps'"
        print(f"minibatch: capturing {steps} CUDA graphs for requests up to {serving['capture_up_to']} tokens before "
              "the server is ready (--capture-up-to)", file=sys.stderr, flush=True)
    if opts.switch_interval_ms is not None:
        sys.setswitchinterval(opts.switch_interval_ms / 1000)
    # uvicorn raises the signal it caught again once it has stopped; ignoring it then keeps the exit
    # status 0 (the default handlers would end the process with the signal instead)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=None if sock is None else [sock])
    except SystemExit:  # uvicorn's own exit when its start-up (the engine's, in the lifespan) failed
        return 1
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
