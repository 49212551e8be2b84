"""The OpenAI-compatible HTTP server: a thin FastAPI + uvicorn layer over the engine's `submit`.

    python -m minibatch serve --model tiny [--mode async] [--port 8000]

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (with `"stream": true`, server-sent
events: one `data: {...}` chunk per token, then `data: [DONE]`), `GET /v1/models`, `GET /health`
(the engine's KV blocks, free and in all, its running and waiting requests, and how many requests were
cancelled because their client hung up). The request bodies
(pydantic models) and their checks are protocol.py's.

One engine, sized once, runs its loop in a background thread for the server's whole life (FastAPI's
lifespan); each request is one `Serving.submit(...)` (loop.py), and its stream is read on the event loop without
blocking it. A client that hangs up cancels its request (the engine frees its KV blocks at the next
update); a full queue answers 503 with Retry-After. SIGINT or SIGTERM: the listening socket closes,
open streams end (finish_reason "abort"), and the process exits with status 0.

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
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..core.engine import Engine
from ..core.timeline import Timeline
from .diagnostics import gc_pauses
from .loop import TIMELINE_LIMIT, QueueFull, Serving
from . import protocol
from .protocol import BadRequest, ChatRequest, CompletionRequest

# engine argument names -> the OpenAI parameter a client sent
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt": "prompt", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "stop": "stop"}


class ServerState:
    """What the endpoints share: the model, its engine, the streams still open."""

    def __init__(self, model, name: str, eos, serving: dict, timeline_path: str | None = None, http: str = "auto",
                 gc_freeze: bool = True):
        self.model, self.name, self.eos, self.serving = model, name, eos, serving
        self.timeline_path, self.gc_freeze = timeline_path, gc_freeze
        self.http = http  # uvicorn's HTTP parser, as serve was asked for it
        self.served = None  # the Serving the endpoints submit to, while the engine serves
        self.open: set = set()  # streams not yet finished or given up
        self.cancelled = 0  # requests cancelled because their client hung up
        self.created = int(time.time())

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


async def _sse(state: ServerState, request, s, prompt_tokens: int, p: CompletionRequest | ChatRequest):
    rid, name = protocol.new_id(p.chat), state.name
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, s))
    n = 0
    try:
        if p.chat:
            yield _frame(protocol.chunk(rid, name, True, None, role=True))
        async for c in s:
            n += len(c.token_ids)
            finish = protocol.FINISH.get(c.finish_reason) if c.finish_reason else None
            if c.token_ids or c.text or finish:
                yield _frame(protocol.chunk(rid, name, p.chat, c.text, finish))
        if p.include_usage:
            yield _frame(protocol.chunk(rid, name, p.chat, None, use=protocol.usage(prompt_tokens, n)))
        yield "data: [DONE]\n\n"
    finally:  # also on a client that hung up (GeneratorExit / CancelledError at a yield)
        watcher.cancel()
        state.close(s)


def _error(e: BadRequest):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _handle(state: ServerState, request, chat: bool):
    try:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        p = protocol.parse(body, chat)
        if p.model not in ("", state.name):
            raise BadRequest(f"the model {p.model!r} does not exist (this server has {state.name!r})",
                             "model", "model_not_found", 404)
        s, prompt_tokens = state.submit(p)
    except BadRequest as e:
        return _error(e)
    if p.stream:
        return StreamingResponse(_sse(state, request, s, prompt_tokens, p), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        async for _ in s:
            pass
    finally:
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
    """The app's lifespan: the engine serves from the warm-up to the server's stop, its timeline saved after."""

    @asynccontextmanager
    async def lifespan(app):
        timeline = Timeline(limit=TIMELINE_LIMIT)  # Serving's default, held here to be saved
        try:
            with gc_pauses(timeline), Engine(state.model) as engine, Serving(engine, **state.serving,
                                                                              timeline=timeline) as served:
                state.served = served
                await asyncio.to_thread(_warm_up, state)
                frozen = f"; {_freeze_heap()} objects kept out of full garbage collections" if state.gc_freeze else ""
                print(f"minibatch: serving {state.name!r} ({state.serving['mode']}) on {state.model.device} "
                      f"({_http_stack(state.http)}); ready{frozen}", file=sys.stderr, flush=True)
                ready = time.monotonic(), time.thread_time(), served.stats()["loop_cpu_s"]
                try:
                    yield
                finally:
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
            if state.timeline_path is not None:
                _save_timeline(timeline, state.timeline_path)

    return lifespan


def _save_timeline(timeline, path: str) -> None:
    try:
        timeline.save(path)
        print(f"minibatch: wrote {len(timeline.spans)} spans and {len(timeline.marks)} arrivals to {path}",
              file=sys.stderr, flush=True)
    except OSError as e:  # never in place of the error that may be on its way out
        print(f"minibatch: warning: could not write the timeline to {path}: {e}", file=sys.stderr, flush=True)


def create_app(state: ServerState):
    """The FastAPI app: the engine opens in its lifespan and closes (ending open streams) after it."""
    app = FastAPI(title="minibatch", lifespan=_lifespan(state))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # 404, 405, ... in OpenAI's shape too
        return _error(BadRequest(str(exc.detail), None, None, exc.status_code, "invalid_request_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(state, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                            "owned_by": "minibatch", "max_model_len": state.model.max_positions}]}

    @app.get("/health")
    async def health():
        if state.served is None:
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


def serve(model, *, name: str, host: str = "127.0.0.1", port: int = 8000, switch_interval_ms: float | None = None,
          timeline: str | None = None, loop: str = "auto", http: str = "auto", gc_freeze: bool = True,
          **serving) -> int:
    """Run the server until SIGINT or SIGTERM -> exit status (0 after a clean stop, 1 if startup failed).
    Bad serving limits raise here, before the server listens (the engine checks them again as it opens).
    `timeline`: a file the engine's Timeline is written to as the server stops (every step's spans and
    each request's arrival, the most recent 100,000 to 200,000 spans; `Timeline.load` reads it back).
    `loop` and `http`: uvicorn's event loop and HTTP parser; "auto" takes uvloop and httptools where
    they are installed (the `serve` extra installs them), which cost the HTTP thread about a quarter less
    CPU per streamed token than asyncio's loop and the pure-Python h11 (BENCHMARKS.md, Serving); that
    thread shares the interpreter, and so the GIL, with the engine's loop. `gc_freeze`: once warm, keep
    the objects alive then out of Python's full garbage collections (`_freeze_heap`); the timeline
    records each full collection as a "gc" span either way."""
    from ..core.config import EngineConfig, serving_config

    # max_queue is the serving loop's own, the rest EngineConfig's
    serving_config(model, EngineConfig(**{"mode": "async", **{k: v for k, v in serving.items() if k != "max_queue"}}))
    import uvicorn

    for option, value, module in (("loop", loop, "uvloop"), ("http", http, "httptools")):
        if value == module and importlib.util.find_spec(module) is None:
            raise ValueError(f"--{option} {module} needs the {module} package (pip install {module}, or "
                             "minibatch's serve extra)")
    state = ServerState(model, name, model_eos(model), serving, timeline, http, gc_freeze)
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=1, loop=loop, http=http)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            loop = self._loop
            if loop is not None:  # end open streams now, so their connections close within the grace period
                loop.call_soon_threadsafe(state.cancel_all)

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    if serving.get("compile"):
        print("minibatch: compiling the decode step before the server is ready: the forward once for every "
              "batch size and sampling variant, then a small token choice each for greedy and sampled requests "
              "(top-k/top-p sample eagerly); torch's on-disk cache makes the next start shorter",
              file=sys.stderr, flush=True)
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)
    server = Server(config)
    server._loop = None
    # uvicorn raises the signal it caught again once it has stopped; ignoring it then keeps the exit
    # status 0 (the default handlers would end the process with the signal instead)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1
