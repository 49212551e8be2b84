"""What the server checks before a request reaches the engine: who may call it, what it was sent and
how, and whether the engine behind it still works (README, "Serving"; notebook 08).

    api key      `Authorization: Bearer KEY` on every /v1 route (`--api-key`, or MINIBATCH_API_KEY);
                 /health stays open, for a supervisor's probe
    content type a POST body is JSON sent as `application/json` (415 otherwise): a web page may send a
                 "simple" cross-site POST (text/plain, a form) to a server on this machine without
                 asking, but not a JSON one, which the browser first asks the server about
    Host         bound to a loopback address, only `localhost` and `127.0.0.1` are served, so a
                 page whose name was re-pointed at 127.0.0.1 (DNS rebinding) is refused
    body         at most `max_body` bytes (413), all of it within `body_timeout` seconds (408)
    engine       a loop that failed, or one that has not come back from a step for `engine_timeout`
                 seconds while requests wait, is dead: /health answers 503, open streams end with
                 an error event, and the server exits with status 3 for its supervisor to restart it

Every refusal is OpenAI's error JSON (protocol.BadRequest).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass

from starlette.requests import ClientDisconnect

from .protocol import BadRequest

API_KEY_VAR = "MINIBATCH_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1")
EXIT_ENGINE_DEAD = 3  # the engine failed while serving (0: a clean stop, 1: the server could not start,
# 2: a bad flag or a port in use, cli.main)


@dataclass(frozen=True)
class ServeOptions:
    """How `serve` listens and what it guards (the command line's flags, README "Serving").

    `api_key`: None reads MINIBATCH_API_KEY, "" means none. `max_body_mb`: the largest request body.
    `body_timeout`: seconds a client may take to send its whole body. `engine_timeout`: seconds the
    engine may spend on one step while requests wait before it counts as dead. `grace_period`: seconds
    SIGTERM lets running requests finish before it ends them. `docs`: serve /docs and /openapi.json.
    `timeline`, `loop`, `http`, `gc_freeze`, `switch_interval_ms`: see `serve`."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_mb: float = 4.0
    body_timeout: float = 30.0
    engine_timeout: float = 60.0
    grace_period: float = 30.0
    docs: bool = False
    timeline: str | None = None
    loop: str = "auto"
    http: str = "auto"
    gc_freeze: bool = True
    switch_interval_ms: float | None = None

    @property
    def key(self) -> str:
        """The api key in force ("" for none): the option, else the environment variable."""
        return os.environ.get(API_KEY_VAR, "") if self.api_key is None else self.api_key

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * 2**20)


def is_loopback(host: str) -> bool:
    """True for a name or address that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so that a port in use fails at once (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port left in TIME_WAIT is free)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    # a fork (the cpu device's process, opened later) would hold the socket open too: it would go on
    # accepting connections that nobody answers after the server stops listening on SIGTERM
    os.register_at_fork(after_in_child=sock.close)
    return sock


def check_key(expected: str, authorization: str | None) -> None:
    """Refuse (401) a request whose `Authorization` header is not `Bearer <expected>`."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), expected.encode()):
        raise BadRequest("a valid api key is required: send it as 'Authorization: Bearer KEY'", None,
                         "invalid_api_key", 401, "authentication_error", {"WWW-Authenticate": "Bearer"})


def check_json(content_type: str | None) -> None:
    """Refuse (415) a POST whose body is not declared as JSON."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise BadRequest(f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                         f"{content_type or 'none'!r})", None, "unsupported_media_type", 415)


class ClientGone(Exception):
    """The client closed its connection before its whole body arrived: nobody is left to answer."""


async def read_body(request, limit: int, timeout: float) -> bytes:
    """The request's body, refused if larger than `limit` bytes (413, as soon as that is known) or slower
    than `timeout` seconds to arrive (408); ClientGone if the client hung up meanwhile."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    parts, size = [], 0
    chunks = request.stream().__aiter__()
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            left = deadline - asyncio.get_running_loop().time()
            chunk = await asyncio.wait_for(chunks.__anext__(), max(left, 0.0))
        except StopAsyncIteration:
            return b"".join(parts)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body did not arrive within {timeout:g} s", None, "request_timeout",
                             408) from None
        except ClientDisconnect:
            raise ClientGone() from None
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(chunk)


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"the request body is {size} bytes or more; this server takes at most {limit} "
                      "(serve --max-body-mb)", None, "request_too_large", 413)
