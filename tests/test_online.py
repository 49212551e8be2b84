"""Serving: requests submitted while the loop runs give the tokens they give alone, and nothing past
their end ever reaches a stream (notebook 08; minibatch/serving/service.py, loop.py, stream.py)."""

import asyncio
import os
import random
import threading
import time

import pytest

import minibatch
from minibatch.serving.loop import QueueFull
from minibatch.serving.service import Serving

PROMPTS = ["The for statement", "A class definition", "Exceptions are raised", "The import system",
           "Assignment statements", "A string literal", "def f(x):", "Lists are"]


@pytest.fixture(scope="module")
def tiny():
    return minibatch.load_model("tiny")


@pytest.fixture(scope="module")
def engine(tiny):
    with minibatch.Engine(tiny) as e:
        yield e


def alone(model, prompt, **kw):
    return minibatch.generate(model, [prompt], **kw)[0]


def stop_reference(tok, tokens, stop):
    """The tokens up to the one whose text first holds a stop string, and the text before it."""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return tokens[:k], text[:min(hits)], "stop"
    return tokens, tok.decode(tokens), None


def random_workload(rng, tok):
    n = rng.randint(1, 6)
    work = []
    for i in range(n):
        sampled = rng.random() < 0.5
        kw = dict(max_new_tokens=rng.randint(1, 24), temperature=0.8 if sampled else 0.0,
                  top_k=rng.choice([0, 20]), seed=rng.randint(0, 2**40),
                  eos_token_id=rng.choice([None, tok.eos_token_id, 32, 101]))
        stop = rng.choice([None, None, [" "], ["e"], ["(", "th"]])
        work.append((rng.choice(PROMPTS), kw, stop, rng.random() * 0.02))
    limits = rng.choice([dict(max_batch_size=2, max_batch_tokens=8), dict(max_batch_size=4, max_batch_tokens=16),
                         dict(max_batch_size=8, max_batch_tokens=64)])
    return work, limits


def check_workload(model, work, limits, mode, seed):
    """Submit `work` at its arrival times from a thread; compare each stream with the request alone."""
    tok = model.tokenizer
    streams = []
    with minibatch.Engine(model) as engine, Serving(engine, mode, **limits) as server:
        start = time.perf_counter()
        for prompt, kw, stop, at in sorted(work, key=lambda w: w[3]):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            streams.append((server.submit(prompt, stop=stop, **kw), prompt, kw, stop))
        for s, *_ in streams:
            s.wait(timeout=60)
        assert server.stats()["kv_blocks_free"] == server.stats()["kv_blocks"]
    for s, prompt, kw, stop in streams:
        ref = alone(model, prompt, **kw)
        reason = None
        if stop:
            ref, text, reason = stop_reference(tok, ref, stop)
            assert s.text == text, (seed, mode, prompt, kw, stop)
        assert s.token_ids == ref, (seed, mode, prompt, kw, stop)
        if reason is None:
            eos = kw["eos_token_id"]
            reason = "eos" if eos is not None and ref and ref[-1] == eos else "length"
        assert s.finish_reason == reason, (seed, mode, prompt, kw, stop)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_online_equals_offline(tiny, mode, seed):
    rng = random.Random(seed)
    work, limits = random_workload(rng, tiny.tokenizer)
    check_workload(tiny, work, limits, mode, seed)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_online_equals_offline_many(tiny, mode):
    """40 random workloads per mode by default (about 35 s each on 2 cores); MINIBATCH_ONLINE_WORKLOADS=250
    for the long run."""
    for seed in range(100, 100 + int(os.environ.get("MINIBATCH_ONLINE_WORKLOADS", "40"))):
        rng = random.Random(seed)
        work, limits = random_workload(rng, tiny.tokenizer)
        check_workload(tiny, work, limits, mode, seed)


