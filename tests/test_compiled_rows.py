"""A compiled decode step with a dynamic row count (speed/compiled.py, `compile="dynamic"`): one compile
serves every batch size, with the tokens of the eager step. On the CPU here, through Inductor and the
sibling-merging backend a GPU uses; tests/test_gpu.py runs it in an engine on a GPU."""

import dataclasses
import shutil

import pytest
import torch

import minibatch
from minibatch.core.batch import DYNAMIC_ROWS, build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.speed import siblings
from minibatch.speed.compiled import ROW_FIELDS, CompiledStep

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                                reason="Inductor compiles C++ on a CPU")


def decode_batch(model, cache, rows: int, seed: int, sampling: SamplingParams = SamplingParams()):
    """`rows` requests of different lengths, prefilled eagerly; their first decode step, in the decode layout."""
    scheduler = Scheduler(cache.allocator, 4096, 64)
    g = torch.Generator().manual_seed(seed)
    for i in range(rows):
        prompt = torch.randint(1, model.vocab_size, (5 + 7 * i,), generator=g).tolist()
        scheduler.add(Request(i, prompt, sampling.replace(seed=seed + i, max_new_tokens=4)))
    plan = scheduler.schedule()
    scheduler.update(plan, model.next_tokens(build_batch(plan, cache, model.kv_bucket), cache).tolist())
    return build_batch(scheduler.schedule(), cache, model.kv_bucket, True, ROW_BUCKETS, model.decode_kv_bucket)


def test_one_compile_serves_every_row_count_with_the_eager_tokens():
    from torch._dynamo.utils import counters

    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    cache = model.make_cache(256, 16)
    torch._dynamo.reset()
    backend = siblings.backend("cpu-rows-test")  # a mode of its own: counts only this test's compiles
    backend.mode = None  # (Inductor's default options)
    step = CompiledStep(model, mode="cpu-rows-test", dynamic_rows=True)
    before = counters["stats"]["unique_graphs"]
    seen = []
    for rows in (3, 2, 6, 11):  # padded to the row buckets 4, 2, 8, 16; keys per row 20 to 82
        batch = decode_batch(model, cache, rows, seed=rows)
        seen.append((batch.decode_rows, batch.kv_indices.shape[0] // batch.decode_rows))
        eager = model.next_tokens(batch, cache)
        assert torch.equal(step(batch, cache), eager), f"{rows} rows"
        assert batch.decode_rows > 1 and batch.rows() == batch.decode_rows  # the caller's batch is untouched
    assert len({r for r, _ in seen}) == 4 and len({w for _, w in seen}) == 4
    # the forward (one compile) and the greedy sampler (one more): static rows would have compiled four times
    assert counters["stats"]["unique_graphs"] - before == 2
    assert step.shapes == {(None, None, True, cache.num_cells, True)}
    assert backend.merged == [3 * model.num_layers, 0]  # q/k/v and gate/up merged in the forward's compile
    # sampled batches reuse the forward: one more compile for the sampler without top-k/top-p; with them
    # the sampler runs eagerly (compiled.py says why), so nothing compiles
    for params, compiles in ((SamplingParams(temperature=0.8), 1), (SamplingParams(temperature=0.8, top_k=5), 0),
                             (SamplingParams(temperature=1.2, top_p=0.7), 0)):
        for rows in (3, 6):
            batch = decode_batch(model, cache, rows, seed=10 + rows, sampling=params)
            assert torch.equal(step(batch, cache), model.next_tokens(batch, cache)), (params, rows)
        assert counters["stats"]["unique_graphs"] - before == 2 + compiles, params
        before += compiles
    assert backend.merged == [3 * model.num_layers, 0, 0]


def test_rows_come_from_the_tensors_only_when_dynamic():
    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    batch = decode_batch(model, model.make_cache(64, 16), 3, seed=0)
    assert batch.rows() == batch.decode_rows == 4
    dynamic = dataclasses.replace(batch, decode_rows=DYNAMIC_ROWS)
    assert dynamic.rows() == batch.input_ids.shape[0] == 4
    for name in ROW_FIELDS:  # what CompiledStep marks dynamic has one entry per row
        assert getattr(batch, name).shape[0] == 4, name
