"""`python -m minibatch bench-serve`: measure any OpenAI-compatible server as its clients see it.

    python -m minibatch bench-serve --url http://127.0.0.1:8000 --rates 2,8,inf --num-prompts 32 \\
        --max-tokens 32 --prompt-len 32 --out out/serve --label async

For each rate, `--num-prompts` streamed completions are sent through the official `openai` async
client as a Poisson process (gaps drawn from a gamma distribution: `--burstiness` 1 is Poisson, lower is
burstier; rate `inf` sends them all at t = 0), at most `--max-concurrency` at a time; bench_report.py
turns each request's timings into TTFT, TPOT, ITL and end-to-end latency percentiles, throughput and
goodput.

Prompts: text of random words from a fixed list, sized to about `--prompt-len` tokens of the server's
own tokenizer (three short requests measure what a word and the template cost first; the server's
`usage.prompt_tokens` of every request is reported), or with `--token-prompts` lists of exactly
`--prompt-len` token ids below 256 (the completions API allows token-id prompts; not every server
does). Every request asks for `max_tokens`; an EOS may end it sooner (`ignore_eos` is not OpenAI), so
output tokens are counted from the server's `usage` (streamed with `stream_options.include_usage`
where the server supports it, else one token per streamed chunk).

A client measures itself too: it reads each chunk when its event loop gets to it, so a client whose
one Python thread is busy parsing other streams' chunks reads two chunks of a stream together and
reports a near-zero gap between them. Each rate reports the client's CPU share (`client_cpu`, the
busiest process's CPU time over the wall time) and warns above 90%; `--processes P` spreads the
requests over P client processes (spawned, each with its own client, all on one monotonic clock).

`--warmup` sends every prompt once, all at once and untimed, before the first rate: a server that
captures CUDA graphs or compiles the first time a step shape comes up pays that there, so the rates
measure a warm server, as `bench --warmup` measures a warm engine offline. Without it, the first rate
includes those costs, as a server's first users would see them. A pause of PAUSE_S separates the
rates, so that a server's timeline (`serve --timeline`) shows each as a burst of its own.

Notebook 08 runs it against `serve` in the sync and the async mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from . import bench_report
from .bench_report import RequestResult

# between two rates (and after the warm-up): the server drains, and its timeline (serve --timeline)
# shows each rate as a burst of its own (serving/diagnostics.py ends one at half a second of nothing)
PAUSE_S = 1.0

# short, distinct, whitespace-free words: a few tokens each in any tokenizer
WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by hot "
         "word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than "
         "call first who may down side been now find").split()


async def _prompt_tokens(client, model: str, prompt, chat: bool) -> int:
    if chat:
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=1, temperature=0.0)
    else:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    return r.usage.prompt_tokens


async def make_prompts(client, model: str, args, chat: bool) -> list:
    """args.num_prompts prompts of about args.prompt_len tokens (exactly, for token-id prompts: args.token_prompts),
    each after the same args.shared_prefix_len tokens (a system prompt every request has in common: what
    prefix caching saves), drawn with args.seed."""
    n, prompt_len, shared_len, rng = args.num_prompts, args.prompt_len, args.shared_prefix_len, random.Random(args.seed)
    if args.token_prompts:
        shared = [rng.randrange(256) for _ in range(shared_len)]
        return [shared + [rng.randrange(256) for _ in range(prompt_len)] for _ in range(n)]
    words = list(WORDS[:48])
    one, two, many = [await _prompt_tokens(client, model, t, chat) for t in ("the", "the the", " ".join(words))]
    overhead = 2 * one - two  # what the template (BOS, roles) adds, whatever the words
    per_word = max((many - overhead) / len(words), 1e-3)
    count = max(1, round((prompt_len - overhead) / per_word))
    shared = [rng.choice(words) for _ in range(round(shared_len / per_word))]
    return [" ".join(shared + [rng.choice(words) for _ in range(count)]) for _ in range(n)]


async def supports_usage(client, model: str, chat: bool) -> bool:
    """Does the server stream `usage` when asked (`stream_options`)? A server that refuses the field: no."""
    import openai
    try:
        kw = dict(model=model, max_tokens=2, temperature=0.0, stream=True, stream_options={"include_usage": True})
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": "the"}], **kw)
        else:
            stream = await client.completions.create(prompt="the", **kw)
        return any([c.usage is not None async for c in stream])
    except openai.BadRequestError:
        return False


def _is_token(chunk, chat: bool) -> bool:
    if not chunk.choices:
        return False
    c = chunk.choices[0]
    if chat:
        return bool(c.delta and c.delta.content)
    return bool(c.text) or c.finish_reason is None


@dataclass(frozen=True)
class Send:
    """What every request of a run shares: whom to ask, for how much, and how (sent to client processes)."""

    model: str
    max_tokens: int
    temperature: float
    seed: int  # request i is sent with seed + i
    chat: bool
    usage: bool  # ask for usage in the stream's last chunk (stream_options), where the server supports it
    max_concurrency: int | None = None

    @classmethod
    def from_args(cls, args, model: str, usage: bool) -> "Send":
        return cls(model, args.max_tokens, args.temperature, args.seed, args.endpoint == "chat", usage,
                   args.max_concurrency)


async def one_request(client, send: Send, prompt, seed: int) -> RequestResult:
    """Send one streamed request; time its chunks as they arrive."""
    r = RequestResult()
    chat = send.chat
    kw = dict(model=send.model, max_tokens=send.max_tokens, temperature=send.temperature, seed=seed, stream=True)
    if send.usage:
        kw["stream_options"] = {"include_usage": True}
    start = last = time.perf_counter()
    tokens = 0
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                r.prompt_tokens, r.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            if _is_token(chunk, chat):
                if tokens == 0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                tokens, last = tokens + 1, now
        r.e2e = last - start
        r.output_tokens = r.output_tokens or tokens
        r.prompt_tokens = r.prompt_tokens or (len(prompt) if isinstance(prompt, list) else 0)
        r.ok = tokens > 0
        r.error = "" if r.ok else "no token streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, never ends the run
        r.error = f"{type(e).__name__}: {e}"[:300]
    return r


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (s): gamma gaps of mean 1/rate (shape `burstiness`; 1 is Poisson), or all at 0 at rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def _client(url: str, timeout: float):
    import openai

    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=timeout)


async def _send_all(client, send: Send, prompts: list, jobs: list, start: float, tick) -> list:
    """Send request i at `start + at` (time.monotonic, one clock for every process) for each (i, at) in jobs."""
    limit = asyncio.Semaphore(send.max_concurrency or len(jobs) or 1)

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        async with limit:
            r = await one_request(client, send, prompts[i], send.seed + i)
        tick()
        return i, r

    return await asyncio.gather(*(one(i, at) for i, at in jobs))


def _client_process(url: str, timeout: float, send: Send, prompts: list, jobs: list, sync: tuple) -> None:
    """One of --processes clients: its share of the requests, on the parent's clock; results to `queue`.
    `sync`: (ready, go, start, queue), the parent's two barriers, start time and result queue."""
    ready, go, start, queue = sync

    async def run():
        client = _client(url, timeout)  # imports openai: before the start, so in no request's latency
        ready.wait()
        go.wait()
        cpu = time.process_time()
        try:
            got = await _send_all(client, send, prompts, jobs, start.value, lambda: queue.put(("tick", None)))
        finally:
            await client.close()
        return got, time.process_time() - cpu

    try:
        queue.put(("done", asyncio.run(run())))
    except BaseException as e:  # noqa: BLE001 - the parent must hear of it rather than wait
        queue.put(("error", f"{type(e).__name__}: {e}"))
        ready.abort()  # a parent still waiting at a barrier stops waiting
        go.abort()