def test_submit_matches_generate_with_the_same_seed(tiny, engine):
    ref = alone(tiny, "The for statement", max_new_tokens=32, temperature=0.7, seed=1)
    with Serving(engine, "async", max_batch_size=8) as server:
        s = server.submit("The for statement", max_new_tokens=32, temperature=0.7, seed=1)
        chunks = list(s)
    assert s.token_ids == ref and [t for c in chunks for t in c.token_ids] == ref
    assert "".join(c.text for c in chunks) == s.text == tiny.tokenizer.decode(ref)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(s.token_times) == len(ref) and s.first_scheduled is not None and s.ttft > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_no_token_after_the_end_reaches_a_stream(tiny, mode):
    """EOS, a stop string and the length limit: a stream's tokens stop exactly where the request ends,
    also in the async loop, whose next step is already in flight when it learns of the end."""
    ref = alone(tiny, "The import system", max_new_tokens=40)
    eos = ref[5]  # a token that surely comes up: EOS there
    stop_at = tiny.tokenizer.decode(ref[10:12])
    with minibatch.Engine(tiny) as engine, Serving(engine, mode, max_batch_size=4) as server:
        by_eos = server.submit("The import system", max_new_tokens=40, eos_token_id=eos)
        by_stop = server.submit("The import system", max_new_tokens=40, stop=[stop_at])
        by_length = server.submit("The import system", max_new_tokens=7)
        for s in (by_eos, by_stop, by_length):
            s.wait(30)
    assert by_eos.token_ids == ref[:ref.index(eos) + 1] and by_eos.finish_reason == "eos"
    toks, text, _ = stop_reference(tiny.tokenizer, ref, [stop_at])
    assert by_stop.token_ids == toks and by_stop.text == text and by_stop.finish_reason == "stop"
    assert by_length.token_ids == ref[:7] and by_length.finish_reason == "length"


def test_tokens_reach_their_streams_before_a_launch_bound_step_launches(tiny, monkeypatch, loop_order):
    """A serving async loop delivers batch N's tokens the moment it applies them: before a launch-bound
    step (an eager step on a GPU) launches, each stream already holds them, first tokens included.
    Made to happen on the CPU by calling every step with prompt tokens launch-bound; the tokens are
    those of each request alone, and every other step still launches before it delivers."""
    from minibatch.serving.loop import ServingLoop

    events = loop_order(launch_bound=lambda batch: batch.num_tokens > batch.num_sampled, update=False)
    deliver = ServingLoop.deliver
    monkeypatch.setattr(ServingLoop, "deliver",
                        lambda self, plan: (events.append(("deliver", plan.step)), deliver(self, plan))[1])
    with minibatch.Engine(tiny) as engine, Serving(engine, "async", max_batch_size=4, max_batch_tokens=8) as server:
        # prompts of ~20 tokens against an 8-token budget: prompt chunks are planned with a batch in flight
        streams = [server.submit(p, max_new_tokens=12) for p in PROMPTS[:4]]
        for s in streams:
            s.wait(30)
    for p, s in zip(PROMPTS[:4], streams):
        assert s.token_ids == alone(tiny, p, max_new_tokens=12)
    asked = [i for i, e in enumerate(events) if e[0] == "asked"]
    assert {events[i][1] for i in asked} == {True, False}  # both kinds of step came with a batch in flight
    for i in asked:
        launched = next(e[1] for e in events[i:] if e[0] == "launch")  # step N+1
        before = events[i + 1:events.index(("launch", launched), i)]
        # launch-bound: batch N's tokens are in their streams before N+1 launches; else they follow it
        assert (("deliver", launched - 1) in before) == events[i][1], (events[i], before)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cancel_lets_at_most_the_step_in_progress_through(tiny, mode):
    """Slow steps (an injected delay), so that the cancel lands while a step runs: after cancel()
    returns, at most two chunks arrive (that step's token, then the end), and the blocks come back."""
    with minibatch.Engine(tiny) as engine, Serving(engine, mode, max_batch_size=2, inject_delays={"compute": 0.03}) as server:
        s = server.submit("The for statement", max_new_tokens=200)
        it = iter(s)
        for _ in range(3):
            next(it)
        s.cancel()
        after = list(it)
        assert len(after) <= 2 and after[-1].finish_reason == "cancelled"
        assert sum(len(c.token_ids) for c in after) <= 1
        assert len(s.token_ids) <= 4
        time.sleep(0.1)
        assert server.stats()["kv_blocks_free"] == server.stats()["kv_blocks"]
    assert s.finish_reason == "cancelled"


