"""One request's way through the server: its body checked and tokenized, its prompts submitted (one
TokenStream per choice), its answer sent whole or as server-sent events (notebook 08). `ServerState`
is what the endpoints share: the model, the Serving, the streams still open, and how the engine stands.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic_core import from_json

from . import guard, protocol, replies
from .guard import ServeOptions
from .loop import QueueFull
from .metrics import Metrics
from .protocol import BadRequest, ChatRequest, CompletionRequest

# engine argument names -> the OpenAI parameter a client sent
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt": "prompt", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "stop": "stop", "prompt_logprobs": "logprobs",
                "logprobs": "logprobs"}


class EngineDead(RuntimeError):
    """The engine behind the server failed or stopped answering: no request can be served any more."""


class ServerState:
    """What the endpoints share: the model, its engine, the streams still open, and how it stands."""

    def __init__(self, model, name: str, eos, serving: dict, options: ServeOptions):
        self.model, self.name, self.eos, self.serving, self.options = model, name, eos, serving, options
        self.served = None  # the Serving the endpoints submit to, while the engine serves
        self.timeline = None  # its Timeline, saved as the server stops
        self.open: dict = {}  # streams not yet finished or given up -> their endpoint ("completions", "chat")
        self.metrics = Metrics(lambda: self.served.stats() if self.served is not None else {"serving": False})
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

    def close(self, s, hung_up: bool = True) -> None:
        """A choice's answer is over (sent, or its client gone): cancel it if the engine is still on it
        (`hung_up`: because its client left, counted in /health's "cancelled"), and count it in the
        metrics ("cancelled" where it had not finished)."""
        endpoint = self.open.pop(s, None)
        if endpoint is None:
            return
        done = s.done
        if not done:
            s.cancel()
            self.cancelled += hung_up
        self.metrics.observe(s, endpoint, None if done else "cancelled")

    def tokens(self, prompt, chat: bool) -> tuple[list[int], list[str]]:
        """One prompt's token ids (text, token ids or chat messages), and stop strings a chat template adds."""
        tok, vocab = self.model.tokenizer, self.model.vocab_size
        if isinstance(prompt, list) and not chat:
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token id {bad[0]} of 'prompt' is outside the vocabulary [0, {vocab})", "prompt")
            return list(prompt), []
        if tok is None:
            raise BadRequest(f"model {self.name!r} has no tokenizer: send 'prompt' as a list of token ids",
                             "messages" if chat else "prompt")
        if chat:
            return protocol.chat_prompt(tok, prompt)
        return list(tok.encode(prompt)), []

    def _fits(self, ids: list[int], max_new_tokens: int | None) -> int:
        """The new tokens a prompt of `ids` may have (400 if the model's context cannot hold them)."""
        context = self.model.max_positions or 2**31
        if len(ids) >= context:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the model's context is {context}", "prompt",
                             "context_length_exceeded")
        max_tokens = context - len(ids) if max_new_tokens is None else max_new_tokens
        if len(ids) + max_tokens > context:
            raise BadRequest(f"'max_tokens' is {max_tokens}, but the prompt's {len(ids)} tokens leave room for "
                             f"{context - len(ids)} in the model's context of {context}", "max_tokens",
                             "context_length_exceeded")
        return max_tokens

    def submit(self, p: CompletionRequest | ChatRequest) -> tuple[list, int]:
        """Check the request against the model, then hand its choices to the engine -> (one stream per
        choice, in choice order: prompt i's j-th choice is choice i * n + j, seeded seed + that index;
        the prompts' tokens, each prompt counted once). Every choice prefills its prompt itself: the
        KV cache shares no blocks between requests. Nothing is submitted unless all choices pass."""
        prompts = [self.tokens(prompt, p.chat) for prompt in p.prompts]
        if any(stop for _, stop in prompts) or p.stop:
            if self.model.tokenizer is None:
                raise BadRequest("'stop' needs a tokenizer, and this model has none", "stop")
        bad = [t for t in p.stop_token_ids or () if not 0 <= t < self.model.vocab_size]
        if bad:
            raise BadRequest(f"stop token id {bad[0]} is outside the vocabulary", "stop_token_ids")
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
        work = []
        for ids, extra_stop in prompts:
            max_tokens = self._fits(ids, p.max_new_tokens)
            for _ in range(p.n):
                params = p.sampling(max_tokens, self.eos, seed + len(work), extra_stop)
                work.append((ids, params))
        self.refuse_new()
        streams, served = [], self.served
        try:
            for ids, params in work:
                if served is None:
                    raise RuntimeError("the server is shutting down")
                streams.append(served.submit(ids, params))
        except ValueError as e:  # the engine names its argument: translate it to the client's name
            param = next((v for k, v in _PARAM_NAMES.items() if k in str(e)), None)
            raise BadRequest(str(e), param) from None
        except QueueFull as e:
            raise BadRequest(f"the server is at capacity: {e}", None, "queue_full", 503, "server_overloaded",
                             {"Retry-After": "1"}) from None
        except RuntimeError as e:  # the loop failed or stopped before the watchdog said so
            raise BadRequest(f"the engine is not running: {e}", None, "engine_dead", 503, "server_error") from None
        finally:  # (a refusal part-way: the choices already submitted are cancelled, not counted as hang-ups)
            self.open.update(dict.fromkeys(streams, "chat" if p.chat else "completions"))
            if len(streams) < len(work):
                for s in streams:
                    self.close(s, hung_up=False)
        return streams, sum(len(ids) for ids, _ in prompts)


