# %% [markdown]
# # 08 · Serving: requests that arrive while the engine runs
#
# **What you will learn:** why continuous batching exists at all (requests arrive while the loop
# runs, and each user watches its own tokens appear); how an engine runs its loop in a background
# thread and takes requests from any thread at any moment; what a stream is; the two numbers a
# serving user watches, time to first token (TTFT) and inter-token latency (ITL); and what the
# asynchronous loop trades between them, measured on this machine and on an H200.
#
# **Time:** about 15 minutes (CPU or GPU).

# %%
import json
import os
import threading
import time
from collections import deque

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.timeline import Timeline
from minibatch.serving.diagnostics import bursts, window
from minibatch.serving.service import Serving
from minibatch.tools.online import arrival_times, compare, summarize

torch.manual_seed(0)
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer

# %% [markdown]
# ## 1. A loop in a thread of its own, in twenty lines
#
# Until now `generate` took every prompt at once and returned when all were done. A server cannot
# work that way: requests come one at a time, at moments nobody chose, and each caller wants its
# tokens as they are made. The fix is to give the loop a thread of its own that runs for as long as
# the server does. Callers put requests in a queue; at each step boundary the loop takes whatever
# arrived, runs one step, and hands each request's new tokens to that request's own queue. With
# nothing to do, the loop sleeps on a condition variable, and a new request wakes it.
#
# Here is that idea with a toy "model" that appends the next letter of the alphabet:

# %%
class ToyServer:
    def __init__(self):
        self.cond, self.inbox, self.running = threading.Condition(), deque(), []
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def submit(self, word, n):
        out = deque()                      # this request's own stream of tokens
        with self.cond:
            self.inbox.append([word, n, out])
            self.cond.notify()             # wake the loop if it sleeps
        return out

    def loop(self):
        while True:
            with self.cond:                # sleep until there is work: never spin
                self.cond.wait_for(lambda: self.inbox or self.running)
                self.running += self.inbox  # new requests join at a step boundary
                self.inbox.clear()
            for req in self.running:        # one "step" for every running request
                word, n, out = req
                out.append(chr(ord(word[-1]) + 1))
                req[0], req[1] = word + out[-1], n - 1
            self.running = [r for r in self.running if r[1] > 0]
            time.sleep(0.01)

toy = ToyServer()
a = toy.submit("a", 5)
time.sleep(0.025)                          # the second request arrives while the first runs
b = toy.submit("k", 3)
time.sleep(0.2)
print("".join(a), "".join(b))

# %% [markdown]
# The package does the same with the real loop (`minibatch/serving/loop.py`): a turn takes what
# arrived and honours cancels, and runs one `engine.step()` (the `sync_step` or `async_step` of the
# earlier chapters); the moment that step's update has applied a batch's tokens, they go to each
# request's `TokenStream` (`minibatch/serving/stream.py`). It is a plug-in: the engine of the earlier
# chapters does not know it exists; it calls the run's `on_step` hook (the one `generate(on_step=...)`
# offers), and the loop hangs its delivery there. Why not deliver after `engine.step()` returns? An
# async step may still launch a batch after its update, and a first token held behind that launch
# waits a whole step longer. The engine is sized once for the whole
# serving context, for `max_batch_size` requests of the model's context: its KV cache, IO slots and
# (on a GPU) CUDA graphs serve every request that comes.
#
# ## 2. Submit, stream, cancel
#
# `Serving(engine, ...)` (`minibatch/serving/service.py`) starts the loop thread for the length of a `with` block; its `submit`
# returns a stream at once, from any thread. Iterating the stream gives chunks as they are made, each with its
# new tokens and the text they add:

# %%
engine = minibatch.Engine(model)
with Serving(engine, mode="async", max_batch_size=8) as serving:
    s = serving.submit("The for statement", max_new_tokens=48, stop=["\n\n"])
    for chunk in s:
        print(chunk.text, end="", flush=True)
    print()
    print("finish reason:", s.finish_reason, "| tokens:", len(s.token_ids))
    # the same request alone, offline, gives the same tokens: one loop serves both
    print("same as generate:", s.token_ids == minibatch.generate(model, ["The for statement"],
                                                                  max_new_tokens=48)[0][:len(s.token_ids)])

# %% [markdown]
# The stream stopped at `"\n\n"` if the text held one (the text ends before the stop string),
# else after 48 tokens. A stream keeps its chunks, so a reader that starts late misses nothing,
# and `async for chunk in s` does the same from asyncio without ever blocking the event loop (the
# engine's thread wakes the event loop through `call_soon_threadsafe`, once per step for all the
# streams that step fed: each call is a system call and a turn of the event loop, and a server
# streaming to 64 clients would otherwise pay 64 of them per step).
#
# Requests come and go while others run. Below, three requests are submitted at different moments
# from a thread of their own, and one is cancelled halfway; every request still gives exactly the
# tokens it gives alone:

# %%
tl = Timeline()
prompts = ["A class definition", "Exceptions are raised", "The import system"]
with Serving(engine, mode="async", max_batch_size=8, timeline=tl) as serving:
    streams = []
    for p, n in zip(prompts, (40, 400, 40)):
        streams.append(serving.submit(p, max_new_tokens=n))
        time.sleep(0.05)                   # the next request arrives while the others decode
    streams[1].cancel()                    # at most two more chunks arrive after this
    for s in streams:
        s.wait()
for p, s in zip(prompts, streams):
    alone = minibatch.generate(model, [p], max_new_tokens=400)[0]
    print(f"{p!r:25} {s.finish_reason:9} same tokens as alone: {s.token_ids == alone[:len(s.token_ids)]}")

fig, ax = plt.subplots(figsize=(11, 2.8))
tl.plot(ax=ax, title="three requests arriving (▼) while the asynchronous loop runs")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_arrivals_timeline_cpu.png", dpi=110)

# %% [markdown]
# Each ▼ is a request reaching the engine. It joins the batch at the next step boundary; from then
# on its decode token rides along with the others'. The cancelled request frees its KV blocks at the
# next update, even though the asynchronous loop already has its next token in flight (that token
# is dropped, as for an EOS found one step late in notebook 05).
#
# ## 3. Time to first token and inter-token latency
#
# A user waiting on a stream feels two numbers:
#
# * **TTFT**, from submitting to the first token: waiting for a seat, the prefill, one step;
# * **ITL**, the gap between two tokens: one step of the whole batch.
#
# Overlap changes both. In the asynchronous loop the host prepares step N+1 while the device runs
# step N, so each step, and each gap between tokens, loses the host's share. But a request that
# arrives now can only join the next batch the host *plans*, and the host is one step ahead: it
# may wait for the step in flight first, so TTFT can grow by up to one step (SGLang saw its median
# TTFT bound move from 80 to 86 ms when it turned overlap on).
#
# Below, 18 requests arrive as a Poisson process (random gaps, a mean rate per second) at three
# rates, in each mode; every number comes from the streams' own timestamps
# (`minibatch/tools/online.py`). On this 2-core machine the measured values vary from run to run, so
# they are printed but not checked:

