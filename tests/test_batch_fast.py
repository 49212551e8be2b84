"""The vectorized batch builder builds exactly the batch the straightforward one does (reference_batch.py)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_batch import reference_build_batch

from minibatch.core.batch import TENSOR_FIELDS, build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.kv_cache import PagedKVCache
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler

VOCAB = 50

workloads = st.fixed_dictionaries({
    "prompts": st.lists(st.integers(1, 40), min_size=1, max_size=10),
    "max_new": st.lists(st.integers(1, 12), min_size=10, max_size=10),
    "temperature": st.lists(st.sampled_from([0.0, 0.7]), min_size=10, max_size=10),
    "eos": st.one_of(st.none(), st.integers(0, VOCAB - 1), st.frozensets(st.integers(0, VOCAB - 1), min_size=1,
                                                                            max_size=3)),
    "min_tokens": st.lists(st.integers(0, 12), min_size=10, max_size=10),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_batch_size": st.integers(1, 6),
    "extra_budget": st.integers(0, 40),
    "kv_bucket": st.sampled_from([1, 8, 64]),
    "decode_bucket": st.sampled_from([None, 4, 64]),
    "rows": st.sampled_from([(), ROW_BUCKETS]),
    "in_flight": st.booleans(),
    # per request: no logprobs, logprobs of its tokens, of its prompt, or a prompt scored with nothing generated
    # per request: penalties off, or (presence, frequency, repetition) on
    "penalties": st.lists(st.sampled_from([(0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, -0.3, 1.2), (0.0, 0.0, 1.5)]),
                          min_size=10, max_size=10),
    "logprobs": st.lists(st.sampled_from([(None, None), (2, None), (None, 1), (0, 3), ("zero", 0)]),
                         min_size=10, max_size=10),
})


def assert_same(fast, ref):
    for name in TENSOR_FIELDS:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.layout() == ref.layout()


@settings(max_examples=200, deadline=None)
@given(workloads)
def test_fast_builder_equals_reference(w):
    """Every step of a random workload, both layouts; with `in_flight`, tokens reach the requests one
    step late, as in the async loop, so decode inputs are placeholders."""
    bs = w["block_size"]
    def params(i: int) -> SamplingParams:
        logprobs, prompt_logprobs = w["logprobs"][i]
        new = 0 if logprobs == "zero" else w["max_new"][i]
        return SamplingParams(w["temperature"][i], seed=i, max_new_tokens=new, eos_token_id=w["eos"],
                              min_tokens=min(w["min_tokens"][i], new),
                              logprobs=None if logprobs == "zero" else logprobs, prompt_logprobs=prompt_logprobs,
                              **dict(zip(("presence_penalty", "frequency_penalty", "repetition_penalty"),
                                         w["penalties"][i])))

    reqs = [Request(i, [(i + j) % VOCAB for j in range(n)], params(i)) for i, n in enumerate(w["prompts"])]
    cache = PagedKVCache(1, 1, 1, sum(-(-r.max_len // bs) for r in reqs), bs)
    sched = Scheduler(cache.allocator, w["max_batch_size"] + w["extra_budget"], w["max_batch_size"])
    for r in reqs:
        sched.add(r)
    held = None
    while sched.has_work():
        plan = sched.schedule() if sched.has_unplanned_work() or held is None else None
        if plan is not None and plan.chunks:
            for decode_layout in (False, True):
                kw = dict(kv_bucket=w["kv_bucket"], decode_layout=decode_layout, row_buckets=w["rows"],
                          decode_bucket=w["decode_bucket"])
                assert_same(build_batch(plan, cache, **kw), reference_build_batch(plan, cache, **kw))
        if held is not None:
            sched.update(held, [(c.request.rid * 31 + c.end * 7) % VOCAB for c in held.sampling_chunks])
            held = None
        if plan is not None and plan.chunks:
            if w["in_flight"]:
                held = plan
            else:
                sched.update(plan, [(c.request.rid * 31 + c.end * 7) % VOCAB for c in plan.sampling_chunks])


def test_decode_table_is_copied_while_an_earlier_batch_lives():
    """The incremental decode key table must not change a batch that was built before."""
    reqs = [Request(i, list(range(5 + 3 * i)), SamplingParams(max_new_tokens=20)) for i in range(3)]
    cache = PagedKVCache(1, 1, 1, 30, 4)
    sched = Scheduler(cache.allocator, 64, 3)
    for r in reqs:
        sched.add(r)
    sched.update(sched.schedule(), [1, 2, 3])  # all prompts in one step
    kw = dict(kv_bucket=4, decode_layout=True, row_buckets=ROW_BUCKETS)
    kept = []
    for _ in range(6):
        plan = sched.schedule()
        batch = build_batch(plan, cache, **kw)
        assert batch.decode_rows == 4
        kept.append((batch, reference_build_batch(plan, cache, **kw)))
        sched.update(plan, [1, 2, 3])
    for fast, ref in kept:
        assert_same(fast, ref)


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_slots_loaded_by_what_changed_hold_the_whole_batch(w):
    """Two IO slots loaded in turn, as the async loop does (decode batches copy only the key cells that
    changed since the slot's last load): after every load the slot's host buffers equal the batch."""
    from minibatch.devices import get_device
    from minibatch.core.slots import IOSlot

    bs = w["block_size"]
    reqs = [Request(i, [(i + j) % VOCAB for j in range(n)], SamplingParams(max_new_tokens=w["max_new"][i], eos_token_id=w["eos"]))
            for i, n in enumerate(w["prompts"])]
    cache = PagedKVCache(1, 1, 1, sum(-(-r.max_len // bs) for r in reqs), bs)
    sched = Scheduler(cache.allocator, w["max_batch_size"] + w["extra_budget"], w["max_batch_size"])
    for r in reqs:
        sched.add(r)
    kw = dict(kv_bucket=w["kv_bucket"], decode_layout=True, row_buckets=w["rows"], decode_bucket=w["decode_bucket"])
    with get_device("cpu") as dev:
        slots = [IOSlot(dev, i, 512, 4096, 256) for i in range(2)]
        step = 0
        while sched.has_work():
            plan = sched.schedule()
            batch = build_batch(plan, cache, **kw)
            slot = slots[step % 2]
            slot.load(batch, [])
            for name in TENSOR_FIELDS:
                t = getattr(batch, name)
                assert torch.equal(slot.host[name][: t.shape[0]], t), name
            del batch
            sched.update(plan, [(c.request.rid * 31 + c.end * 7) % VOCAB for c in plan.sampling_chunks])
            step += 1
