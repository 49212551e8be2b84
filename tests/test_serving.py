"""The OpenAI-compatible server and bench-serve, end to end: a real server in a subprocess on a free
port, driven by the official `openai` client and by raw HTTP (httpx) for the SSE framing.

One server (async mode, tiny model, CPU) serves the whole module; a second, small one (one running
request, one waiting), started beside it, shows the full queue and then the stop on SIGTERM.
"""

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

import minibatch
from minibatch.serving import bench_report, bench_serve
from minibatch.tools import cli

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The for statement", "A class definition", "Exceptions are raised", "The import system"]


TIMELINE = os.path.join(tempfile.mkdtemp(), "serve_timeline.json")  # the small server's, written as it stops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--device", "cpu",
               "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server was not ready within 60 s:\n{self.output()}")

    def output(self, tail: int | None = 3000) -> str:
        """What the server printed: its last `tail` characters (None: all of it)."""
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        return text if tail is None else text[-tail:]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def servers():
    """Both servers start at once (start-up is mostly imports and loading: they overlap)."""
    big = Server("--mode", "async", "--max-batch-size", "8", "--max-batch-tokens", "128", "--max-queue", "64",
                 "--gc-freeze", "off")  # Python's own garbage collection
    small = Server("--mode", "async", "--max-batch-size", "1", "--max-queue", "1", "--timeline", TIMELINE, "--grace-period", "0",
                   "--loop", "asyncio", "--http", "h11")  # the plain stack; the big one takes what is installed
    try:
        yield big.wait_ready(), small.wait_ready()
    finally:
        big.stop()
        small.stop()
    assert big.proc.returncode == 0, big.output()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    """What offline `generate` gives for a prompt (greedy, the tokenizer's EOS): the text and its ids."""
    model = minibatch.load_model("tiny", device="cpu")
    tok = model.tokenizer
    cache = {}

    def run(prompts, max_new_tokens):
        todo = [p for p in prompts if (p, max_new_tokens) not in cache]
        if todo:
            outs = minibatch.generate(model, [tok.encode(p) for p in todo], max_new_tokens=max_new_tokens,
                                      eos_token_id=tok.eos_token_id)
            cache.update({(p, max_new_tokens): o for p, o in zip(todo, outs)})
        return [cache[p, max_new_tokens] for p in prompts]

    run.tokenizer, run.model = tok, model
    return run


def _expected(offline, prompt, n):
    ids = offline([prompt], n)[0]
    eos = offline.tokenizer.eos_token_id
    return offline.tokenizer.decode(ids), ("stop" if ids and ids[-1] == eos else "length")


def test_the_ready_line_names_the_event_loop_and_the_http_parser(servers):
    import importlib.util

    big, small = servers
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    assert f"event loop {loop}, HTTP {http}); ready" in big.output()
    assert "event loop asyncio, HTTP h11); ready" in small.output()


def test_models_and_health(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    h = server.health()
    assert h["status"] == "ok" and h["kv_blocks"] > 0
    assert {"kv_blocks_free", "running", "waiting"} <= set(h)


def test_a_warm_server_keeps_what_it_loaded_out_of_full_garbage_collections(servers):
    unfrozen, frozen = servers
    kept = re.search(r"ready; (\d+) objects kept out of full garbage collections", frozen.output())
    assert kept and int(kept.group(1)) > 10_000, frozen.output()  # torch's modules and the model at least
    assert frozen.health()["gc_frozen"] > 10_000  # (fewer as frozen objects are freed by their reference counts)
    assert unfrozen.health()["gc_frozen"] == 0 and "kept out of full garbage" not in unfrozen.output()


def test_openai_client_gives_offline_generate_text(server, client, offline):
    for prompt in PROMPTS[:2]:
        text, finish = _expected(offline, prompt, 24)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == text and r.choices[0].finish_reason == finish
        assert r.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        assert len([c for c in chunks if c.choices]) >= r.usage.completion_tokens - 1  # one chunk per token


def test_seeded_sampling_streams_what_it_answers_whole(client):
    kw = dict(model="tiny", prompt="The import system", max_tokens=40, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50})  # top_k is not OpenAI's: the client sends it as an extra field
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == whole and whole