# %%
# NBVAL_IGNORE_OUTPUT
work = [tok.encode(p) for p in prompts * 6]
rows = compare(model, work, rates=[8, 32, float("inf")], max_new_tokens=24, max_batch_size=8)
print(f"{'rate/s':>7} {'mode':>5} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>6}")
for r in rows:
    print(f"{r['rate']:>7} {r['mode']:>5} {r['ttft_p50_ms']:7.0f}ms {r['itl_p50_ms']:6.1f}ms "
          f"{r['itl_p99_ms']:6.1f}ms {r['tok_per_s']:6.0f}")

# %% [markdown]
# On a CPU the host and the emulated device share two cores, so the overlap is partial (notebook 06):
# expect async's ITL a little below sync's when the batch is full, and noisy numbers at low rates,
# where most steps hold one or two requests.
#
# ## 4. On an H200
#
# The same measurement on one H200 (an 8B-shaped model with random weights in bf16, 256-token
# prompts, 256 new tokens, `scripts/online_bench.py`, recorded in `figures/data/`):

# %%
ONLINE_GPU = "../figures/data/runs/gpu_online_2026-12-01/online_bench.json"
gpu = json.load(open(ONLINE_GPU))
print(gpu["meta"]["gpu"], gpu["meta"]["model"], gpu["meta"]["dtype"], gpu["meta"]["date"])
by = {(r["mode"], r["rate"]): r for r in gpu["rows"]}
rates = sorted({r["rate"] for r in gpu["rows"]})
print(f"{'rate/s':>7} {'TTFT p50 sync':>14} {'async':>6} {'ITL p50 sync':>13} {'async':>6} {'async/sync ITL':>15}")
for rate in rates:
    s, a = by[("sync", rate)], by[("async", rate)]
    print(f"{rate:>7} {s['ttft_p50_ms']:12.0f}ms {a['ttft_p50_ms']:4.0f}ms {s['itl_p50_ms']:11.2f}ms "
          f"{a['itl_p50_ms']:4.2f}ms {a['itl_p50_ms'] / s['itl_p50_ms']:15.2f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
labels = ["inf" if r == float("inf") else f"{r:g}" for r in rates]
for mode, colour in (("sync", "#4C72B0"), ("async", "#C44E52")):
    axes[0].plot(labels, [by[(mode, r)]["ttft_p50_ms"] for r in rates], "o-", color=colour, label=mode)
    axes[1].plot(labels, [by[(mode, r)]["itl_p50_ms"] for r in rates], "o-", color=colour, label=mode)
axes[0].set(title="time to first token, p50", xlabel="arrival rate (requests/s)", ylabel="ms")
axes[1].set(title="inter-token latency, p50", xlabel="arrival rate (requests/s)", ylabel="ms")
for ax in axes:
    ax.legend()
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_online_gpu.png", dpi=110)

# %% [markdown]
# On the GPU the host and the device do not compete, so every gap between tokens shrinks by the
# host's share of a step, at every rate. TTFT is dominated by waiting for a seat and by prefill;
# the step in flight that a new request waits for is a few milliseconds of it.

# ### Where a newcomer's first token waits
#
# A server's timeline marks three moments of every request: its arrival at the engine, its
# admission into a batch by the scheduler, and its first token handed to its stream
# (`python scripts/ttft_breakdown.py TIMELINE` sums them up). Here is one request of a recorded run
# of the 8B server over HTTP on an H200 (async loop, 4 requests per second), from its arrival to its
# first token:

# %%
RUN = "../figures/data/runs/gpu_serving_latency_2026-12-03"
tl = Timeline.load(f"{RUN}/before/timeline-async.json.gz")
moments = tl.request_marks()["29"]  # its arrival, admission and first token
compute = {s.step: s.duration for s in tl.spans if s.lane == "compute"}
# the step whose planning admitted it: the "prepare" span on the CPU lane around the admission
admitting = next(s.step for s in tl.spans if s.name == "prepare" and s.start <= moments["scheduled"] <= s.end)
typical = sorted(compute.values())[len(compute) // 2]
print(f"queued {1e3 * (moments['scheduled'] - moments['request']):.1f} ms, admitted -> first token "
      f"{1e3 * (moments['first'] - moments['scheduled']):.1f} ms; the step that holds its prompt (step {admitting}) "
      f"computes {1e3 * compute[admitting]:.1f} ms, a typical step {1e3 * typical:.1f} ms")


def request_timeline(tl, moments, start, end, title, png, held=None):
    """The timeline from start to end, with a request's admission and first token (and a held span) marked."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    tl.plot(ax, start=start, end=end, step_labels=True)
    if held:
        ax.axvspan(held[0] - start, held[1] - start, color="#C44E52", alpha=0.15, label="token held")
    for kind, colour, label in (("scheduled", "#4C72B0", "admitted"), ("first", "#C44E52", "first token")):
        ax.axvline(moments[kind] - start, color=colour, linestyle="--", linewidth=1, label=label)
    ax.legend(loc="lower right", fontsize=7, ncol=3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(f"{FIGURES}/{png}", dpi=110)


request_timeline(tl, moments, moments["request"] - 0.025, moments["first"] + 0.015,
                 "one request's time to first token, 8B on an H200 (attention with a mask)", "08_ttft_timeline.png")

# %% [markdown]
# The loop admitted it within two milliseconds; the time went into the step that holds its prompt,
# ten times as long as a decode step, and then the async loop's one step more: the host waits for a
# step only after it has launched the next. That long step was not the prompt's arithmetic. Decode
# steps are CUDA graphs, one launch each; a step with a prompt in it runs eagerly, and while the
# host launches its kernels one by one (no span on the CPU lane) the GPU runs each as it comes, so
# the step lasts as long as its launching. Its attention made that worse: every query of a flat
# step looked at the step's whole key list through a [tokens, keys] mask, and SDPA with a mask
# plans for each new shape, which an admitting step nearly always has (our reading of the numbers;
# a profile would tell). FlashAttention's variable-length kernel takes each chunk against its own
# keys, the chunks' offsets given as tensors (`Model.flat_attention = "varlen"`,
# `minibatch/model/attention.py`). What `ttft_breakdown.py` printed for the same workload, sync,
# before and after (the benchmark history BENCHMARKS.md links has the whole table): the admitting
# step less than half as long, still several decode steps long, since it is still launched kernel
# by kernel.

# %%
for when in ("before", "after"):
    for line in open(f"{RUN}/{when}/ttft.txt"):
        if line.startswith("timeline-sync"):
            print(f"{when:7}", line.rstrip())

# %% [markdown]
# ### A first token held back by the next launch
#
# With the faster attention, the async server still gave its newcomers their first token later than
# the sync one did, at 16 and 32 requests per second (BENCHMARKS.md, "Serving latency", and its
# history). The timeline of that run says where: below, one request of the async server at 16 requests per second. Its step
# (the long compute span) ends, and its first token is delivered only about fifty milliseconds later.
# In between, the host launched the *next* step, another eager one with a newcomer's prompt in it,
# kernel by kernel, and only then waited for the step that held the token. That is the async loop's
# order, launch N+1 and then wait for N, which pays when a launch takes a moment (a CUDA graph) and
# costs a whole step when the launch itself lasts as long as the step. Every stream's token of that
# step waited the same way.

# %%
HELD = "../figures/data/runs/gpu_serving_held_tokens_2026-12-03"
tl = Timeline.load(f"{HELD}/async/timeline-async.json.gz")
moments = tl.request_marks()["89"]  # a request of the rate-16 burst
admitting = next(s.step for s in tl.spans if s.name == "prepare" and s.start <= moments["scheduled"] <= s.end)
done = next(s.end for s in tl.spans if s.lane == "compute" and s.step == admitting)
print(f"admitted -> its step done {1e3 * (done - moments['scheduled']):.0f} ms, then held "
      f"{1e3 * (moments['first'] - done):.0f} ms until its first token was delivered")
request_timeline(tl, moments, moments["scheduled"] - 0.015, moments["first"] + 0.01,
                 "async, 8B on an H200: the first token waits while the next eager step is launched",
                 "08_held_token_gpu.png", held=(done, moments["first"]))

# %% [markdown]
# `ttft_breakdown.py --bursts` counts it for every request ("held": from the end of the request's step
# to its first token), per rate. Sync waits for each step right after launching it, so its tokens are
# never held:

# %%
import re

print(f"{'(medians, ms)':34} {'to first token':>14} {'its step':>9} {'held':>6}")
for line in open(f"{HELD}/ttft.txt"):  # bursts 3 and 4: 16 and 32 requests per second
    if line.startswith("timeline-") or "burst 3 " in line or "burst 4 " in line:
        n = re.findall(r"nan|[\d.]+", line[34:])  # requests, then (median, 90th percentile) of each column
        print(f"{line[:34]} {n[3]:>14} {n[7]:>9} {n[9]:>6}")

# %% [markdown]
# So the async loop now keeps its order only where launching is quick. Before a step that the host
# launches kernel by kernel (on a GPU, a step that is not a CUDA graph: `StepRunner.launch_bound`), it
# first waits for batch N and hands out its tokens, then launches N+1: the GPU idles for the update
# alone, since it would have waited for those kernels anyway, and the carry-over still works, because
# batch N+1 was planned with placeholders before the wait. `minibatch/core/async_loop.py` has the two
# orders side by side.
#
#
# ## 5. Over HTTP
#
# Clients reach an engine over HTTP with a client they already have. `python -m minibatch serve`
# puts this engine behind the same API as vLLM, SGLang and `transformers serve`: `/v1/completions`
# and `/v1/chat/completions`, whole answers or server-sent events (one `data: {...}` line per token,
# then `data: [DONE]`), in a FastAPI app whose handlers only `submit` and read the `TokenStream`
# (`minibatch/serving/server.py`). Below, the server runs in a process of its own on this machine,
# and the official `openai` client asks it for a streamed completion. Greedy decoding makes the
# answer the one offline `generate` gives:

# %%
import socket
import subprocess
import sys
import tempfile
import urllib.request

from openai import OpenAI


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


port = free_port()
url = f"http://127.0.0.1:{port}"
server_log = tempfile.TemporaryFile(mode="w+")
server_timeline = os.path.join(tempfile.mkdtemp(), "timeline.json")  # written as the server stops
server = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--device", "cpu",
                           "--port", str(port), "--max-batch-size", "8", "--timeline", server_timeline],
                          stdout=server_log, stderr=server_log)
deadline = time.monotonic() + 180
while True:  # the server answers /health once its engine is open and warm
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        if server.poll() is not None or time.monotonic() > deadline:
            server_log.seek(0)
            raise RuntimeError("the server did not start:\n" + server_log.read()[-2000:])
        time.sleep(0.2)

client = OpenAI(base_url=url + "/v1", api_key="none")
pieces = [c.choices[0].text for c in client.completions.create(
    model="tiny", prompt="The for statement", max_tokens=24, temperature=0, stream=True)]
offline = tok.decode(minibatch.generate(model, [tok.encode("The for statement")], max_new_tokens=24,
                                        eos_token_id=tok.eos_token_id)[0])
print(len(pieces), "streamed chunks:", repr("".join(pieces)))
print("offline generate:  ", repr(offline))
print("same text:", "".join(pieces) == offline)

# %% [markdown]
# ### How sure was the model? Logprobs
#
# A server can also say how likely each token was. With `logprobs=k` every generated token comes
# back with its log-probability and the `k` most likely tokens at its place; with `echo=True` the
# prompt comes back in front of the text, its tokens scored too (all but the first: nothing comes
# before it). The engine computes them on the device, in the step that samples, from the model's
# raw logits (`logprobs` in `minibatch/core/sampling.py`), and copies them back beside the sampled
# ids, so the loop waits for nothing more. The prompt's scores come from the prefill: each prompt
# position's logits score the next prompt token. A greedy token is always its place's most likely one:

# %%
import math

prompt = "The for statement"
r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, echo=True, logprobs=3)
lp = r.choices[0].logprobs
n_prompt = len(tok.encode(prompt))
print("text:", repr(r.choices[0].text))
print("tokens:", len(lp.tokens), f"({n_prompt} of the prompt, {len(lp.tokens) - n_prompt} generated)")
print("greedy tokens are the top-1:", all(max(top.values()) == v for v, top in
                                          zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:])))

probs = [0.0 if v is None else math.exp(v) for v in lp.token_logprobs]
fig, ax = plt.subplots(figsize=(11, 3.2))
ax.bar(range(len(probs)), probs, color=["#4C72B0" if i < n_prompt else "#C44E52" for i in range(len(probs))])
ax.set_xticks(range(len(probs)), [repr(t)[1:-1] or "BOS" for t in lp.tokens], fontsize=8)
ax.set(ylabel="probability", ylim=(0, 1),
       title="each token's probability under the model: the prompt (blue, from the prefill), then the reply (red)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_logprobs.png", dpi=110)

# %% [markdown]
# The prompt's letters after the first of each word are easy for a model trained on such text; the
# first letter of a word is where it hesitates. Evaluation harnesses use exactly this to grade a
# model on multiple-choice questions: lm-eval sends each candidate answer after its question with
# `echo=True` and no new tokens, adds up the answer tokens' logprobs, and picks the likeliest answer
# (`tests/test_server_openai.py` sends its exact request). Here, which ending is likelier?


# %%
def score(context: str, answer: str) -> float:
    ids = tok.encode(context)
    full = ids + tok.encode(answer, add_bos=False)
    r = client.completions.create(model="tiny", prompt=[full], max_tokens=0, echo=True, logprobs=0)
    return sum(r.choices[0].logprobs.token_logprobs[len(ids):])  # the answer's tokens only


for answer in (" loops over a list", " loops over a banana"):
    print(f"{answer!r:24} log-likelihood {score('The for statement', answer):7.2f}")

# %% [markdown]
# ### Fewer repeats: penalties
#
# Greedy decoding of a small model loops: "of the statement of the sta...". The OpenAI API has two
# knobs against it: `presence_penalty` lowers the logit of every token already in the output once,
# `frequency_penalty` once per time it occurs; vLLM adds `repetition_penalty`, which shrinks the logit
# of every token seen in the prompt or the output. The device keeps no memory between steps, so each
# step that samples for a penalized request carries that request's earlier tokens, except the newest,
# which only the device knows yet in the async loop (it reads it from the step's input ids, after
# carry-over). It counts them with one scatter-add and subtracts (`minibatch/core/penalties.py`):

# %%
for extra in ({}, {"presence_penalty": 1.0}, {"frequency_penalty": 1.0}):
    r = client.completions.create(model="tiny", prompt="The for statement", max_tokens=40, temperature=0, **extra)
    print(f"{str(extra or 'no penalty'):28} {r.choices[0].text!r}")

# %% [markdown]
# `python -m minibatch bench-serve` measures any such server the way its users see it: it sends
# requests through the `openai` client as a Poisson process at each rate (`inf`: all at once), times
# every streamed chunk, and reports TTFT, TPOT (time per output token after the first), ITL,
# throughput and goodput (requests per second that met every latency target). Here: 16 requests at
# 8 per second and all at once. The latencies vary from run to run on a shared CPU; the count of
# failed requests does not:

# %%
# NBVAL_IGNORE_OUTPUT
bench_out = tempfile.mkdtemp()
done = subprocess.run([sys.executable, "-m", "minibatch", "bench-serve", "--url", url, "--rates", "8,inf",
                       "--num-prompts", "16", "--prompt-len", "32", "--max-tokens", "16", "--no-progress",
                       "--slo", "ttft=500,tpot=50", "--out", bench_out, "--label", "async"],
                      capture_output=True, text=True)
print(done.stdout)

# %%
measured = json.load(open(os.path.join(bench_out, "bench_serve.json")))["runs"]["async"]["rates"]
print({rate: f"{r['completed']} ok, {r['failed']} failed" for rate, r in measured.items()})
server.terminate()  # SIGTERM: stop taking requests, let running ones finish, exit 0
print("server exit code:", server.wait(timeout=30))

# %% [markdown]
# The server was started with `--timeline FILE`, so as it stopped it wrote its engine's timeline:
# every step's spans, as in notebook 06, and each request's arrival as a mark. `bursts(timeline)`
# cuts it into busy periods (a pause of half a second ends one; `bench-serve` pauses a second
# between rates) and `window(timeline, start, end)` sums one up (both in
# `minibatch/serving/diagnostics.py`). The last burst is rate inf: all sixteen
# requests sent at once, yet they reach the engine one HTTP request at a time, over some
# milliseconds, and the steps that serve them are what the offline engine's would be plus the
# effect of sharing the CPU with the HTTP server and the client (`scripts/timeline_bursts.py`
# prints the same table for any timeline file, the offline benchmark's included):

# %%
# NBVAL_IGNORE_OUTPUT
served = Timeline.load(server_timeline)
print(f"{'start s':>8} {'arrived':>7} {'over ms':>8} {'steps':>6} {'busy':>5} {'ms/step':>8}")
for start, end in bursts(served):
    w = window(served, start, end)
    print(f"{start:8.2f} {w['arrivals']:7d} {1000 * w['arrival_spread_s']:8.1f} {w['steps']:6d} "
          f"{w['device_busy']:5.0%} {w['ms_per_step']:8.2f}")

# %%
last = window(served, *bursts(served)[-1])
print("requests in the last burst:", last["arrivals"], "| steps:", last["steps"] > 0)

# %% [markdown]
# On an H200 the same benchmark ran against our server (async loop, 8B-shaped model saved as a
# folder, 64 requests of 256 prompt tokens and 256 new tokens) and against `transformers serve
# --continuous-batching` on the same folder, in its own process, with its default settings
# (`scripts/gpu/serve_bench.sh`, recorded in `figures/data/`):

# %%
SERVE_GPU = "../figures/data/runs/gpu_serving_2026-12-01/bench_serve.json"
runs = json.load(open(SERVE_GPU))["runs"]
print(f"{'rate/s':>7} {'server':>13} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>6}")
for label, name in (("async", "ours (async)"), ("transformers", "transformers")):
    for rate, r in runs[label]["rates"].items():
        print(f"{rate:>7} {name:>13} {r['ttft_ms']['p50']:7.0f}ms {r['itl_ms']['p50']:6.1f}ms "
              f"{r['itl_ms']['p99']:6.1f}ms {r['output_throughput']:6.0f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
order = ["4", "16", "32", "inf"]
for label, name, colour in (("async", "ours (async)", "#C44E52"), ("transformers", "transformers serve", "#55A868")):
    keys = [k for k in order if k in runs[label]["rates"]]
    for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
        ax.plot([order.index(k) for k in keys], [runs[label]["rates"][k][metric]["p50"] for k in keys], "o-",
                color=colour, label=name)
for ax, title in zip(axes, ("time to first token, p50", "inter-token latency, p50")):
    ax.set(title=title, xlabel="arrival rate (requests/s; inf: all at once)", ylabel="ms (log scale)", yscale="log")
    ax.set_xticks(range(len(order)), order)
    ax.legend()
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_http_gpu.png", dpi=110)

# %% [markdown]
# At rate inf our server streamed 3599 <!-- from figures/data/headline.json: serving.ours_inf_tok_s --> tokens per second against
# transformers' 638 <!-- from figures/data/headline.json: serving.tf_inf_tok_s --> (5.6x <!-- from figures/data/headline.json: serving.speedup_inf -->), and its median gap
# between tokens stayed at most 9.1 <!-- from figures/data/headline.json: serving.ours_itl_p50_max_ms --> ms at every rate against
# transformers' 102 <!-- from figures/data/headline.json: serving.tf_itl_p50_min_ms --> ms or more. HTTP costs little here: the median gap
# is the offline engine's decode period, 9.0 <!-- from figures/data/headline.json: serving.offline_period_ms --> ms. The whole run is
# slower than offline, though: 0.68 <!-- from figures/data/headline.json: serving.server_over_offline --> of the offline engine's
# throughput on the same workload (0.80 <!-- from figures/data/headline.json: serving.server_over_offline_again --> when the same server ran
# rate inf a second time). Time to first token is higher than transformers' too from 16 requests per
# second on (350 <!-- from figures/data/headline.json: serving.ours_ttft_p50_16_ms --> ms against 185 <!-- from figures/data/headline.json: serving.tf_ttft_p50_16_ms --> ms at 16/s).
#
# ## 6. Three things a server must do that an offline run need not
#
# Offline, a run meets its step shapes in a repeatable order, and a warm-up pass pays every one-time
# cost before the timing starts. A server meets its shapes when requests happen to arrive, with
# clients waiting. Three costs follow from that, each with its remedy in `serve`.
#
# **Capture CUDA graphs for decode steps only.** A graph is captured the first time its step shape
# comes up: the step runs eagerly, the device drains, the step is recorded and replayed, and every
# request waits meanwhile. A decode step's shape recurs for as long as the batch keeps its size, so
# its graph is replayed many times; a prefill or mixed step's shape (its token and key buckets)
# follows the arrivals, so most are met once or twice. `Serving.stats()` counts the captures
# (`graph_captures`) and the seconds they held the loop (`graph_capture_s`); the server prints both
# as it stops. The figure below compares the two choices on the H200, at the four rates and then,
# after an untimed pass of the whole workload (`bench-serve --warmup`), at rate inf once more:
# %%
GRAPHS_GPU = "../figures/data/runs/gpu_serving_graphs_2026-12-01/"
graph_runs = json.load(open(GRAPHS_GPU + "bench_serve.json"))["runs"]
offline_tok_s = next(float(line.split()[2]) for line in open(GRAPHS_GPU + "offline.log") if line.startswith("async "))
settings = (("async", "every step", "#8172B2"), ("async-decode-graphs", "decode steps only", "#C44E52"))
print(f"{'rate/s':>7} {'graphed':>18} {'TTFT p50':>9} {'ITL p50':>8} {'tok/s':>6}")
for label, name, _ in settings:
    for rate, r in [*graph_runs[label]["rates"].items(), ("inf, warm", graph_runs[label + "-warm"]["rates"]["inf"])]:
        print(f"{rate:>9} {name:>18} {r['ttft_ms']['p50']:7.0f}ms {r['itl_ms']['p50']:6.1f}ms "
              f"{r['output_throughput']:6.0f}")
for n, log in ((1, "every step"), (2, "decode steps only")):
    stop = next(line for line in open(f"{GRAPHS_GPU}console-{n}.log") if line.startswith("minibatch: stopping"))
    print(f"{log}: {stop.split('; ', 1)[1].strip()}")

fig, ax = plt.subplots(figsize=(7, 3.4))
for label, name, colour in settings:
    rates = graph_runs[label]["rates"]
    ax.plot(range(4), [rates[k]["output_throughput"] for k in order], "o-", color=colour, label=name)
    ax.plot([3.25], [graph_runs[label + "-warm"]["rates"]["inf"]["output_throughput"]], "s", color=colour,
            label=f"{name}, warm")
ax.axhline(offline_tok_s, color="#555555", ls="--", lw=1, label="offline engine, same workload")
ax.set(title="our server on an H200: which steps are CUDA graphs", xlabel="arrival rate (requests/s)",
       ylabel="tokens/s", ylim=(0, offline_tok_s * 1.1))
ax.set_xticks(range(4), order)
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_http_graphs_gpu.png", dpi=110)

# %% [markdown]
# Graphing every step, the server captured 100 <!-- from figures/data/headline.json: serving_graphs.every_captures --> graphs over its life, and they held its
# loop 19.7 <!-- from figures/data/headline.json: serving_graphs.every_capture_s --> s; even its warm rate-inf pass was slow (3341 <!-- from figures/data/headline.json: serving_graphs.every_warm_tok_s --> tokens/s), as new
# arrivals kept bringing new shapes. Graphing decode steps only: 44 <!-- from figures/data/headline.json: serving_graphs.decode_captures --> captures, 5.2 <!-- from figures/data/headline.json: serving_graphs.decode_capture_s --> s,
# the same gap between tokens, and more tokens per second from 32 requests per second on
# (3994 <!-- from figures/data/headline.json: serving_graphs.decode_inf_tok_s --> against 3763 <!-- from figures/data/headline.json: serving_graphs.every_inf_tok_s --> at rate inf). So `serve` graphs decode steps only unless told
# otherwise (`--cuda-graphs on`), while offline runs graph every step. The price is the eager
# prefill at a few requests per second: a newcomer's first token comes a little later (the history
# BENCHMARKS.md links has every rate). What remains of the gap to the offline engine, 0.77 <!-- from figures/data/headline.json: serving_graphs.decode_over_offline --> of its throughput,
# sits at the start and the end of a run this short: requests reach the engine one HTTP request at a
# time rather than all in step 0. Over 256 requests the server reaches about nine tenths of the
# offline engine, with as many steps, each as fast.
#
# **Capture before the first request.** Even decode graphs are captured lazily: a new batch size or
# a longer context brings a new shape, and its capture (an eager run, then the recording) holds
# every stream in the batch for about a tenth of a second. Those captures are a fresh server's
# longest steps, and so the tail of its gaps between tokens. `Serving(engine, capture_up_to=N)`
# (`serve --capture-up-to N`, `minibatch/speed/startup_graphs.py`) captures every decode graph of
# requests up to N tokens before the server says it is ready: each is a step whose rows are all
# padding, reading and writing only the cache's scratch cell, launched through the same slots and
# runner a real step takes. On the H200, N = 512 meant 288 <!-- from figures/data/headline.json: serving_startup_graphs.captures --> graphs and 35.3 <!-- from figures/data/headline.json: serving_startup_graphs.capture_s --> s of start-up (ready after
# 63.2 <!-- from figures/data/headline.json: serving_startup_graphs.ready_s --> s instead of 20.2 <!-- from figures/data/headline.json: serving_startup_graphs.lazy_ready_s -->), and the 99th percentile of the gap between tokens fell from
# 104 <!-- from figures/data/headline.json: serving_startup_graphs.lazy_itl_p99_r4 --> to 48 <!-- from figures/data/headline.json: serving_startup_graphs.itl_p99_r4 --> ms at 4 requests per second and from 121 <!-- from figures/data/headline.json: serving_startup_graphs.lazy_itl_p99_r16 --> to 72 <!-- from figures/data/headline.json: serving_startup_graphs.itl_p99_r16 --> ms at 16. What is
# left of the tail is the eager step that admits a prompt:

# %%
LAZY_GPU = "../figures/data/runs/gpu_serving_on_step_delivery_2026-12-04/"
STARTUP_GPU = "../figures/data/runs/gpu_serving_startup_graphs_2026-12-04/"
lazy_rates = json.load(open(LAZY_GPU + "bench_serve.json"))["runs"]["async"]["rates"]
at_start = {}  # rate -> (ITL p50, p99) ms, from the bench lines of that run's log
for line in open(STARTUP_GPU + "serve_bench.log"):
    if line.startswith("rate"):
        rate, rest = line.split(":", 1)
        p50, p99 = rest.split("ITL p50/p99 ")[1].split(" ms")[0].split("/")
        at_start[rate.split()[1]] = (float(p50), float(p99))
shown = ["4", "16", "32"]
print(f"{'rate/s':>7} {'graphs captured':>17} {'ITL p50':>8} {'ITL p99':>8}")
for rate in shown:
    lazy = lazy_rates[rate]["itl_ms"]
    print(f"{rate:>7} {'as shapes come':>17} {lazy['p50']:6.1f}ms {lazy['p99']:6.1f}ms")
    print(f"{rate:>7} {'at start-up':>17} {at_start[rate][0]:6.1f}ms {at_start[rate][1]:6.1f}ms")

fig, ax = plt.subplots(figsize=(7, 3.2))
x = range(len(shown))
for i, (name, p99s, colour) in enumerate((
        ("captured as shapes come", [lazy_rates[r]["itl_ms"]["p99"] for r in shown], "#C44E52"),
        ("captured at start-up (--capture-up-to 512)", [at_start[r][1] for r in shown], "#4C72B0"))):
    ax.bar([k + (i - 0.5) * 0.38 for k in x], p99s, 0.38, color=colour, label=f"p99, {name}")
ax.plot(x, [at_start[r][0] for r in shown], "k_", ms=30, mew=2, label="p50 (8-9 ms either way)")
ax.set(title="gap between a stream's tokens, async server, 8B shape on an H200", xlabel="arrival rate (requests/s)",
       ylabel="ms", ylim=(0, 1.5 * max(r["itl_ms"]["p99"] for r in lazy_rates.values())))  # (room for the legend)
ax.set_xticks(x, shown)
ax.legend(fontsize=8, loc="upper right")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_itl_tail_startup_graphs_gpu.png", dpi=110)

# %% [markdown]
# **Every step a graph, captured before the first request.** That admitting step is a prefill chunk
# beside the decode rows, launched kernel by kernel: for the 8B shape the host needs about 40 ms to
# launch it, whatever its token count, while the GPU would run it in 10-25. Worse, every request
# waits for it: a newcomer's first token comes after it, and so does every running stream's next
# token. Graphing it lazily did not pay (above: its shapes follow the arrivals, so each new one was a
# capture on a request's path). Captured at start-up it does: with `--cuda-graphs on`, `capture_up_to`
# also captures a graph for every padded flat step a request within N tokens can make. To keep that
# to a few hundred graphs, flat steps are then padded to coarse sizes, tokens in half octaves from 128
# (a step of a few hundred tokens is bound by reading the weights, so padding it is nearly free) and
# keys in octaves from 1024 (the extra keys are gathered, never attended to). Each capture is a batch
# of padding tokens in empty chunks, touching only the scratch cell, as for the decode graphs. On the
# H200 the async server then made 720 <!-- from figures/data/headline.json: serving_all_graphs.captures --> captures in 69.0 <!-- from figures/data/headline.json: serving_all_graphs.capture_s --> s before it was ready
# (103.6 <!-- from figures/data/headline.json: serving_all_graphs.ready_s --> s against 22.5 <!-- from figures/data/headline.json: serving_all_graphs.lazy_ready_s -->). Below, from the two async servers' timelines on one machine, the request
# with the median time to first token at 16 requests per second in each, on the same time scale:

# %%
ALL_GPU = "../figures/data/runs/gpu_serving_all_graphs_startup_2026-12-04/"
fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), sharex=True)
for ax, (name, title) in zip(axes, (("async", "async, decode steps graphed (the default)"),
                                    ("async-allgraphs-capture512", "async, every step a graph captured at start-up"))):
    tl = Timeline.load(f"{ALL_GPU}timeline-{name}.json.gz")
    arrived = sorted((m["request"], m) for m in tl.request_marks().values() if "first" in m)
    burst = [m for _, m in arrived[1 + 4 + 64:1 + 4 + 64 + 64]]  # (1 and 4 warm-up requests, then rate 4, then 16)
    m = sorted(burst, key=lambda m: m["first"] - m["request"])[len(burst) // 2]
    start = m["request"] - 0.01
    tl.plot(ax, start=start, end=start + 0.1, step_labels=True)
    for kind, colour, label in (("request", "#555555", "arrived"), ("scheduled", "#4C72B0", "admitted"),
                                ("first", "#C44E52", "first token")):
        ax.axvline(m[kind] - start, color=colour, linestyle="--", linewidth=1, label=label)
    ax.set_title(f"{title}: first token {1e3 * (m['first'] - m['request']):.0f} ms after it arrived", fontsize=9)
    ax.legend(loc="lower right", fontsize=7, ncol=3)
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_admitting_step_graphed_gpu.png", dpi=110)

# %% [markdown]
# Above, the request arrives while an eager step (another newcomer's) runs, waits for it to end, and
# then for its own eager step, each some 30-45 ms of kernels launched one by one. Below, it is admitted
# into the next step planned, a graph of the padded flat shape, about as long as two decode steps, and
# the steps around it are short: the one step more that the async loop keeps in flight costs a
# newcomer a decode step now, not an eager step. Over the whole run, side by side with the default
# servers:

# %%
runs = json.load(open(ALL_GPU + "bench_serve.json"))["runs"]
servers = {"sync": "sync", "async": "async", "sync-allgraphs-capture512": "sync, every step at start-up",
           "async-allgraphs-capture512": "async, every step at start-up"}
rates_all = ["4", "16", "32", "inf"]
print(f"{'server':>31} {'rate/s':>6} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'p99/p50':>7} {'tok/s':>6}")
for label, name in servers.items():
    for rate in rates_all:
        r = runs[label]["rates"][rate]
        print(f"{name:>31} {rate:>6} {r['ttft_ms']['p50']:7.1f}ms {r['itl_ms']['p50']:6.2f}ms {r['itl_ms']['p99']:6.1f}ms "
              f"{r['itl_ms']['p99'] / r['itl_ms']['p50']:6.1f}x {r['output_throughput']:6.0f}")

budgets = {512: "async-allgraphs-capture512-mbt512", 1024: "async-allgraphs-capture512-mbt1024",
           2048: "async-allgraphs-capture512"}
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
x = range(len(rates_all))
colours = {"sync": "#DD8452", "async": "#C44E52", "sync-allgraphs-capture512": "#55A868",
           "async-allgraphs-capture512": "#4C72B0"}
for label, name in servers.items():
    left.plot(x, [runs[label]["rates"][r]["ttft_ms"]["p50"] for r in rates_all], "o-", color=colours[label], label=name)
left.set(title="time to first token (median)", xlabel="arrival rate (requests/s)", ylabel="ms", ylim=(0, None))
left.set_xticks(x, rates_all)
left.legend(fontsize=8)
at = range(len(budgets))  # (evenly spaced: the budgets double)
tput = right.twinx()
tput.bar(at, [runs[b]["rates"]["inf"]["output_throughput"] for b in budgets.values()], 0.4, color="#BBBBBB")
tput.set(ylabel="tokens/s at rate inf (grey bars)", ylim=(0, 6000))
right.set_zorder(tput.get_zorder() + 1)  # the lines over the bars
right.patch.set_visible(False)
for rate, marker in zip(rates_all, "os^D"):
    right.plot(at, [runs[b]["rates"][rate]["itl_ms"]["p99"] / runs[b]["rates"][rate]["itl_ms"]["p50"]
                    for b in budgets.values()], marker + "-", label=f"ITL p99/p50, rate {rate}")
right.axhline(4, color="#555555", ls="--", lw=1, label="4x")
right.set(title="async, every step a graph: the token budget", xlabel="tokens per step (--max-batch-tokens)",
          ylabel="ITL p99 / p50", ylim=(0, 8))
right.set_xticks(at, [str(b) for b in budgets])
right.legend(fontsize=7, loc="upper left")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_every_step_graphed_gpu.png", dpi=110)

# %% [markdown]
# The admitting step fell from 39-53 ms to 16-25 (median, rates 4-32, `scripts/ttft_breakdown.py`),
# and with it both kinds of latency. The median time to first token of the async server went from
# 62.4 <!-- from figures/data/headline.json: serving_all_graphs.async_ttft_p50_r4 -->, 102.0 <!-- from figures/data/headline.json: serving_all_graphs.async_ttft_p50_r16 --> and 167.3 <!-- from figures/data/headline.json: serving_all_graphs.async_ttft_p50_r32 --> ms to 34.8 <!-- from figures/data/headline.json: serving_all_graphs.async_all_ttft_p50_r4 -->, 46.1 <!-- from figures/data/headline.json: serving_all_graphs.async_all_ttft_p50_r16 --> and 63.6 <!-- from figures/data/headline.json: serving_all_graphs.async_all_ttft_p50_r32 --> ms at 4, 16 and 32 requests per second,
# now within one decode step of the sync server built the same way (32.0 <!-- from figures/data/headline.json: serving_all_graphs.sync_all_ttft_p50_r4 -->, 52.1 <!-- from figures/data/headline.json: serving_all_graphs.sync_all_ttft_p50_r16 -->,
# 67.3 <!-- from figures/data/headline.json: serving_all_graphs.sync_all_ttft_p50_r32 --> ms): one batch in flight costs a newcomer at most one short step. The 99th
# percentile of the gap between tokens is 2.1 <!-- from figures/data/headline.json: serving_all_graphs.async_all_itl_ratio_r4 -->x, 2.6 <!-- from figures/data/headline.json: serving_all_graphs.async_all_itl_ratio_r16 -->x and 3.5 <!-- from figures/data/headline.json: serving_all_graphs.async_all_itl_ratio_r32 -->x its median there (it was
# 12.2 <!-- from figures/data/headline.json: serving_all_graphs.async_itl_ratio_r4 -->x, 12.3 <!-- from figures/data/headline.json: serving_all_graphs.async_itl_ratio_r16 -->x and 11.3 <!-- from figures/data/headline.json: serving_all_graphs.async_itl_ratio_r32 -->x), and the throughput at rate inf did not suffer (4667 <!-- from figures/data/headline.json: serving_all_graphs.async_all_tok_s_rinf -->
# against 4511 <!-- from figures/data/headline.json: serving_all_graphs.async_tok_s_rinf --> tokens/s). At rate inf the tail is the prompts' own steps, 2048 tokens each;
# the right panel is that trade-off: a budget of 512 tokens per step keeps the tail within
# 2.7 <!-- from figures/data/headline.json: serving_all_graphs.async_all_b512_itl_ratio_rinf -->x even there, for 4321 <!-- from figures/data/headline.json: serving_all_graphs.async_all_b512_tok_s_rinf --> tokens/s. The price of all this is start-up time, which is
# why it is a flag (`serve --cuda-graphs on --capture-up-to N`) and not the default.

# %% [markdown]
# **Compile once for every batch size.** Offline, `compile=True` compiles a decode step once per
# batch size, the first time that size comes up, and a warm-up pass does that before timing. A server
# compiled that way compiles mid-run, with every request waiting: its first rate-inf run streamed
# 87 <!-- from figures/data/headline.json: serving_graphs.compile_inf_tok_s --> tokens per second. So a server compiles with `compile="dynamic"`: the batch
# size stays a symbol in the compiled code (it reaches the model as a tensor's length,
# `Batch.rows()`, not as a Python number that torch.compile would bake in), one compile serves every
# size, and the server does it before it says it is ready. That general code runs the offline 8B
# workload as fast as code compiled for each size (BENCHMARKS.md). Only the forward is compiled that
# way: with the batch size a symbol, torch's compiler cannot generate the top-k/top-p sampler for
# Llama 3's vocabulary of 128256 tokens, so the sampler is a small graph of its own for each sampling
# variant, or runs eagerly when a request asks for top-k or top-p. Test each compiled path you will
# use, at the sizes you will use. Compiled, the server's tokens come 6.0 <!-- from figures/data/headline.json: serving_compile.itl_p50_ms --> ms apart at the
# median, against 9.1 <!-- from figures/data/headline.json: serving.ours_itl_p50_max_ms --> ms uncompiled. Its first burst still meets new batch sizes and key
# lengths, each a CUDA graph to capture: 3339 <!-- from figures/data/headline.json: serving_compile.inf_tok_s --> tokens per second, and
# 5504 <!-- from figures/data/headline.json: serving_compile.warm_inf_tok_s --> for the same workload again (the offline engine: 6975 <!-- from figures/data/headline.json: serving_compile.offline_dynamic_tok_s -->). A server's first
# minutes are not its steady state.
#
# **Keep the heap out of the garbage collector's reach.** Now and then Python's collector makes a
# full pass: it walks every object it tracks, looking for cycles, and whichever thread runs it holds
# the interpreter lock all the while. A process that has imported torch and transformers and loaded
# a model tracks hundreds of thousands of objects, so every stream stops at once: for
# 305 <!-- from figures/data/headline.json: serving_gc.gpu_pause_min_ms -->-314 <!-- from figures/data/headline.json: serving_gc.gpu_pause_max_ms --> ms per pass in an 8B server on the H200, a `gc` span in its timeline
# (`diagnostics.gc_pauses`) with the device idle beside it. Those objects live as long as the server,
# so once it is warm `serve` moves them out of the collector's reach with `gc.freeze()`; on a 2-core
# CPU one full pass then takes 29.8 <!-- from figures/data/headline.json: serving_gc.cpu_frozen_collect_ms --> ms instead of 365 <!-- from figures/data/headline.json: serving_gc.cpu_full_collect_ms --> ms. Latency has sources below
# your own code: measure them too.
#
# ## 7. Prompts that start alike: prefix caching
#
# Real traffic repeats itself at the start: every request of a chat application begins with the same
# system prompt, an evaluation asks one question with each of its answers. A token's keys and values
# depend only on the tokens up to it, so those starts have the same KV in every request. The engine
# keeps every full KV block of a prompt under a key made of its tokens and of the blocks before it;
# a later request whose prompt starts with the same blocks takes them instead of computing them
# (`minibatch/core/prefix_cache.py`, on by default). Blocks are counted: one that a running request
# holds is never handed to another, and one nobody holds stays cached until the free list runs dry.
# Three questions behind one system prompt, arriving a few steps apart:

# %%
system = tok.encode("You are a helpful assistant who answers questions about the Python language. ")
questions = ["The for statement", "A class definition", "Exceptions are raised"]


def ask(prefix_caching: bool):
    requests = [Request(i, system + tok.encode(q, add_bos=False), SamplingParams(max_new_tokens=8),
                        arrival_step=3 * i) for i, q in enumerate(questions)]
    tables, computed = {}, 0
    with minibatch.Engine(model) as engine:
        run = engine.start(requests, "async", block_size=16, prefix_caching=prefix_caching)
        while engine.has_work():
            engine.step()
            computed += sum(c.num_tokens for c in run.applied.chunks) if run.applied is not None else 0
            for r in requests:
                if r.blocks and r.rid not in tables:
                    tables[r.rid] = list(r.blocks)
        engine.finish()
    return requests, tables, computed


shared_run, tables, computed = ask(True)
plain_run, _, computed_plain = ask(False)
print("same tokens as without the cache:", [r.output for r in shared_run] == [r.output for r in plain_run])
print(f"tokens computed: {computed} with the cache, {computed_plain} without; system prompt: {len(system)} tokens")

fig, ax = plt.subplots(figsize=(8, 1.9))
counts = {}
for blocks in tables.values():
    for b in blocks:
        counts[b] = counts.get(b, 0) + 1
for row, (rid, blocks) in enumerate(sorted(tables.items())):
    for i, b in enumerate(blocks):
        ax.add_patch(plt.Rectangle((i, -row - 0.4), 0.9, 0.8, color="#55A868" if counts[b] > 1 else "#BBBBBB"))
        ax.text(i + 0.45, -row, f"b{b}", ha="center", va="center", fontsize=8)
ax.set(xlim=(-0.1, max(map(len, tables.values()))), ylim=(-len(tables) + 0.4, 0.6), xlabel="block of the request")
ax.set_yticks([-r for r in range(len(tables))], [f"request {rid}" for rid in sorted(tables)])
ax.set_title("KV blocks of each request: green ones are shared (the system prompt's full blocks)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/08_prefix_blocks.png", dpi=110)

# %% [markdown]
# Requests 1 and 2 start their prefill after the system prompt's full blocks, so they compute a few
# dozen tokens instead of a hundred, and their first token comes sooner; the tokens are the same.
# Only full blocks of the prompt are shared, and a request always computes at least its prompt's
# last token, whose logits give its first new token. A server shows the cache's effect in `/metrics`
# (`minibatch_prefix_cache_hit_tokens`); `python -m minibatch serve --prefix-caching off` turns it off,
# and `bench-serve --shared-prefix-len N` sends prompts that share N tokens, to measure it.
#
# ## Summary
#
# * An online engine is the same loop in a thread of its own: requests join at step boundaries,
#   tokens leave through one stream per request, an idle loop sleeps.
# * Online = offline: a request gives the tokens it gives alone with the same seed, whatever else
#   arrives or leaves; nothing after EOS, a stop string, the length limit or a cancel reaches a stream.
# * Overlap shortens every gap between tokens by the host's share of a step; a newly arrived request
#   may wait for the step in flight.
# * Over HTTP the engine is an OpenAI-compatible server; `bench-serve` measures any such server
#   through the client its users have, and TTFT, ITL and goodput are what it reports.
# * Logprobs are computed on the device in the sampling step and travel back with the tokens; a
#   prompt's come from its prefill, which is how evaluation harnesses score answers. Penalties
#   carry each request's earlier tokens in the batch; the device adds the newest itself.
# * Prompts that start alike share their full KV blocks (prefix caching): fewer tokens to compute
#   before the first one, the same tokens out.
# * A server meets its step shapes as requests arrive: by default it graphs decode steps only,
#   compiles once for every batch size, and freezes its heap once warm. Captured before the first
#   request, every step can be a graph, prefills included: then a newcomer waits for short steps only,
#   async's time to first token is sync's, and the gaps between tokens stay within a few times their
#   median, for a longer start-up.
#
# ## Exercise
#
# Write `latencies(arrival, token_times)` that returns `(ttft, itl)` for one request: `ttft` is the
# seconds from `arrival` to the first token, `itl` the list of gaps between consecutive tokens (one
# fewer than there are tokens). Then try it on `streams[0].arrival, streams[0].token_times`.

# %%
latencies = None  # replace with your function

# %%
import exercises

exercises.check_08(globals().get("latencies"))