def test_a_stream_keeps_its_tokens_for_a_late_reader(engine):
    with Serving(engine, "sync", max_batch_size=2) as server:
        s = server.submit("A class definition", max_new_tokens=10)
        s.wait(30)
        first, second = list(s), list(s)
    assert first == second and sum(len(c.token_ids) for c in first) == 10


def test_leaving_serving_cancels_open_streams(tiny):
    with minibatch.Engine(tiny) as engine:
        with Serving(engine, "async", max_batch_size=2, inject_delays={"compute": 0.02}) as server:
            streams = [server.submit(p, max_new_tokens=300) for p in PROMPTS[:4]]
            time.sleep(0.1)
        assert all(s.finish_reason == "cancelled" for s in streams)
        assert server.loop is None and not [t for t in threading.enumerate() if t.name == "minibatch-engine-loop"]
        assert minibatch.generate(engine, ["The for statement"], max_new_tokens=5)[0] == \
            alone(tiny, "The for statement", max_new_tokens=5)  # usable again


def test_asyncio_readers_never_block_the_event_loop(tiny):
    """A heartbeat task beside 8 streaming tasks: its gaps stay far below a blocking read's."""
    async def main(server):
        gaps, stop = [], asyncio.Event()

        async def heartbeat():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async def read(p):
            s = server.submit(p, max_new_tokens=24)
            return [c async for c in s], s

        hb = asyncio.create_task(heartbeat())
        results = await asyncio.gather(*(read(p) for p in PROMPTS))
        stop.set()
        await hb
        return gaps, results

    with minibatch.Engine(tiny) as engine, Serving(engine, "async", max_batch_size=8,
                                                   inject_delays={"compute": 0.01}) as server:
        gaps, results = asyncio.run(main(server))
    assert max(gaps) < 0.25, max(gaps)
    for (chunks, s), p in zip(results, PROMPTS):
        assert s.token_ids == alone(tiny, p, max_new_tokens=24)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_threads_and_tasks_submit_at_once(tiny):
    refs = {p: alone(tiny, p, max_new_tokens=12, temperature=0.9, seed=7) for p in PROMPTS}
    threads_before = threading.active_count()
    results, errors = [], []
    with minibatch.Engine(tiny) as engine, Serving(engine, "async", max_batch_size=8) as server:
        def worker(k):
            try:
                for j in range(12):
                    p = PROMPTS[(k + j) % len(PROMPTS)]
                    results.append((p, server.submit(p, max_new_tokens=12, temperature=0.9, seed=7).wait(60)))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        async def tasks():
            async def one(k):
                p = PROMPTS[k % len(PROMPTS)]
                s = server.submit(p, max_new_tokens=12, temperature=0.9, seed=7)
                async for _ in s:
                    pass
                results.append((p, s))
            await asyncio.gather(*(one(k) for k in range(104)))

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in pool:
            t.start()
        asyncio.run(tasks())
        for t in pool:
            t.join()
        stats = server.stats()
    assert not errors and len(results) == 200
    assert all(s.token_ids == refs[p] for p, s in results)
    assert stats["kv_blocks_free"] == stats["kv_blocks"]
    assert stats["steps"] > 0  # steps were counted; on the CPU, no graphs
    assert tiny.device.type == "cuda" or stats["graph_captures"] == 0 == stats["graph_capture_s"]
    assert stats["loop_cpu_s"] > 0  # the loop's thread ran those steps
    time.sleep(0.2)
    assert threading.active_count() == threads_before