def test_stop_string_ends_the_text_before_it(client, offline):
    text, _ = _expected(offline, PROMPTS[0], 48)
    stop = text[5:8]  # a string the greedy continuation is known to contain
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=48, temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_chat_uses_the_plain_template_and_answers_in_words(client, offline):
    messages = [{"role": "user", "content": "What is a class?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    prompt_ids = offline.tokenizer.encode("User: What is a class?\nAssistant: ")
    assert r.usage.prompt_tokens == len(prompt_ids)
    answer = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and "\nUser:" not in answer
    assert r.choices[0].message.refusal is None
    assert len(answer.split()) >= 3, answer  # greedy, the tiny model says a few words (an empty reply looks broken)
    assert answer == offline.tokenizer.decode(minibatch.generate(offline.model, [prompt_ids], max_new_tokens=30,
                                                                 eos_token_id=offline.tokenizer.eos_token_id)[0])
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def _events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


@pytest.mark.parametrize("path,body,kind", [
    ("/v1/completions", {"prompt": "The for statement"}, "text_completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chat.completion.chunk"),
])
def test_sse_framing(server, path, body, kind):
    body = {**body, "model": "tiny", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == kind and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    if kind == "chat.completion.chunk":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_fifty_concurrent_streams_each_get_their_own_text(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(50)]
    expected = [offline.tokenizer.decode(o) for o in offline(prompts, 10)]

    async def one(c, prompt):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    assert asyncio.run(main()) == expected


def _wait_for(server, check, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if check(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_a_client_hanging_up_cancels_its_request_and_frees_its_blocks(server):
    before = server.health()
    assert before["kv_blocks_free"] == before["kv_blocks"]
    body = {"model": "tiny", "prompt": "The for statement", "max_tokens": 450, "temperature": 0.8, "seed": 1,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):  # a few tokens in: the request holds KV blocks now
            next(lines)
        during = server.health()
    assert during["running"] == 1 and during["kv_blocks_free"] < during["kv_blocks"]
    after = _wait_for(server, lambda h: h["running"] == 0 and h["kv_blocks_free"] == h["kv_blocks"])
    assert after["running"] == after["waiting"] == 0 and after["kv_blocks_free"] == after["kv_blocks"], after
    assert after["cancelled"] == before["cancelled"] + 1


BAD = [  # (endpoint, body, the param the error names)
    ("c", "not json", None), ("c", "[1, 2]", None), ("c", {}, "prompt"), ("c", {"prompt": ""}, "prompt"),
    ("c", {"prompt": 5}, "prompt"), ("c", {"prompt": [1, "a"]}, "prompt"), ("c", {"prompt": ["a", ""]}, "prompt"),
    ("c", {"prompt": [99999]}, "prompt"), ("c", {"prompt": "x" * 600}, "prompt"),
    ("c", {"prompt": "x" * 100_000}, "prompt"),  # past server.INLINE_BODY: parsed in the tokenizer thread
    ("c", {"prompt": "hi", "max_tokens": 0}, "max_tokens"), ("c", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("c", {"prompt": "hi", "max_tokens": True}, "max_tokens"), ("c", {"prompt": "hi", "max_tokens": 600}, "max_tokens"),
    ("c", {"prompt": "hi", "temperature": -1}, "temperature"), ("c", {"prompt": "hi", "temperature": "NaN"}, "temperature"),
    ("c", {"prompt": "hi", "top_p": 0}, "top_p"), ("c", {"prompt": "hi", "top_k": 1.5}, "top_k"),
    ("c", {"prompt": "hi", "seed": -1}, "seed"), ("c", {"prompt": "hi", "stop": 5}, "stop"),
    ("c", {"prompt": "hi", "stop": [""]}, "stop"), ("c", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("c", {"prompt": "hi", "n": 17}, "n"), ("c", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("c", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"), ("c", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    ("c", {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("c", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("c", {"prompt": "hi", "frequency_penalty": "0.5"}, "frequency_penalty"),
    ("h", {}, "messages"), ("h", {"messages": []}, "messages"),
    ("h", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("h", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("h", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ("h", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
]


def test_bad_requests_get_400_with_an_openai_error_and_the_server_goes_on(server, client):
    assert len(BAD) == 35
    for endpoint, body, param in BAD:
        path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
        data = body if isinstance(body, str) else json.dumps(body).replace('"NaN"', "NaN")
        r = httpx.post(server.url + path, content=data, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, (body, error)
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    assert server.health()["status"] == "ok"


def test_bench_serve_measures_the_server_and_merges_runs(server, tmp_path, capsys):
    common = ["bench-serve", "--url", server.url, "--max-tokens", "8", "--prompt-len", "32", "--out", str(tmp_path),
              "--no-progress"]
    with pytest.raises(SystemExit) as e:
        cli.main(common + ["--rates", "20,inf", "--num-prompts", "8", "--label", "text", "--slo", "ttft=60000,tpot=60000"])
    assert e.value.code == 0, capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(common + ["--rates", "inf", "--num-prompts", "4", "--label", "ids", "--token-prompts",
                           "--processes", "2", "--warmup", "--shared-prefix-len", "20"])  # two client processes
    # share the four requests, each of 20 shared tokens and 32 of its own
    printed = capsys.readouterr()
    assert e.value.code == 0, printed
    assert "warm-up: 4 ok, 0 failed" in printed.out, printed  # the untimed pass ran first
    data = json.loads((tmp_path / "bench_serve.json").read_text())
    assert set(data["runs"]) == {"text", "ids"} and (tmp_path / "bench_serve.png").stat().st_size > 0
    text, ids = data["runs"]["text"]["rates"], data["runs"]["ids"]["rates"]
    assert set(text) == {"20", "inf"} and text["inf"]["completed"] == 8 and text["inf"]["failed"] == 0
    assert 24 <= text["inf"]["mean_prompt_tokens"] <= 40  # about --prompt-len, as the server counted them
    assert ids["inf"]["mean_prompt_tokens"] == 20 + 32 and ids["inf"]["completed"] == 4
    assert data["runs"]["ids"]["config"]["shared_prefix_len"] == 20
    assert data["runs"]["ids"]["config"]["processes"] == 2 and data["runs"]["ids"]["config"]["warmup"]
    assert not data["runs"]["text"]["config"]["warmup"]
    for r in (text["inf"], ids["inf"]):  # the client's own CPU share: some, and at most all of one core
        assert 0 < r["client_cpu"] <= 1.05
    s = text["20"]
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and 0 < s["itl_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request met a 60 s target


def test_shared_prefix_prompts_start_alike():
    import argparse
    import asyncio
    args = argparse.Namespace(num_prompts=3, prompt_len=5, shared_prefix_len=4, token_prompts=True, seed=0)
    prompts = asyncio.run(bench_serve.make_prompts(None, "m", args, chat=False))  # (token ids ask no server)
    assert [len(p) for p in prompts] == [9] * 3 and prompts[0][:4] == prompts[1][:4] == prompts[2][:4]
    assert len({tuple(p[4:]) for p in prompts}) == 3


def test_report_arithmetic():
    assert bench_report.percentile([1, 2, 3, 4], 50) == 2.5 and bench_report.percentile([5], 99) == 5
    import random
    times = bench_serve.arrival_times(4000, 8.0, 1.0, random.Random(0))
    assert times[0] == 0 and 4000 / 8 * 0.95 < times[-1] < 4000 / 8 * 1.05
    assert bench_serve.arrival_times(3, math.inf, 1.0, random.Random(0)) == [0, 0, 0]
    with pytest.raises(ValueError, match="--slo"):
        bench_report.parse_slo("ttft=fast")
    r = bench_report.RequestResult(ok=True, prompt_tokens=3, output_tokens=3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2])
    s = bench_report.summarize([r, bench_report.RequestResult(error="x")], 2.0, {"tpot": 150})
    assert s["tpot_ms"]["p50"] == pytest.approx(200) and s["failed"] == 1 and s["goodput"] == 0


def test_full_queue_answers_503_then_sigterm_mid_stream_exits_0_fast(servers):
    small = servers[1]
    try:
        body = {"model": "tiny", "prompt": "The for statement", "max_tokens": 450, "temperature": 0.8, "seed": 1,
                "stream": True}
        with httpx.Client(timeout=30) as c:
            opened = [c.send(c.build_request("POST", small.url + "/v1/completions", json=body), stream=True)
                      for _ in range(4)]
            codes = [r.status_code for r in opened]
            assert codes.count(200) <= 2 and codes.count(503) >= 2, codes  # one running + one waiting at most
            full = next(r for r in opened if r.status_code == 503)
            full.read()
            assert full.headers["retry-after"] == "1" and full.json()["error"]["code"] == "queue_full"
            live = next(r for r in opened if r.status_code == 200)
            lines = live.iter_lines()
            next(lines)
            start = time.monotonic()
            small.proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the open stream ends instead of hanging
            small.proc.wait(5)
            took = time.monotonic() - start
            for r in opened:
                r.close()
        assert small.proc.returncode == 0 and took < 2.0, (small.proc.returncode, took, small.output())
        assert len(rest) < 450
        stopped = re.search(r"minibatch: stopping; (\{.*\})", small.output())  # its last stats, steps counted
        assert stopped and "'steps': 0," not in stopped.group(1) and "'graph_captures': 0" in stopped.group(1), \
            small.output()
        # the two threads' CPU since the server was ready: both served the requests above
        cpu = re.search(r"since ready: ([\d.]+) s, CPU seconds of the HTTP thread ([\d.]+) and of the engine's "
                        r"loop ([\d.]+)", small.output())
        assert cpu and float(cpu.group(2)) > 0 and float(cpu.group(3)) > 0, small.output()
        assert float(cpu.group(3)) < float(cpu.group(1)), small.output()  # CPU of one thread: within the wall
        # --timeline: the engine's steps and the requests' arrivals, written as it stopped
        timeline = minibatch.Timeline.load(TIMELINE)
        computed = {s.step for s in timeline.spans if s.lane == "compute"}
        assert len(computed) == int(re.search(r"'steps': (\d+)", stopped.group(1)).group(1)), small.output()
        # the full collection before the freeze, recorded as the timeline records every one
        assert [s.lane for s in timeline.spans if s.name == "gc"][:1] == ["CPU"], small.output()
        arrivals = [label for _, label in timeline.marks if label.startswith("request ")]
        assert len(arrivals) == 1 + codes.count(200) and arrivals[0] == "request 0", arrivals  # the warm-up first
    finally:
        small.stop()


def test_a_client_process_that_fails_is_an_error_naming_it():
    """--processes: a client process that fails before the start ends the run with its error, not a hang."""
    import argparse

    from tqdm.auto import tqdm

    args = argparse.Namespace(processes=2, url=None, timeout=5.0, max_tokens=1, temperature=0.0, seed=0,
                              endpoint="completions", max_concurrency=None)  # url None: each client fails
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="client process failed: AttributeError"):
        send = bench_serve.Send.from_args(args, "tiny", usage=False)
        bench_serve._in_processes(args, send, ["hi", "ho"], [(0, 0.0), (1, 0.0)], tqdm(disable=True))
    assert time.monotonic() - t0 < 60
