"""The async loop equals the sync loop token for token, and Hugging Face generate for greedy."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minibatch
from minibatch.core.timeline import Timeline

VOCAB = 512


def prompts_of(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


workloads = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(1, 30), min_size=1, max_size=10),
    "seed": st.integers(0, 10_000),
    "max_new": st.integers(1, 10),
    "budget": st.integers(4, 24),
    "seats": st.integers(1, 5),
    "eos_pick": st.one_of(st.none(), st.integers(0, 10_000)),
    "arrivals": st.lists(st.integers(0, 12), min_size=10, max_size=10),
    "temperature": st.sampled_from([0.0, 0.0, 1.0]),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=workloads)
def test_async_equals_sync(random_llama, w):
    prompts = prompts_of(w["lengths"], w["seed"])
    kw = dict(max_new_tokens=w["max_new"], max_batch_tokens=max(w["budget"], w["seats"]),
              max_batch_size=w["seats"], temperature=w["temperature"], seed=w["seed"],
              arrival_steps=w["arrivals"][: len(prompts)], block_size=4)
    eos = None
    if w["eos_pick"] is not None:  # an EOS the run really emits, at a random place
        free = [t for o in minibatch.generate(random_llama, prompts, **kw) for t in o]
        eos = free[w["eos_pick"] % len(free)]
    sync = minibatch.generate(random_llama, prompts, mode="sync", eos_token_id=eos, **kw)
    asyn = minibatch.generate(random_llama, prompts, mode="async", eos_token_id=eos, **kw)
    assert asyn == sync
    for o in sync:
        assert 1 <= len(o) <= w["max_new"]
        assert eos not in o[:-1]


def test_async_greedy_matches_hf_generate(random_llama):
    prompts = prompts_of([5, 23, 41, 1, 9, 16, 30], seed=0)
    outs = minibatch.generate(random_llama, prompts, max_new_tokens=10, mode="async", max_batch_size=3,
                              max_batch_tokens=8, block_size=4)
    for p, o in zip(prompts, outs):
        ref = random_llama.hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref


def test_eos_in_flight_is_dropped(tiny):
    """The tiny model ends paragraphs with EOS; async schedules one step past it and must cut there."""
    tok = tiny.tokenizer
    prompts = [tok.encode(t) for t in ("Names", "The for statement", "A class", "Note", "See also", "For example")]
    # two requests stop by EOS (after 77 and 192 tokens) while four others run on to the cap
    kw = dict(max_new_tokens=200, eos_token_id=tok.eos_token_id, max_batch_tokens=32, temperature=0.7, seed=3)
    sync = minibatch.generate(tiny, prompts, mode="sync", **kw)
    asyn = minibatch.generate(tiny, prompts, mode="async", **kw)
    assert asyn == sync
    assert sum(o[-1] == tok.eos_token_id for o in sync) >= 2, "want requests that stop at EOS mid-run"


def test_stress_hundreds_of_requests(random_llama):
    prompts = prompts_of([1 + i % 13 for i in range(300)], seed=5)
    tl = Timeline()
    outs = minibatch.generate(random_llama, prompts, max_new_tokens=3, mode="async", max_batch_size=32,
                              max_batch_tokens=96, num_blocks=40, block_size=4, timeline=tl,
                              eos_token_id=7, arrival_steps=[i // 10 for i in range(300)])
    assert len(outs) == 300 and all(1 <= len(o) <= 3 for o in outs)
    assert {s.slot for s in tl.spans if s.lane == "compute"} == {0, 1}  # both slots in use


def test_without_eos_async_plans_the_same_batches_as_sync(random_llama):
    """More requests than seats, no EOS: both loops plan identical steps (same rows, same shapes), which
    is what lets bf16 runs on a GPU agree token for token (tests/test_gpu.py)."""
    prompts = prompts_of([3, 17, 8, 25, 4, 11, 30, 6, 9, 2, 14, 20], seed=7)
    plans = {}
    for mode in ("sync", "async"):
        seen = []
        minibatch.generate(random_llama, prompts, mode=mode, max_new_tokens=7, max_batch_size=4,
                           max_batch_tokens=16, on_step=lambda plan, done: seen.append(
                               [(c.request.rid, c.start, c.end) for c in plan.chunks]))
        plans[mode] = seen
    assert plans["async"] == plans["sync"]


def test_before_a_launch_bound_step_the_host_takes_batch_n_first(random_llama, loop_order):
    """Before a step whose launch holds the host (an eager step on a GPU: StepRunner.launch_bound), the async
    loop waits for batch N and updates with it first, then launches N+1; before any other step it launches
    first. Made to happen on the CPU by calling every step with prompt tokens launch-bound: the order
    changes, the tokens do not (EOS in flight and arrivals included)."""
    events = loop_order(launch_bound=lambda batch: batch.num_tokens > batch.num_sampled)
    prompts = prompts_of([5, 23, 41, 1, 9, 16, 30, 12], seed=5)
    kw = dict(max_new_tokens=8, max_batch_size=3, max_batch_tokens=16, block_size=4,
              arrival_steps=[0, 0, 2, 3, 5, 8, 9, 14])
    free = minibatch.generate(random_llama, prompts, mode="sync", **kw)
    eos = free[2][3]  # an EOS the run really emits
    sync = minibatch.generate(random_llama, prompts, mode="sync", eos_token_id=eos, **kw)
    events.clear()
    assert minibatch.generate(random_llama, prompts, mode="async", eos_token_id=eos, **kw) == sync
    asked = [i for i, e in enumerate(events) if e[0] == "asked"]
    assert {events[i][1] for i in asked} == {True, False}  # both orders happened
    for i in asked:
        first, second = events[i + 1], events[i + 2]
        if events[i][1]:  # batch N, then the launch of N+1
            assert first[0] == "update" and second[0] == "launch" and first[1] < second[1]
        else:
            assert first[0] == "launch" and second[0] == "update" and second[1] < first[1]