def _in_processes(args, send: Send, prompts: list, jobs: list, bar) -> tuple[list, float, float]:
    """Spread the requests over args.processes client processes -> (results, wall seconds, busiest CPU share)."""
    import multiprocessing as mp
    import queue as queues
    import threading

    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads or event loop inherited
    n = args.processes
    ready, go, start, queue = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Value("d", 0.0), ctx.Queue()
    if send.max_concurrency:  # split the cap between them
        send = dataclasses.replace(send, max_concurrency=max(1, math.ceil(send.max_concurrency / n)))
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(args.url, args.timeout, send, prompts, jobs[k::n], (ready, go, start, queue)))
             for k in range(n)]

    def failed(why: str) -> RuntimeError:
        try:
            kind, value = queue.get(timeout=5)
            if kind == "error":
                why = value
        except queues.Empty:
            pass
        return RuntimeError(f"a bench-serve client process failed: {why}")

    for p in procs:
        p.start()
    try:
        try:
            ready.wait(timeout=120)
            start.value = time.monotonic() + 0.05  # every process reads it after the second barrier
            go.wait(timeout=10)
        except threading.BrokenBarrierError:
            raise failed("it did not start") from None
        results, cpu, done = [], 0.0, 0
        while done < n:
            try:
                kind, value = queue.get(timeout=1.0)
            except queues.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # killed or crashed: it will never report
                    raise failed(f"exit codes {[p.exitcode for p in procs]}") from None
                continue
            if kind == "tick":
                bar.update(1)
            elif kind == "error":
                raise RuntimeError(f"a bench-serve client process failed: {value}")
            else:
                results += value[0]
                cpu, done = max(cpu, value[1]), done + 1
        duration = time.monotonic() - start.value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results, duration, cpu / duration