def _frame(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _watch_disconnect(state: ServerState, request, streams) -> None:
    """Cancel the request's choices when its client hangs up, even before a first token is sent."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for s in streams:
                state.close(s)
            return


def _engine_error(state: ServerState, s) -> BadRequest:
    """What a request whose engine failed under it is told (its stream raised)."""
    reason = state.dead or f"{type(s.error).__name__}: {s.error}"
    return BadRequest(f"the engine failed while serving this request: {reason}", None, "engine_dead", 500,
                      "server_error")


async def _merged(streams):
    """(choice index, chunk) from every stream as its chunks come, until all have ended; a stream whose
    engine failed gives (index, None) and ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for c in s:
                await queue.put((i, c))
        except RuntimeError:
            if s.error is None:
                raise
            await queue.put((i, None))
        finally:
            await queue.put((i, StopAsyncIteration))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, c = await queue.get()
            if c is StopAsyncIteration:
                left -= 1
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()


def _decoder(state: ServerState):
    """Token ids -> text, for logprobs and echo (a model without a tokenizer names its ids)."""
    tok = state.model.tokenizer
    return tok.decode if tok is not None else (lambda ids: "".join(f"token_id:{i}" for i in ids))


async def _sse(state: ServerState, request, streams, prompt_tokens: int, p: CompletionRequest | ChatRequest):
    rid, name = replies.new_id(p.chat), state.name
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, streams))
    n, failed = 0, None
    offsets = [None] * len(streams)  # each choice's text so far (completions' text_offset); None: nothing sent
    try:
        if p.chat:
            for i in range(len(streams)):
                yield _frame(replies.role_chunk(rid, name, i))
        async for i, c in _merged(streams):
            if c is None:
                failed = streams[i]
                continue
            if offsets[i] is None:
                offsets[i] = 0
                if not p.chat and p.echo:  # the prompt first: its logprobs are complete with its first chunk
                    text, lp = replies.echo(_decoder(state), p, i, streams[i])
                    offsets[i] = len(text)
                    yield _frame(replies.chunk(rid, name, False, text, None, i, lp))
            n += len(c.token_ids)
            finish = replies.FINISH.get(c.finish_reason) if c.finish_reason else None
            if c.token_ids or c.text or finish:
                lp = replies.logprobs(_decoder(state), p, list(c.logprobs), offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"]) if lp and not p.chat else 0
                yield _frame(replies.chunk(rid, name, p.chat, c.text, finish, i, lp))
        if failed is not None:
            yield _frame(_engine_error(state, failed).body())  # an error event, as OpenAI's API sends one
        elif p.include_usage:
            yield _frame(replies.usage_chunk(rid, name, p.chat, replies.usage(prompt_tokens, n)))
        yield "data: [DONE]\n\n"
    finally:  # also on a client that hung up (GeneratorExit / CancelledError at a yield)
        watcher.cancel()
        for s in streams:
            state.close(s)


def error_response(e: BadRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _json(raw: bytes):
    """The body, decoded by pydantic's own JSON parser: lone surrogates, nesting deeper than 200 and bytes
    that are not UTF-8 are refused as invalid JSON, never a 500."""
    try:
        return from_json(raw)
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def _parse(raw: bytes, chat: bool):
    return protocol.parse(_json(raw), chat)


async def tokens(state: ServerState, request, back: bool) -> JSONResponse:
    """`POST /tokenize` (text or chat messages -> ids, as the endpoints would see them) and, `back`,
    `POST /detokenize` (ids -> text), in vLLM's shapes."""
    try:
        return await _with_body(state, request, _tokens, back)
    except BadRequest as e:
        return error_response(e)
    except guard.ClientGone:
        return _gone()


def _tokens(state: ServerState, raw: bytes, back: bool) -> JSONResponse:
    """The answer of /tokenize or (`back`) /detokenize; a BadRequest is the caller's to answer."""
    body = _json(raw)
    tok = state.model.tokenizer
    if tok is None:
        raise BadRequest(f"model {state.name!r} has no tokenizer")
    if back:
        t = protocol.parse_as(protocol.DetokenizeRequest, body)
        bad = [i for i in t.tokens if not 0 <= i < state.model.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {state.model.vocab_size})", "tokens")
        return JSONResponse({"prompt": tok.decode(t.tokens)})
    t = protocol.parse_as(protocol.TokenizeRequest, body)
    if t.messages is not None:
        ids, _ = protocol.chat_prompt(tok, protocol.plain(t.messages))
    else:
        ids = list(tok.encode(t.prompt, add_special_tokens=t.add_special_tokens))
    return JSONResponse({"count": len(ids), "max_model_len": state.model.max_positions, "tokens": ids})


# bodies up to this size are parsed and tokenized on the event loop (about a millisecond); larger ones
# in the server's one tokenizer thread, so that a long prompt stalls no other stream. Not every body
# in a thread of its own: a burst of requests would then be dozens of threads taking turns on the
# interpreter's lock with the engine's loop, each turn up to the switch interval (5 ms)
INLINE_BODY = 64 * 1024


async def _with_body(state: ServerState, request, work, *args):
    """`work(state, body, *args)` on the request's JSON body (checked by guard.py): on the event loop, or
    in the tokenizer thread for a body over INLINE_BODY."""
    guard.check_json(request.headers.get("content-type"))
    raw = await guard.read_body(request, state.options.max_body, state.options.body_timeout)
    if len(raw) <= INLINE_BODY:
        return work(state, raw, *args)
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_thread, work, state, raw, *args)


def _gone() -> Response:
    print("minibatch: a client closed its connection before its request body arrived", file=sys.stderr, flush=True)
    return Response(status_code=400)  # (nobody reads it)


def _parse_and_submit(state: ServerState, raw: bytes, chat: bool):
    p = _parse(raw, chat)
    if p.model not in ("", state.name):
        raise BadRequest(f"the model {p.model!r} does not exist (this server has {state.name!r})",
                         "model", "model_not_found", 404)
    return (p, *state.submit(p))


async def handle(state: ServerState, request, chat: bool):
    """One completion or chat request: checked, tokenized and submitted (a large body off the event
    loop, INLINE_BODY), then answered whole or streamed."""
    try:
        state.refuse_new()
        p, streams, prompt_tokens = await _with_body(state, request, _parse_and_submit, chat)
    except BadRequest as e:
        return error_response(e)
    except guard.ClientGone:
        return _gone()
    if p.stream:
        return StreamingResponse(_sse(state, request, streams, prompt_tokens, p), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, streams))  # a hang-up cancels it here too
    try:
        for s in streams:
            try:
                await s.wait_async()
            except RuntimeError:
                if s.error is None:
                    raise
                return error_response(_engine_error(state, s))
    finally:
        watcher.cancel()
        for s in streams:
            state.close(s)
    use = replies.usage(prompt_tokens, sum(len(s.token_ids) for s in streams))
    choices = [replies.choice(_decoder(state), p, i, s) for i, s in enumerate(streams)]
    return JSONResponse(replies.response(replies.new_id(chat), state.name, chat, choices, use))
