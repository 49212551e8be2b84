"""The OpenAI wire format's answers: a whole response, the chunks of a stream, the usage, the logprobs
(the requests are protocol.py's).

Logprobs come in two shapes. Completions (the legacy shape lm-eval reads): parallel lists
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token, a token's top
alternatives as a {token text: logprob} dict (an echoed prompt's first token has None for both:
nothing comes before it). Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": None}`. Token texts are the tokenizer's decoding of each id alone.
"""

from __future__ import annotations

import time
import uuid

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's word for aborted


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(decode, tokens: list, offset: int = 0) -> dict:
    """The completions shape of `tokens` (TokenLogprobs; an int: a token with no logprob), its text
    offsets counted from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = decode([t if isinstance(t, int) else t.token])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if isinstance(t, int) else t.logprob)
        out["top_logprobs"].append(None if isinstance(t, int) else _by_text(decode, t.top))
    return out


def _by_text(decode, top) -> dict:
    """{token text: logprob}, most likely first; two ids with one text (parts of one character) keep the
    higher logprob."""
    out: dict = {}
    for i, lp in top:
        out.setdefault(decode([i]), lp)
    return out


def chat_logprobs(decode, tokens: list) -> dict:
    """The chat shape of `tokens` (TokenLogprobs)."""
    def entry(token: int, logprob: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens], "refusal": None}


def echo(decode, p, i: int, s) -> tuple[str, dict | None]:
    """Choice i's echoed prompt (completions, `echo`; `s` its TokenStream): its text, as sent where it
    was text, and its tokens' logprobs where logprobs were asked for (the first token has none)."""
    prompt = p.prompts[i // p.n]
    text = prompt if isinstance(prompt, str) else decode(s.prompt_ids)
    shown = p.logprobs is not None
    return text, completion_logprobs(decode, [s.prompt_ids[0], *s.prompt_logprobs]) if shown else None


def logprobs(decode, p, tokens: list, offset: int = 0) -> dict | None:
    """`tokens`' logprobs in request `p`'s endpoint's shape, or None where it asked for none."""
    if p.logprob_counts()[0] is None:
        return None
    return chat_logprobs(decode, tokens) if p.chat else completion_logprobs(decode, tokens, offset)


def choice(decode, p, i: int, s) -> tuple:
    """A whole answer's choice i (`s` its TokenStream): (text, finish reason, logprobs), for `response`."""
    text, finish = s.text or "", FINISH.get(s.finish_reason, s.finish_reason)
    if p.chat or not p.echo:
        return text, finish, logprobs(decode, p, s.logprobs)
    echoed, lp = echo(decode, p, i, s)
    if lp is not None:
        after = logprobs(decode, p, s.logprobs, len(echoed))
        lp = {k: lp[k] + after[k] for k in lp}
    return echoed + text, finish, lp


def response(rid: str, model: str, chat: bool, choices: list[tuple], use: dict) -> dict:
    """The whole answer of a request that did not stream: `choices` is (text, finish reason, logprobs or
    None) per choice."""
    if chat:
        listed = [{"index": i, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": lp,
                   "finish_reason": finish} for i, (text, finish, lp) in enumerate(choices)]
    else:
        listed = [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                  for i, (text, finish, lp) in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": listed, "usage": use}


def _chunk_head(rid: str, model: str, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice `index`: some text, a finish reason, or both (and its tokens' logprobs)."""
    body = _chunk_head(rid, model, chat)
    if chat:
        delta = {"content": text} if text else {}
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        body["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
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
