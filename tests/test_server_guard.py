"""What the server guards, end to end, each through a real server process on a free port: the api
key, the content type, the Host header, /docs, the body's size and time, malformed JSON, hang-ups,
SIGTERM's drain, a port in use, and a device that dies or stops answering (serving/guard.py).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from test_serving import ROOT, Server

KEY = "test-key-1234"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
LONG = {"model": "tiny", "prompt": "The for statement", "max_tokens": 450, "temperature": 0.8, "seed": 1}


@pytest.fixture(scope="module")
def guarded():
    """A server with an api key, a 16 KiB body limit and a 1 s body timeout."""
    s = Server("--api-key", KEY, "--max-body-mb", str(16 / 1024), "--body-timeout", "1", "--max-batch-size", "4",
               "--grace-period", "30")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _post(server, body, headers=AUTH, path="/v1/completions", **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers=headers, timeout=30, **kw)


def _error_of(r, status: int, code=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert code is None or error["code"] == code, error
    return error


def test_the_api_key_guards_every_v1_route_and_health_stays_open(guarded):
    wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = httpx.get(guarded.url + "/v1/models", timeout=10)
    assert _error_of(r, 401, "invalid_api_key") and r.headers["www-authenticate"] == "Bearer"
    right = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert right.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert [m.id for m in right.models.list()] == ["tiny"]
    assert httpx.get(guarded.url + "/health", timeout=10).json()["status"] == "ok"  # no key needed


def test_only_json_bodies_are_taken(guarded):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):  # what a web page sends unasked
        headers = {"authorization": AUTH["authorization"], **({"content-type": kind} if kind else {})}
        _error_of(_post(guarded, body, headers), 415, "unsupported_media_type")
    assert _post(guarded, body, {**AUTH, "content-type": "application/json; charset=utf-8"}).status_code == 200


def test_a_foreign_host_header_and_docs_are_refused(guarded):
    assert httpx.get(guarded.url + "/health", headers={"host": "attacker.example"}, timeout=10).status_code == 400
    assert httpx.get(guarded.url + "/health", headers={"host": f"localhost:{guarded.port}"}, timeout=10).status_code == 200
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(guarded.url + path, timeout=10).status_code == 404


def test_bodies_too_large_or_malformed_get_an_openai_error(guarded):
    big = json.dumps({"prompt": "x" * 20_000})
    _error_of(_post(guarded, big), 413, "request_too_large")

    def chunked():  # no Content-Length: the limit holds as the body streams in
        for _ in range(40):
            yield b" " * 1024

    _error_of(httpx.post(guarded.url + "/v1/completions", content=chunked(), headers=AUTH, timeout=30), 413,
              "request_too_large")
    for raw in (b'{"prompt": "\\ud800"}', b'{"\\udc00": 1}', b"[" * 5000 + b"]" * 5000, b'{"prompt": "\xff"}',
                b'{"prompt": '):
        error = _error_of(_post(guarded, raw), 400)
        assert "not valid JSON" in error["message"], error
    assert guarded.health()["status"] == "ok"


def _one_response(s: socket.socket) -> str:
    """A whole HTTP response from `s`: the head, then as many bytes as its content-length says (a server
    may send the two in separate writes, so one recv can return the head alone)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data.decode()
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_that_never_comes_times_out(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        start = time.monotonic()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
        answer = _one_response(s)
        took = time.monotonic() - start
    assert answer.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in answer, answer
    assert 0.9 < took < 5, took


def test_hang_ups_cancel_their_request_and_log_one_line(guarded):
    before = guarded.health()
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:  # a whole answer, not a stream
        body = json.dumps(LONG).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                  + body)
        deadline = time.monotonic() + 10
        while guarded.health()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = guarded.health()
        if h["cancelled"] == before["cancelled"] + 1 and h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["cancelled"] == before["cancelled"] + 1 and h["kv_blocks_free"] == h["kv_blocks"], h
    for _ in range(5):  # closed with half a body sent
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.1)
    streams = []
    for _ in range(20):  # streams cut all at once, mid-answer
        c = socket.create_connection(("127.0.0.1", guarded.port), timeout=10)
        body = json.dumps({**LONG, "stream": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        streams.append(c)
    for c in streams:
        c.recv(100)
    for c in streams:
        c.close()
    deadline = time.monotonic() + 15
    while (h := guarded.health())["running"] + h["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["kv_blocks_free"] == h["kv_blocks"], h
    out = guarded.output(tail=None)
    assert "Traceback" not in out and "Exception" not in out, out[-3000:]
    assert out.count("closed its connection before its request body arrived") == 5, out


def test_sigterm_lets_running_requests_finish_then_exits_0():
    s = Server("--grace-period", "30").wait_ready()
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "max_tokens": 150, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            try:  # no new request is taken meanwhile: the port is closed (or, on an open connection, 503)
                late = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=5).status_code
            except httpx.ConnectError:  # (not a timeout: a connection accepted and never answered is no refusal)
                late = "refused"
            rest = [line for line in lines if line.startswith("data: ")]
        assert late in ("refused", 503), late
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
        assert s.proc.wait(20) == 0, s.output()
        assert "get up to 30 s to finish" in s.output()
    finally:
        s.stop()


def test_a_port_in_use_fails_before_the_model_loads(guarded):
    start = time.monotonic()  # (a model that cannot load: had it been loaded first, that would be the error)
    p = subprocess.run([sys.executable, "-m", "minibatch", "serve", "--model", "/no/such/model", "--device", "cpu",
                        "--port", str(guarded.port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"cannot listen on 127.0.0.1:{guarded.port}" in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr  # a user error
    assert time.monotonic() - start < 60


def _device_pid(server) -> int:
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children  # the cpu device's process
    return int(children[0])


def _until_dead(server, within: float) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            r = httpx.get(server.url + "/health", timeout=2)
            if r.status_code == 503:
                return r.json()
        except httpx.TransportError:
            if server.proc.poll() is not None:  # it said so and exited in between: dead too
                return {"status": "dead", "reason": "(exited before the poll: " + server.output()[-300:] + ")"}
        time.sleep(0.05)
    raise AssertionError(f"/health did not turn 503 within {within} s:\n{server.output()}")


def _stream_until(server, signal_device) -> list[str]:
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        signal_device()
        return [line for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGSTOP"])
def test_a_dead_or_stopped_device_ends_streams_with_an_error_and_the_server_exits_3(how):
    """The device process killed (SIGTERM: it no longer ignores one), or stopped (SIGSTOP: the step
    never returns, and --engine-timeout says when that is death)."""
    s = Server("--engine-timeout", "2", "--host", "0.0.0.0").wait_ready()
    try:
        device = _device_pid(s)
        lines = _stream_until(s, lambda: os.kill(device, getattr(signal, how)))
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error", error
        health = _until_dead(s, 10)
        assert health["status"] == "dead" and health["reason"], health
        assert s.proc.wait(15) == 3, s.output()
        out = s.output()
        assert re.search(r"WARNING: serving on 0\.0\.0\.0, which other machines can reach, without an api key", out)
        expected = "SIGTERM" if how == "SIGTERM" else "has not come back from a step"
        assert expected in out and "the engine is dead" in out, out
    finally:
        s.stop()
    assert _gone(device, 5)  # it went with its host, stopped or not


def _gone(pid: int, within: float) -> bool:
    """True once `pid` has exited (a zombie waiting to be reaped counts: it runs no more)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_dead_device_while_idle_turns_health_503():
    s = Server().wait_ready()
    try:
        os.kill(_device_pid(s), signal.SIGKILL)
        health = _until_dead(s, 5)
        assert "SIGKILL" in health["reason"], health
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        _error_of(r, 503, "engine_dead")
        assert s.proc.wait(15) == 3
    finally:
        s.stop()
