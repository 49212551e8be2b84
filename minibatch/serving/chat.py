"""Chat messages as the OpenAI wire format carries them (protocol.py's chat and tokenize bodies take a
list of them): a role and its content, a string or a list of text parts, joined. `plain` hands them to a
chat template (protocol.chat_prompt) as the {"role", "content"} dicts templates take.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator


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


def plain(messages: list[Message]) -> list[dict]:
    """Messages as the chat templates take them: {"role", "content"} each."""
    return [{"role": m.role, "content": m.content} for m in messages]
