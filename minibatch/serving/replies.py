"""The OpenAI wire format's answers: a whole response, the chunks of a stream, the usage (the requests
are protocol.py's)."""

from __future__ import annotations

import time
import uuid

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's word for aborted


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, choices: list[tuple[str, str | None]], use: dict) -> dict:
    """The whole answer of a request that did not stream: `choices` is (text, finish reason) per choice."""
    if chat:
        listed = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None,
                   "finish_reason": finish} for i, (text, finish) in enumerate(choices)]
    else:
        listed = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                  for i, (text, finish) in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": listed, "usage": use}


def _chunk_head(rid: str, model: str, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None, index: int = 0) -> dict:
    """One streamed chunk of choice `index`: some text, a finish reason, or both."""
    body = _chunk_head(rid, model, chat)
    if chat:
        delta = {"content": text} if text else {}
        body["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}]
    return body


def role_chunk(rid: str, model: str, index: int = 0) -> dict:
    """A chat stream's first chunk of choice `index`: the assistant's role."""
    body = _chunk_head(rid, model, True)
    body["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]
    return body


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    """A stream's last chunk before [DONE] where the client asked for usage: no choices."""
    return {**_chunk_head(rid, model, chat), "choices": [], "usage": use}
