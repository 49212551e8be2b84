"""The OpenAI wire format's requests: bodies as pydantic models, and the chat prompt (replies.py builds
the answers).

A request body is validated once, by `parse(body, chat)`, into a `CompletionRequest` or a
`ChatRequest`; its `sampling(...)` is the engine's SamplingParams, made once per request. Every bad
request gets one message that names its parameter, in OpenAI's error shape: `{"error": {"message",
"type", "param", "code"}}` (`BadRequest`, from pydantic's first error: its location is the param).

Parameters that change decoding and that the engine honours: `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `top_k` (-1 or 0: off), `seed` (choice k of a request
samples with seed + k), `stop` (a string or a list), `stop_token_ids`, `ignore_eos`, `min_tokens` (no
EOS or stop token id before that many tokens), `n` (choices per prompt), a completions `prompt` as a list
of prompts, `stream`, `stream_options.include_usage`, `logprobs` (completions: the top k per token; chat:
`logprobs` and `top_logprobs`), completions' `echo` (with `max_tokens` 0: the prompt scored and nothing
generated, as lm-eval's loglikelihood tasks ask), `presence_penalty`, `frequency_penalty` (each in
[-2, 2]) and `repetition_penalty` (> 0; SamplingParams says what they do). Fields the engine cannot
honour (`tools`, `logit_bias`, `best_of`, ...) are accepted only at
their "off" value, so that a client never silently gets something else than it asked for. Fields that
change nothing here (`user`, `metadata`, ...) and fields this server does not know are accepted and
ignored, the unknown ones with one warning in the log per name, as vLLM does: tools send extras of
their own (guidellm's, a client library's).

Chat prompts: the tokenizer's own chat template where it has one; otherwise (the tiny model's byte
tokenizer) a plain template, one line per message and an open assistant turn:

    System: {content}
    User: {content}
    Assistant: {content}
    Assistant: (and a space)

with "\\nUser:" added to the stop strings, so the model's reply ends where it would start the user's
next turn. Notebook 08 explains the server.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..core.requests import MAX_LOGPROBS, SamplingParams
from .chat import Message, plain

# accepted only at the value that turns them off: the engine cannot honour anything else
OFF_VALUES = {
    "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "response_format": (None, {"type": "text"}),
}
PLAIN_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = "\nUser:"
SEED_LIMIT = 2**63  # seeds are int64 on the device
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 256  # prompts per completions request


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

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: ignored, with a warning (parse)

    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Any = Field(None, validate_default=True)  # -> a list of strings
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt
    ignore_eos: bool = False  # go on past the end-of-sequence token (benchmarks: every reply max_tokens long)
    stop_token_ids: list[int] | None = None  # more tokens that end a reply, as EOS does (kept in it)
    min_tokens: int = Field(0, ge=0)  # no EOS (nor a stop token id) before this many new tokens
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)  # None: 0 (off)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)  # None: 1 (off)
    # accepted and ignored: they change nothing about the tokens
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    store: Any = None
    parallel_tool_calls: Any = None
    # accepted at their "off" value only (OFF_VALUES)
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None

    @field_validator(*OFF_VALUES)
    @classmethod
    def _off(cls, v, info):
        allowed = OFF_VALUES[info.field_name]
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            raise _refuse("unsupported_parameter", f"'{info.field_name}' is not supported here (only "
                          f"{allowed[0]!r}), got {v!r}")
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

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(SamplingParams.logprobs, .prompt_logprobs) for this request."""
        return None, None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_new_tokens: int, eos_token_id, seed: int, extra_stop=()) -> SamplingParams:
        """The engine's SamplingParams for this request (its ValueError names the engine's field)."""
        if self.ignore_eos:
            eos_token_id = None
        if self.stop_token_ids:
            given = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
            eos_token_id = frozenset([*given, *self.stop_token_ids])
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(temperature=self.temperature, top_k=0 if self.top_k in (None, -1) else self.top_k,
                              top_p=self.top_p, seed=seed % SEED_LIMIT, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, stop=tuple(self.stop) + tuple(extra_stop),
                              min_tokens=min(self.min_tokens, max_new_tokens),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class CompletionRequest(_Body):
    """A `/v1/completions` body: `prompt` is text, token ids, or a list of either (one choice per
    prompt and `n`, in order: `prompts`)."""

    chat: ClassVar[bool] = False
    prompt: Any
    max_tokens: int | None = Field(None, ge=0)  # 0 (with echo): score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the top k per token (OpenAI: at most 5)
    echo: bool = False  # the prompt comes back in front of the text (and its tokens' logprobs, with logprobs)

    @model_validator(mode="after")
    def _zero_tokens(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("'max_tokens' is 0, which only makes sense with 'echo' (the prompt's logprobs): "
                             "send at least 1")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # the engine scores a prompt it generates nothing for (max_tokens=0) even when no logprobs are shown
        prompt = self.logprobs if self.echo and self.logprobs is not None else 0 if self.max_tokens == 0 else None
        return self.logprobs, prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v) -> list:
        batch = v if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"'prompt' holds at most {MAX_PROMPTS} prompts, got {len(batch)}")
        for x in batch:
            if isinstance(x, list):
                if not x or not all(_is_int(t) for t in x):
                    raise ValueError("'prompt' must be a non-empty string or a non-empty list of token ids "
                                     "(or a list of those)")
            elif not isinstance(x, str) or not x:
                raise ValueError(f"'prompt' must be a non-empty string or a non-empty list of token ids (or a "
                                 f"list of those), got {x!r}")
        return batch

    @property
    def prompts(self) -> list:
        return self.prompt

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions


class ChatRequest(_Body):
    """A `/v1/chat/completions` body: the messages, and `max_completion_tokens` as OpenAI's newer name."""

    chat: ClassVar[bool] = True
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # each generated token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and the k most likely at its place

    @model_validator(mode="after")
    def _newer_name(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    @property
    def prompts(self) -> list[list[dict]]:
        return [plain(self.messages)]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens  # None: as many as the context leaves


def parse(body, chat: bool) -> CompletionRequest | ChatRequest:
    """A decoded JSON body -> the endpoint's request model, or BadRequest naming the first bad parameter."""
    p = parse_as(ChatRequest if chat else CompletionRequest, body)
    for name in sorted(p.model_extra or ()):
        _warn_once(name)
    return p


_WARNED: set[str] = set()


WARN_AT_MOST = 100  # names warned about; a client sending thousands of made-up fields floods no log


def _warn_once(name: str) -> None:
    """Log an unknown request field the first time a client sends it (as vLLM does); it changes nothing."""
    if name in _WARNED or len(_WARNED) > WARN_AT_MOST:
        return
    _WARNED.add(name)
    if len(_WARNED) > WARN_AT_MOST:
        print(f"minibatch: warning: more than {WARN_AT_MOST} unknown request fields; no more are named",
              file=sys.stderr, flush=True)
        return
    print(f"minibatch: warning: ignoring the request field {name!r}, which this server does not know "
          "(said once per field)", file=sys.stderr, flush=True)


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's shape): text, or chat messages as the chat endpoint renders them."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str = ""
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("'prompt' holds the text to tokenize (or 'messages' a chat): send one of the two")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str = ""
    tokens: list[int]


def parse_as(cls, body):
    """A decoded JSON body -> a `cls` (a pydantic model), or BadRequest naming the first bad parameter."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
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
        if param is None and message.startswith("'"):  # a check of the whole body names its parameter first
            param = message[1:message.index("'", 1)]
        return BadRequest(message if message.startswith("'") else f"'{param}' {message}", param)
    return BadRequest(f"'{param}': {message[0].lower()}{message[1:]}, got {error.get('input')!r}", param)


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[list[int], list[str]]:
    """Token ids of a chat prompt, and the stop strings its template adds."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 — a template refuses what it cannot render (jinja2's raise_exception)
            raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False)), []
    lines = [f"{PLAIN_ROLES[m['role']]}: {m['content']}\n" for m in messages]
    # "Assistant: " with its space: the tiny model, trained on prose only, ends a line that stops at a
    # colon (EOS at once, an empty reply) but goes on after a space, so greedy chat answers in words
    return list(tokenizer.encode("".join(lines) + "Assistant: ")), [PLAIN_STOP]