async def run_rate(client, args, model: str, prompts: list, rate: float, usage: bool, desc: str = "") -> dict:
    """All prompts at one rate -> bench_report.summarize's numbers, with the client's own CPU share."""
    from tqdm.auto import tqdm

    times = arrival_times(len(prompts), rate, args.burstiness, random.Random(args.seed))
    jobs = list(enumerate(times))
    bar = tqdm(total=len(prompts), desc=desc or f"rate {bench_report.rate_key(rate)}", disable=args.no_progress)
    send = Send.from_args(args, model, usage)
    if args.processes > 1:
        results, duration, busy = await asyncio.to_thread(_in_processes, args, send, prompts, jobs, bar)
    else:
        cpu, start = time.process_time(), time.monotonic()
        results = await _send_all(client, send, prompts, jobs, start, lambda: bar.update(1))
        duration = time.monotonic() - start
        busy = (time.process_time() - cpu) / duration
    bar.close()
    s = bench_report.summarize([r for _, r in sorted(results, key=lambda x: x[0])], duration, args.slo)
    s["client_cpu"] = busy
    return s


async def _run(args) -> dict:
    client = _client(args.url, args.timeout)
    try:
        model = args.model or (await client.models.list()).data[0].id
        chat = args.endpoint == "chat"
        usage = await supports_usage(client, model, chat)
        prompts = await make_prompts(client, model, args, chat)
        if args.warmup:  # untimed, all at once, through the same client path as the measured rates
            s = await run_rate(client, args, model, prompts, math.inf, usage, "warm-up")
            print(f"warm-up: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f} s (untimed)",
                  flush=True)
            if s["failed"]:
                raise RuntimeError(f"{s['failed']} warm-up requests failed, e.g. {s['errors'][0]}")
            await asyncio.sleep(PAUSE_S)
        rates = {}
        for i, rate in enumerate(args.rates):
            if i:
                await asyncio.sleep(PAUSE_S)
            rates[bench_report.rate_key(rate)] = s = await run_rate(client, args, model, prompts, rate, usage)
            print(bench_report.format_row(rate, s), flush=True)
            if s["client_cpu"] > 0.9:
                print(f"  warning: the client was busy {s['client_cpu']:.0%} of the run, so its own queueing is in "
                      "these latencies (chunks read late arrive together): spread it with --processes", flush=True)
            for e in s["errors"]:
                print(f"  failed: {e}", flush=True)
    finally:
        await client.close()
    config = {k: getattr(args, k) for k in ("num_prompts", "prompt_len", "shared_prefix_len", "max_tokens",
                                            "burstiness", "max_concurrency", "temperature", "seed", "endpoint",
                                            "token_prompts", "processes", "warmup")}
    return {"url": args.url, "model": model, "config": {**config, "slo_ms": args.slo, "usage_streamed": usage},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": rates}


def main(args) -> int:
    """Run every rate, print a line each, merge into args.out/bench_serve.json and redraw the figure."""
    out = Path(args.out)
    run = asyncio.run(_run(args))
    label = args.label or args.url.split("//")[-1].rstrip("/")
    data = bench_report.save(out, label, run)
    print(f"wrote {out / 'bench_serve.json'} and {bench_report.plot(out, data)}")
    failed = sum(s["failed"] for s in run["rates"].values())
    return 1 if failed else 0
