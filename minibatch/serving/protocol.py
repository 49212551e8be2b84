"""The OpenAI wire format: request bodies checked by hand, response bodies and stream chunks built.

Checked by hand (not by pydantic models) so that every bad request gets one clear message that names
its parameter, in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

Parameters that change decoding and that the engine honours: `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `top_k` (-1 or 0: off), `seed`, `stop` (a string or
a list), `stream`, `stream_options.include_usage`. `n` must be 1. Fields that change nothing here
(`user`, `metadata`, `service_tier`, ...) are accepted and ignored; fields the engine cannot honour
(`logprobs`, `tools`, `presence_penalty`, `echo`, ...) are accepted only at their "off" value, and any
other field is a bad request, so a client never silently gets something it did not ask for.

Chat prompts: the tokenizer's own chat template where it has one; otherwise (the tiny model's byte
tokenizer) a plain template, one line per message and an open assistant turn:

    System: {content}
    User: {content}
    Assistant: {content}
    Assistant:

with "\\nUser:" added to the stop strings, so the model's reply ends where it would start the user's
next turn. Notebook 08 explains the server.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

# accepted and ignored: they change nothing about the tokens
IGNORED = {"user", "metadata", "service_tier", "store", "stream_options", "parallel_tool_calls"}
# accepted only at the value that turns them off: the engine cannot honour anything else
OFF_VALUES = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "response_format": (None, {"type": "text"}), "min_tokens": (None, 0),
}
USED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n"}
PLAIN_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = "\nUser:"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's word for aborted


class BadRequest(Exception):
    """A request the server answers with an OpenAI-style error body instead of tokens."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """One request, checked: what the engine's `submit` needs, plus how to answer."""

    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    chat: bool
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a number, got {v!r}", name)
    if v < low or v > high or (low_open and v == low):
        raise BadRequest(f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}", name)
    return float(v)


def _integer(body: dict, name: str, low: int, high: int = 2**63 - 1):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise BadRequest(f"'{name}' must be an integer, got {v!r}", name)
    if not low <= v <= high:
        raise BadRequest(f"'{name}' must be an integer in [{low}, {high}], got {v}", name)
    return v


def _stop(v) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'stop' must be a string or a list of strings, got {v!r}", "stop")
    if len(stops) > 16 or any(s == "" for s in stops):
        raise BadRequest("'stop' takes at most 16 non-empty strings", "stop")
    return stops


def _check_fields(body: dict, own: set[str]) -> None:
    for name, value in body.items():
        if name in USED or name in own or name in IGNORED:
            continue
        if name not in OFF_VALUES:
            raise BadRequest(f"unsupported parameter '{name}'", name, "unsupported_parameter")
        allowed = OFF_VALUES[name]
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise BadRequest(f"'{name}' is not supported here (only {allowed[0]!r}), got {value!r}", name,
                             "unsupported_parameter")


def _common(body: dict, chat: bool, prompt, max_tokens_name: str) -> Params:
    if not isinstance(body.get("model", ""), str):
        raise BadRequest(f"'model' must be a string, got {body['model']!r}", "model")
    n = _integer(body, "n", 1)
    if n is not None and n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest(f"'stream' must be true or false, got {body['stream']!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    top_k = _integer(body, "top_k", -1)
    return Params(prompt=prompt, chat=chat,
                  max_tokens=_integer(body, max_tokens_name, 1) if max_tokens_name in body else (None if chat else 16),
                  temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                  top_k=0 if top_k in (None, -1) else top_k,
                  seed=_integer(body, "seed", 0),
                  stop=_stop(body.get("stop")),
                  stream=body.get("stream", False) is True,
                  include_usage=bool(options and options.get("include_usage")))


def parse_completion(body) -> Params:
    """A `/v1/completions` body -> Params (prompt: text or token ids), or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_fields(body, {"prompt"})
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise BadRequest(f"one prompt per request (got a batch of {len(prompt)})", "prompt")
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) for t in prompt):
            raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest(f"'prompt' must be a non-empty string or a non-empty list of token ids, got {prompt!r}",
                         "prompt")
    return _common(body, False, prompt, "max_tokens")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in PLAIN_ROLES:
            raise BadRequest(f"messages[{i}] needs a 'role' among {sorted(PLAIN_ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, got {content!r}", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def parse_chat(body) -> Params:
    """A `/v1/chat/completions` body -> Params (prompt: the messages), or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_fields(body, {"messages", "max_completion_tokens"})
    if "messages" not in body:
        raise BadRequest("'messages' is required", "messages")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _common(body, True, _messages(body["messages"]), name)


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], list[str]]:
    """Token ids of a chat prompt, and the stop strings its template adds."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False)), []
    lines = [f"{PLAIN_ROLES[m['role']]}: {m['content']}\n" for m in messages]
    return list(tokenizer.encode("".join(lines) + "Assistant:")), [PLAIN_STOP]


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, text: str, finish: str | None, use: dict) -> dict:
    """The whole answer of a request that did not stream."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None, role: bool = False,
          use: dict | None = None) -> dict:
    """One streamed chunk: some text, a finish reason, the chat role, or (no choices) the usage."""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    if use is not None:
        body["choices"], body["usage"] = [], use
        return body
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    return body
