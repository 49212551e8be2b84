"""The OpenAI wire format: request bodies as pydantic models, response bodies and stream chunks built.

A request body is validated once, by `parse(body, chat)`, into a `CompletionRequest` or a
`ChatRequest`; its `sampling(...)` is the engine's SamplingParams, made once per request. Every bad
request gets one message that names its parameter, in OpenAI's error shape: `{"error": {"message",
"type", "param", "code"}}` (`BadRequest`, from pydantic's first error: its location is the param).

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

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..core.requests import SamplingParams

# accepted and ignored: they change nothing about the tokens
IGNORED = ("user", "metadata", "service_tier", "store", "parallel_tool_calls")
# accepted only at the value that turns them off: the engine cannot honour anything else
OFF_VALUES = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "response_format": (None, {"type": "text"}), "min_tokens": (None, 0),
}
PLAIN_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = "\nUser:"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's word for aborted
SEED_LIMIT = 2**63  # seeds are int64 on the device


class BadRequest(Exception):
    """A request the server answers with an OpenAI-style error body instead of tokens."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _refuse(code: str, message: str):
    return PydanticCustomError(code, message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Body(BaseModel):
    """What both endpoints take. Strict: a number sent as a string, or true as a number, is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Any = Field(None, validate_default=True)  # -> a list of strings
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # accepted and ignored (IGNORED)
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    store: Any = None
    parallel_tool_calls: Any = None
    # accepted at their "off" value only (OFF_VALUES)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    min_tokens: Any = None

    @field_validator(*OFF_VALUES)
    @classmethod
    def _off(cls, v, info):
        allowed = OFF_VALUES[info.field_name]
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            raise _refuse("unsupported_parameter", f"'{info.field_name}' is not supported here (only "
                          f"{allowed[0]!r}), got {v!r}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"'n' must be 1 (one choice per request), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError(f"'stop' must be a string or a list of strings, got {v!r}")
        if len(stops) > 16 or any(s == "" for s in stops):
            raise ValueError("'stop' takes at most 16 non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_new_tokens: int, eos_token_id, seed: int, extra_stop=()) -> SamplingParams:
        """The engine's SamplingParams for this request (its ValueError names the engine's field)."""
        return SamplingParams(temperature=self.temperature, top_k=0 if self.top_k in (None, -1) else self.top_k,
                              top_p=self.top_p, seed=seed, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, stop=tuple(self.stop) + tuple(extra_stop))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class CompletionRequest(_Body):
    """A `/v1/completions` body: `prompt` is text or token ids (a batch of one of either is unwrapped)."""

    chat: ClassVar[bool] = False
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one prompt
        elif isinstance(v, list) and v and isinstance(v[0], (str, list)):
            raise ValueError(f"'prompt' holds one prompt per request (got a batch of {len(v)})")
        if isinstance(v, list):
            if not v or not all(_is_int(t) for t in v):
                raise ValueError("'prompt' must be a non-empty string or a non-empty list of token ids")
        elif not isinstance(v, str) or not v:
            raise ValueError(f"'prompt' must be a non-empty string or a non-empty list of token ids, got {v!r}")
        return v

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message: a role and its text (a string, or text parts, joined)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v):
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("holds text parts only")
            return "".join(p["text"] for p in v)
        if not isinstance(v, str):
            raise ValueError(f"must be a string, got {v!r}")
        return v


class ChatRequest(_Body):
    """A `/v1/chat/completions` body: the messages, and `max_completion_tokens` as OpenAI's newer name."""

    chat: ClassVar[bool] = True
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _newer_name(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def prompt(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens  # None: as many as the context leaves


def parse(body, chat: bool) -> CompletionRequest | ChatRequest:
    """A decoded JSON body -> the endpoint's request model, or BadRequest naming the first bad parameter."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise _bad(e.errors(include_url=False)[0]) from None


def _bad(error: dict) -> BadRequest:
    """pydantic's error -> BadRequest: its location as the param ("messages[0].role"), a message naming it."""
    loc = error["loc"]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc)) or None
    kind, message = error["type"], error["msg"]
    if kind == "missing":
        return BadRequest(f"'{param}' is required", param)
    if kind == "extra_forbidden":
        return BadRequest(f"unsupported parameter '{param}'", param, "unsupported_parameter")
    if kind == "unsupported_parameter":
        return BadRequest(message, param, kind)
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
        return BadRequest(message if message.startswith("'") else f"'{param}' {message}", param)
    return BadRequest(f"'{param}': {message[0].lower()}{message[1:]}, got {error.get('input')!r}", param)


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