def test_many_submissions_leave_no_descriptor_open(tiny):
    fds_before = _fds()
    with minibatch.Engine(tiny) as engine, Serving(engine, "async", max_batch_size=8) as server:
        def worker():
            for j in range(12):
                server.submit(PROMPTS[j % len(PROMPTS)], max_new_tokens=12, temperature=0.9, seed=7).wait(60)

        pool = [threading.Thread(target=worker) for _ in range(8)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    time.sleep(0.2)
    assert _fds() <= fds_before


def test_an_idle_serving_engine_sleeps(engine):
    """No spinning: one idle second costs this process (every thread of it) well under 5% of a core."""
    with Serving(engine, "async", max_batch_size=2) as server:
        server.submit("x", max_new_tokens=2).wait(30)
        before = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - before
    assert used < 0.05, used


def test_bad_submissions_name_the_problem(tiny, engine):
    with pytest.raises(RuntimeError, match="serving"):
        Serving(engine, "sync", max_batch_size=2).submit("x")  # made, but its block not entered
    with Serving(engine, "sync", max_batch_size=2, num_blocks=4, block_size=4, max_queue=2,
                 inject_delays={"compute": 0.05}) as server:
        with pytest.raises(ValueError, match="max_new_tokens"):
            server.submit("x", max_new_tokens=0)
        with pytest.raises(ValueError, match="could never run"):
            server.submit("x", max_new_tokens=40)
        with pytest.raises(TypeError, match="stop"):
            server.submit("x", stop=[3])
        with pytest.raises(ValueError, match="context"):
            server.submit("x", max_new_tokens=tiny.max_positions)
        with pytest.raises(ValueError, match="serving in 'sync'"):
            server.generate(["x"], mode="async")
        streams = [server.submit("x", max_new_tokens=3) for _ in range(2)]
        with pytest.raises(QueueFull):
            for _ in range(4):
                streams.append(server.submit("x", max_new_tokens=3))
        for s in streams:
            s.wait(30)


def test_one_engine_many_callers_without_serving(tiny):
    """Without serving, a second generate at the same time is refused with a clear error, and a
    generate from inside on_step too; the engine works afterwards."""
    with minibatch.Engine(tiny) as engine:
        def reenter(plan, done):
            engine.generate(["x"], max_new_tokens=2)

        with pytest.raises(RuntimeError, match="busy"):
            engine.generate(["The for statement"], max_new_tokens=4, on_step=reenter)
        started, errors = threading.Event(), []

        def slow(plan, done):
            started.set()
            time.sleep(0.05)

        t = threading.Thread(target=lambda: engine.generate(["A class"], max_new_tokens=6, on_step=slow))
        t.start()
        started.wait(30)
        try:
            engine.generate(["x"], max_new_tokens=2)
        except RuntimeError as e:
            errors.append(e)
        t.join()
        assert errors and "busy" in str(errors[0])
        assert engine.generate(["The for statement"], max_new_tokens=5)[0] == alone(tiny, "The for statement",
                                                                                   max_new_tokens=5)


def test_generate_while_serving_goes_through_submit(tiny, engine):
    refs = minibatch.generate(tiny, PROMPTS[:3], max_new_tokens=8, temperature=0.8, seed=3)
    with Serving(engine, "async", max_batch_size=4) as server:
        outs = [None, None]

        def call(i):
            outs[i] = server.generate(PROMPTS[:3], max_new_tokens=8, temperature=0.8, seed=3, mode="async")

        ts = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert outs == [refs, refs]


def test_arrivals_are_marked_on_the_timeline(tiny):
    tl = minibatch.Timeline()
    with minibatch.Engine(tiny) as engine, Serving(engine, "async", max_batch_size=2, timeline=tl) as server:
        server.submit("x", max_new_tokens=3).wait(30)
        time.sleep(0.02)
        server.submit("y", max_new_tokens=3).wait(30)
    marks = dict((label, t) for t, label in tl.marks)
    assert sorted(marks) == ["first 0", "first 1", "request 0", "request 1", "scheduled 0", "scheduled 1"]
    for rid in (0, 1):  # arrival, then scheduled, then the first token delivered
        assert marks[f"request {rid}"] <= marks[f"scheduled {rid}"] <= marks[f"first {rid}"]
    assert marks["first 0"] < marks["request 1"] and tl.arrivals() == [marks["request 0"], marks["request 1"]]
    assert minibatch.Timeline.from_dict(tl.to_dict()).marks == tl.marks
    assert tl.request_marks()["1"] == {k: marks[f"{k} 1"] for k in ("request", "scheduled", "first")}


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_online_equals_offline_on_the_gpu(mode):
    """The same random workloads on a GPU, in float32 (in bf16 a matrix product's rounding can depend
    on the batch's shape, so near-tied logits may flip): the serving default (decode steps graphed)
    and every step graphed."""
    import torch

    model = minibatch.load_model("tiny", device="cuda", dtype=torch.float32)
    for seed in range(3):
        work, limits = random_workload(random.Random(seed), model.tokenizer)
        check_workload(model, work, limits, mode, seed)
        check_workload(model, work, {**limits, "cuda_graphs": True}, mode, seed)
    # a serving run graphs decode steps only (by default), captures them lazily and says how long
    # the captures held its loop
    with minibatch.Engine(model) as engine, Serving(engine, mode=mode) as server:
        server.submit(list(range(1, 40)), max_new_tokens=6, temperature=0.0).wait(120)
        stats = server.stats()
        assert server.loop.run.runner.capacity is None  # prefill and mixed steps unpadded: never graphed
    assert stats["graph_captures"] > 0 and stats["graph_capture_s"] > 0, stats


def test_an_update_wakes_each_event_loop_once():
    """ServingLoop.deliver gathers the wake-ups of every stream a step fed (stream.Wakeups): an asyncio reader
    costs the engine's thread one call_soon_threadsafe per event loop and update, not one per stream."""
    from minibatch.serving.stream import Chunk, TokenStream, Wakeups

    loop = asyncio.new_event_loop()
    calls = []
    threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (calls.append(a[0]), threadsafe(*a))[1]
    streams = [TokenStream(i, 1) for i in range(5)]
    got = {s.rid: [] for s in streams}

    async def read(s):
        async for c in s:
            got[s.rid] += c.token_ids

    async def read_all():
        await asyncio.gather(*(read(s) for s in streams))

    reader = threading.Thread(target=loop.run_until_complete, args=(read_all(),))
    reader.start()
    deadline = time.monotonic() + 10
    while sum(len(s._async_waiters) for s in streams) < 5:  # every reader waiting
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wakeups = Wakeups()
    for s in streams:
        s.put(Chunk([7]), time.perf_counter(), wakeups)
    assert calls == []  # nothing woken before send
    wakeups.send()
    while sum(len(s._async_waiters) for s in streams) < 5:  # every reader back, waiting for more
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(calls) == 1 and all(t == [7] for t in got.values())
    for s in streams:  # without a Wakeups: each put wakes its reader at once
        s.put(Chunk([8], "", "length"), time.perf_counter())
    reader.join(10)
    assert not reader.is_alive() and len(calls) == 6 and all(t == [7, 8] for t in got.values())
    loop.close()


def test_the_loop_cpu_seconds_count_a_turn_in_progress_and_never_go_back(tiny):
    """stats()["loop_cpu_s"] (ServingLoop.cpu_s) reads the loop thread's own CPU clock: while a turn
    runs it counts that turn, and after the thread has ended it keeps the whole, never a smaller value."""
    engine = minibatch.Engine(tiny)
    with Serving(engine, mode="async") as server:
        loop = server.loop
        server.submit([1, 2, 3], max_new_tokens=8).wait()
        seen = [loop.cpu_s]
        stream = server.submit([4, 5, 6], max_new_tokens=400)
        while not stream.done:
            seen.append(loop.cpu_s)
            time.sleep(0.01)
        seen.append(loop.cpu_s)
    assert not loop.thread.is_alive()
    seen.append(loop.cpu_s)
    assert seen == sorted(seen) and seen[-1] > seen[0] > 0
    if hasattr(time, "pthread_getcpuclockid"):
        assert loop._clock is not None
    engine.close()
