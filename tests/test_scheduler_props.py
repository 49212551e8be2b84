"""Property tests of the scheduler and the paged KV cache, driven by a fake model (no forward pass)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.core.batch import build_batch
from minibatch.core.kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from minibatch.core.requests import Request, RequestState, SamplingParams
from minibatch.core.scheduler import Scheduler

VOCAB = 50


def fake_token(r: Request, pos: int) -> int:
    """A deterministic 'model': next token from the request id and position."""
    return (r.rid * 31 + pos * 7) % VOCAB


workloads = st.fixed_dictionaries({
    "prompts": st.lists(st.integers(1, 40), min_size=1, max_size=12),
    "max_new": st.lists(st.integers(1, 12), min_size=12, max_size=12),
    "eos": st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_batch_size": st.integers(1, 6),
    "extra_budget": st.integers(0, 40),
    "spare_blocks": st.integers(0, 30),
})


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_scheduler_invariants(w):
    bs = w["block_size"]
    reqs = [Request(i, [(i + j) % VOCAB for j in range(n)], SamplingParams(max_new_tokens=w["max_new"][i], eos_token_id=w["eos"]))
            for i, n in enumerate(w["prompts"])]
    biggest = max(-(-r.max_len // bs) for r in reqs)
    cache = PagedKVCache(1, 1, 1, biggest + w["spare_blocks"], bs)
    alloc = cache.allocator
    budget = w["max_batch_size"] + w["extra_budget"]
    sched = Scheduler(alloc, budget, w["max_batch_size"])
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan.chunks, "no progress"
        assert plan.num_tokens <= budget
        assert len(plan.chunks) <= w["max_batch_size"]
        owned = [b for r in sched.running for b in r.blocks]
        assert len(owned) == len(set(owned)), "a KV block is owned twice"
        assert len(owned) + alloc.num_free == alloc.num_blocks
        batch = build_batch(plan, cache)
        for c, k in zip(plan.chunks, range(len(plan.chunks))):
            own = {b * bs + o for b in c.request.blocks for o in range(bs)}
            assert set(batch.kv_indices[batch.kv_seq == k].tolist()) <= own
            assert set(batch.cell_mapping[batch.q_seq == k].tolist()) <= own
        assert batch.num_tokens == plan.num_tokens
        sched.update(plan, [fake_token(c.request, c.end) for c in plan.sampling_chunks])
        steps += 1
        assert steps < 10_000
    assert alloc.num_free == alloc.num_blocks, "KV blocks leaked"
    for r in reqs:
        assert r.state == RequestState.FINISHED
        expected = []
        for k in range(r.max_new_tokens):  # what the fake model emits, cut at the first EOS
            expected.append(fake_token(r, len(r.prompt) + k))
            if expected[-1] == w["eos"]:
                break
        assert r.output == expected
        assert r.finish_reason == ("eos" if expected[-1] == w["eos"] else "length")


def test_allocator_refuses_double_free_and_overdraw():
    a = BlockAllocator(4, 2)
    blocks = a.allocate(3)
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    a.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(blocks[:1])
    assert a.num_free == 4


def test_request_that_never_fits_is_rejected_up_front():
    sched = Scheduler(BlockAllocator(2, 4), 16, 4)
    with pytest.raises(ValueError, match="could never run"):
        sched.add(Request(0, [1] * 9, SamplingParams(max_new_tokens=1)))


def test_requests_wait_when_the_cache_is_full():
    alloc = BlockAllocator(2, 4)
    sched = Scheduler(alloc, 16, 4)
    a, b = Request(0, [1] * 4, SamplingParams(max_new_tokens=5)), Request(1, [2] * 4, SamplingParams(max_new_tokens=5))  # each needs 8 tokens = 2 blocks
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert [c.request for c in plan.chunks] == [a] and b.state == RequestState.WAITING
