"""CUDA graphs captured before a server's first request (minibatch/speed/startup_graphs.py): the
padding batches it captures have the shapes and layout of a real decode step and of a real padded
flat (mixed) step, so a real step replays their graphs; they touch only the scratch cell; and the
captures are refused clearly where there are no CUDA graphs. The captures themselves run on the GPU
(tests/test_gpu.py)."""

import pytest
import torch

import minibatch
from minibatch.core.batch import TENSOR_FIELDS, build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.graphs import pad_flat
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.serving.service import Serving
from minibatch.speed.startup_graphs import flat_buckets, padding_decode_batch, padding_flat_batch


def real_decode_batch(model, rows: int, prompt_len: int, temperature: float, bucket: int):
    cache = model.make_cache(64, 4)
    sched = Scheduler(cache.allocator, 256, 8)
    for i in range(rows):
        sched.add(Request(i, [3 + i] * prompt_len, SamplingParams(max_new_tokens=4, temperature=temperature)))
    prefill = sched.schedule()
    sched.update(prefill, [5] * rows)
    return build_batch(sched.schedule(), cache, 8, True, ROW_BUCKETS, bucket), cache


@pytest.mark.parametrize("greedy", [True, False])
def test_the_padding_batch_has_a_real_decode_steps_shapes_and_layout(random_llama, greedy):
    real, cache = real_decode_batch(random_llama, 3, 10, 0.0 if greedy else 0.9, 8)  # 3 rows -> 4; ends 11 -> 16
    fake = padding_decode_batch(real.decode_rows, real.kv_indices.shape[0] // real.decode_rows, cache.scratch_cell,
                                greedy)
    assert (real.decode_rows, real.kv_indices.shape[0]) == (4, 64)
    assert fake.layout() == real.layout()  # the graph key's layout part
    for name in TENSOR_FIELDS:  # and its sizes: every buffer a graph binds, with the same dtype
        a, b = getattr(fake, name), getattr(real, name)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name


def real_mixed_batch(model, temperature: float):
    """Two requests decoding beside a third one's prompt: a flat step, padded as a graphed run pads it."""
    cache = model.make_cache(64, 4)
    sched = Scheduler(cache.allocator, 256, 8)
    for i in range(2):
        sched.add(Request(i, [3 + i] * 10, SamplingParams(max_new_tokens=4, temperature=temperature)))
    prefill = sched.schedule()
    sched.update(prefill, [5, 5])
    sched.add(Request(2, [7] * 9, SamplingParams(max_new_tokens=4, temperature=temperature)))
    batch = build_batch(sched.schedule(), cache, 8, True, ROW_BUCKETS, 8)
    assert not batch.decode_rows and batch.num_sampled == 3  # (a mixed step: the flat layout)
    tokens, keys = flat_buckets(2048, 4096)
    return pad_flat(batch, cache.scratch_cell, tokens, keys, 4, 2048, 4096), cache


def test_the_flat_buckets_are_cut_to_what_a_slot_holds():
    assert flat_buckets(2048, 10**6) == ((128, 256, 384, 512, 768, 1024, 1536, 2048),
                                         (1024, 2048, 4096, 8192, 16384, 32768, 49152))
    assert flat_buckets(1100, 3000) == ((128, 256, 384, 512, 768, 1024, 1100), (1024, 2048, 3000))
    assert flat_buckets(64, 600) == ((64,), (600,))  # (a slot smaller than every bucket: one, its own size)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_padding_flat_batch_has_a_real_padded_mixed_steps_shapes_and_layout(random_llama, greedy):
    real, cache = real_mixed_batch(random_llama, 0.0 if greedy else 0.9)
    assert real.padded and (real.num_tokens, real.kv_indices.shape[0], real.num_sampled) == (128, 1024, 4)
    fake = padding_flat_batch(128, 1024, 4, cache.scratch_cell, greedy)
    assert fake.layout() == real.layout()
    for name in TENSOR_FIELDS:
        a, b = getattr(fake, name), getattr(real, name)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name


@pytest.mark.parametrize("make", [lambda scratch: padding_decode_batch(4, 8, scratch, greedy=True),
                                  lambda scratch: padding_flat_batch(32, 64, 4, scratch, greedy=False)],
                         ids=["decode", "flat"])
def test_the_padding_batch_writes_only_the_scratch_cell(random_llama, monkeypatch, make):
    monkeypatch.setattr(random_llama, "decode_layout", True)
    cache = random_llama.make_cache(16, 4)
    for t in cache.keys + cache.values:
        t.normal_()  # (a cell a request holds: anything but what the step would write)
    before = [t.clone() for t in cache.keys + cache.values]
    tokens = random_llama.next_tokens(make(cache.scratch_cell), cache)
    assert tokens.shape == (4,)
    changed = set()
    for a, b in zip(before, cache.keys + cache.values):
        changed |= set((a != b).flatten(1).any(1).nonzero().flatten().tolist())
    assert changed == {cache.scratch_cell}  # written there, and nowhere else


def test_capture_up_to_is_refused_where_there_are_no_cuda_graphs(random_llama):
    engine = minibatch.Engine(random_llama)
    with pytest.raises(ValueError, match="capture_up_to captures CUDA graphs: it needs a CUDA device"):
        Serving(engine, capture_up_to=512)
    for bad in (-1, 2.5, True, "512"):
        with pytest.raises(ValueError, match="capture_up_to must be a number of tokens >= 0"):
            Serving(engine, capture_up_to=bad)
    engine.close()


