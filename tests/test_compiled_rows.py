"""A compiled decode step with a dynamic row count (runner/compiled.py, `compile="dynamic"`): one compile
serves every batch size, with the tokens of the eager step. On the CPU here, through Inductor and the
sibling-merging backend a GPU uses; tests/test_gpu.py runs it in an engine on a GPU."""

import shutil

import pytest
import torch

import minibatch
from minibatch.batching.batch import DYNAMIC_ROWS, build_batch
from minibatch.batching.buckets import ROW_BUCKETS
from minibatch.batching.requests import Request
from minibatch.batching.scheduler import Scheduler
from minibatch.runner import siblings
from minibatch.runner.compiled import ROW_FIELDS, CompiledStep

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                                reason="Inductor compiles C++ on a CPU")


def decode_batch(model, cache, rows: int, seed: int):
    """`rows` requests of different lengths, prefilled eagerly; their first decode step, in the decode layout."""
    scheduler = Scheduler(cache.allocator, 4096, 64)
    g = torch.Generator().manual_seed(seed)
    for i in range(rows):
        scheduler.add(Request(i, torch.randint(1, model.vocab_size, (5 + 7 * i,), generator=g).tolist(), 4))
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
    assert counters["stats"]["unique_graphs"] - before == 1  # static rows would have compiled four times
    assert step.shapes == {(None, None, True, cache.num_cells, True)}
    assert backend.merged == [3 * model.num_layers]  # q/k/v and gate/up merged in that one compile


def test_rows_come_from_the_tensors_only_when_dynamic():
    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    batch = decode_batch(model, model.make_cache(64, 16), 3, seed=0)
    assert batch.rows() == batch.decode_rows == 4
    import dataclasses

    dynamic = dataclasses.replace(batch, decode_rows=DYNAMIC_ROWS)
    assert dynamic.rows() == batch.input_ids.shape[0] == 4
    for name in ROW_FIELDS:  # what CompiledStep marks dynamic has one entry per row
        assert getattr(batch, name).shape[0] == 4, name
