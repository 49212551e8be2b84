"""Decode graphs captured before a server's first request (minibatch/speed/startup_graphs.py): the
padding batch it captures has the shapes and layout of a real decode step, so a real step replays its
graph; it touches only the scratch cell; and it is refused clearly where there are no CUDA graphs.
The captures themselves run on the GPU (tests/test_gpu.py)."""

import pytest
import torch

import minibatch
from minibatch.core.batch import TENSOR_FIELDS, build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.serving.loop import Serving
from minibatch.speed.startup_graphs import padding_decode_batch


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


def test_the_padding_batch_writes_only_the_scratch_cell(random_llama, monkeypatch):
    monkeypatch.setattr(random_llama, "decode_layout", True)
    cache = random_llama.make_cache(16, 4)
    for t in cache.keys + cache.values:
        t.normal_()  # (a cell a request holds: anything but what the step would write)
    before = [t.clone() for t in cache.keys + cache.values]
    tokens = random_llama.next_tokens(padding_decode_batch(4, 8, cache.scratch_cell, greedy=True), cache)
    assert tokens.shape == (4,)
    changed = set()
    for a, b in zip(before, cache.keys + cache.values):
        changed |= set((a != b).flatten(1).any(1).nonzero().flatten().tolist())
    assert changed == {cache.scratch_cell}  # written there, and nowhere else


def test_capture_up_to_is_refused_where_there_are_no_cuda_graphs(random_llama):
    engine = minibatch.Engine(random_llama)
    with pytest.raises(ValueError, match="capture_up_to captures CUDA graphs, which need a CUDA device"):
        Serving(engine, capture_up_to=512)
    for bad in (-1, 2.5, True, "512"):
        with pytest.raises(ValueError, match="capture_up_to must be a number of tokens >= 0"):
            Serving(engine, capture_up_to=bad)
    engine.close()


@pytest.mark.parametrize("mode, pairs", [("sync", [(0, None)]), ("async", [(0, 1), (1, 0)])])
def test_every_shape_is_launched_once_per_slot_pairing_and_kept_off_the_timeline(random_llama, monkeypatch, mode,
                                                                                 pairs):
    """The captures' bookkeeping on the CPU: StepRunner stands in for the GPU (it records each key it is
    asked for as captured), the rest is the real path: slots, streams, the cpu device (as threads, so
    that the stand-in runs in this process)."""
    from minibatch.core.config import EngineConfig, serving_config
    from minibatch.core.graphs import StepRunner
    from minibatch.core.timeline import Timeline
    from minibatch.speed.startup_graphs import capture_decode_graphs, decode_shapes

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
                                                                        max_batch_tokens=64)), [], timeline)
        monkeypatch.setattr(run.runner, "use_graphs", True)
        monkeypatch.setattr(run.runner, "decode_layout", True)
        assert decode_shapes(run, 20) == [(r, w) for r in (1, 2, 4) for w in (8, 16, 24)]
        seen = []
        n = capture_decode_graphs(engine, 20, progress=lambda done, total: seen.append((done, total)))
        assert n == len(asked) == len(set(asked)) == len(pairs) * 9 * 2
        assert {(k[0], k[1]) for k in asked} == set(pairs)
        assert {(k[2], k[3] // k[2]) for k in asked} == {(r, w) for r in (1, 2, 4) for w in (8, 16, 24)}
        assert seen[-1] == (n, n)
        assert capture_decode_graphs(engine, 20) == 0  # all there already
        assert not timeline.spans  # (the run's timeline is back in place, with nothing from the captures)
        engine.finish()


def test_captures_need_cuda_graphs_and_an_idle_run(random_llama):
    from minibatch.core.config import EngineConfig, serving_config
    from minibatch.speed.startup_graphs import capture_decode_graphs

    with minibatch.Engine(random_llama) as engine, engine.exclusive():
        with pytest.raises(RuntimeError, match="needs an open run"):
            capture_decode_graphs(engine, 64)
        engine.open_run(serving_config(random_llama, EngineConfig(mode="async", max_batch_size=4,
                                                                  max_batch_tokens=64)), [])
        with pytest.raises(ValueError, match="needs CUDA graphs on a CUDA device"):
            capture_decode_graphs(engine, 64)
        engine.finish()