@pytest.mark.parametrize("flat", [False, True], ids=["decode-graphs", "all-graphs"])
@pytest.mark.parametrize("mode, pairs", [("sync", [(0, None)]), ("async", [(0, 1), (1, 0)])])
def test_every_shape_is_launched_once_per_slot_pairing_and_kept_off_the_timeline(random_llama, monkeypatch, mode,
                                                                                 pairs, flat):
    """The captures' bookkeeping on the CPU: StepRunner stands in for the GPU (it records each key it is
    asked for as captured), the rest is the real path: slots, streams, the cpu device (as threads, so
    that the stand-in runs in this process). A run that graphs flat steps (cuda_graphs=True: the runner
    pads them to its slots' capacity) has their shapes captured too, on the coarse buckets."""
    from minibatch.core.config import EngineConfig, serving_config
    from minibatch.core.graphs import StepRunner
    from minibatch.core.timeline import Timeline
    from minibatch.speed.startup_graphs import capture_startup_graphs, decode_shapes, flat_shapes

    monkeypatch.setenv("MINIBATCH_CPU_DEVICE", "cpu-threads")
    monkeypatch.setattr(random_llama, "decode_kv_bucket", 8)
    asked = []

    def capture(self, args):
        asked.append(args.key)
        self.graphs[args.key] = object()

    monkeypatch.setattr(StepRunner, "__call__", capture)
    timeline = Timeline()
    with minibatch.Engine(random_llama) as engine, engine.exclusive():
        run = engine.open_run(serving_config(random_llama, EngineConfig(mode=mode, max_batch_size=4,
                                                                        max_batch_tokens=300)), [], timeline)
        monkeypatch.setattr(run.runner, "use_graphs", True)
        monkeypatch.setattr(run.runner, "decode_layout", True)
        if not flat:  # (a GPU run with cuda_graphs="decode" has no capacity to pad flat steps to)
            monkeypatch.setattr(run.runner, "capacity", None)
        assert decode_shapes(run, 20) == [(r, w) for r in (1, 2, 4) for w in (8, 16, 24)]
        seen = []
        n = capture_startup_graphs(engine, 20, progress=lambda done, total: seen.append((done, total)))
        decode = [k for k in asked if k[5]]  # (layout: decode_rows first)
        assert {(k[0], k[1]) for k in decode} == set(pairs)
        assert {(k[2], k[3] // k[2]) for k in decode} == {(r, w) for r in (1, 2, 4) for w in (8, 16, 24)}
        assert len(decode) == len(pairs) * 9 * 2
        if flat:
            shapes = flat_shapes(run, 20)
            assert run.runner.flat_buckets == ((128, 256, 300), (1024, 2048, 2080))  # (capacity: 300 tokens, 2080 keys)
            assert shapes == [(128, 1024), (256, 1024), (300, 1024)]
            assert {(k[2], k[3], k[4]) for k in asked if not k[5]} == {(t, k, 4) for t, k in shapes}
            # flat steps also after none in async: an idle loop's first step, a new request's prefill
            flat_pairs = set(pairs) | ({(0, None), (1, None)} if mode == "async" else set())
            assert {(k[0], k[1]) for k in asked if not k[5]} == flat_pairs
        flat_pairs = len(pairs) + 2 * (mode == "async")
        assert n == len(asked) == len(set(asked)) == (len(pairs) * 9 + flat * flat_pairs * 3) * 2
        assert seen[-1] == (n, n)
        assert capture_startup_graphs(engine, 20) == 0  # all there already
        assert not timeline.spans  # (the run's timeline is back in place, with nothing from the captures)
        engine.finish()


@pytest.mark.parametrize("cuda_graphs, compile", [(False, False), (None, True), ("decode", "dynamic")])
def test_captures_are_refused_without_cuda_graphs_or_with_compile_before_anything_runs(cuda_graphs, compile):
    """One check for Serving and `serve`: on a CUDA device (no GPU needed to check), CUDA graphs off or
    a compiled step is refused as the options are given, not as the run opens."""
    from minibatch.speed.startup_graphs import check_capture

    if cuda_graphs is False:
        with pytest.raises(ValueError, match=r"--capture-up-to captures CUDA graphs: .*cuda_graphs=False"):
            check_capture("cuda", cuda_graphs, compile, "--capture-up-to")
    else:
        with pytest.raises(ValueError, match=r"capture_up_to captures CUDA graphs: .*compile="):
            check_capture("cuda", cuda_graphs, compile)
    check_capture("cuda", True, False)  # (allowed: every step a graph)
    check_capture("cuda", None, False)


def test_captures_need_cuda_graphs_and_an_idle_run(random_llama):
    from minibatch.core.config import EngineConfig, serving_config
    from minibatch.speed.startup_graphs import capture_startup_graphs

    with minibatch.Engine(random_llama) as engine, engine.exclusive():
        with pytest.raises(RuntimeError, match="needs an open run"):
            capture_startup_graphs(engine, 64)
        engine.open_run(serving_config(random_llama, EngineConfig(mode="async", max_batch_size=4,
                                                                  max_batch_tokens=64)), [])
        with pytest.raises(ValueError, match="capturing graphs at start-up needs CUDA graphs on a CUDA device"):
            capture_startup_graphs(engine, 64)
        engine.finish()


def test_the_server_says_how_far_the_start_up_captures_are():
    """serve prints a line at each tenth of the captures (a minute or more of silence otherwise)."""
    import io

    pytest.importorskip("fastapi")
    from minibatch.serving.startup import capture_progress

    out = io.StringIO()
    progress = capture_progress(out)
    for done in range(1, 721):
        progress(done, 720)
    lines = out.getvalue().splitlines()
    assert [line.split()[4] for line in lines] == [f"{72 * k}/720" for k in range(1, 11)]
    assert all(line.startswith("minibatch: start-up CUDA graphs ") for line in lines)
