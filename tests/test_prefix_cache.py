"""Prefix caching (core/prefix_cache.py): requests that start alike share KV blocks, and get the tokens they get
without it, in both loops, whatever the budget, with blocks evicted; a block a running request holds is never
handed to another; the shared tokens are not computed again."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minibatch
from minibatch.core.engine import Engine
from minibatch.core.kv_cache import BlockAllocator
from minibatch.core.requests import Request, RequestState, SamplingParams
from minibatch.core.scheduler import Scheduler

QUESTIONS = ["The for statement", "A class definition", "Exceptions", "Lists hold", "def main", "The while loop"]


@pytest.fixture(scope="module")
def tiny():
    return minibatch.load_model("tiny", device="cpu")


def _prompts(tiny):
    tok = tiny.tokenizer
    system = tok.encode("You are a helpful assistant who answers questions about the Python language. ")
    return [system + tok.encode(q, add_bos=False) for q in QUESTIONS], len(system)


def _run(tiny, prefix_caching: bool, mode: str, arrivals=True, **config):
    prompts, _ = _prompts(tiny)
    requests = [Request(i, p, SamplingParams(max_new_tokens=12, temperature=0.7 if i % 2 else 0.0, seed=i),
                        arrival_step=2 * i if arrivals else 0) for i, p in enumerate(prompts)]
    computed = []
    with Engine(tiny) as engine:
        run = engine.start(requests, mode, prefix_caching=prefix_caching, block_size=4, **config)
        while engine.has_work():
            engine.step()
            computed.append(sum(c.num_tokens for c in run.applied.chunks) if run.applied is not None else 0)
        hits = run.scheduler.prefix.hit_tokens
        engine.finish()  # (raises if a KV block did not come back: kept blocks too)
    return [r.output for r in requests], hits, sum(computed)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("config", [{}, dict(max_batch_tokens=16, max_batch_size=3), dict(arrivals=False),
                                    dict(num_blocks=40, max_batch_size=2, max_batch_tokens=32)],
                         ids=["staggered", "chunked", "all-at-once", "evicting"])
def test_the_same_tokens_with_and_without_prefix_caching(tiny, mode, config):
    shared, hits, computed = _run(tiny, True, mode, **config)
    plain, none, computed_plain = _run(tiny, False, mode, **config)
    assert shared == plain and none == 0
    assert hits > 0 and computed == computed_plain - hits  # the shared tokens were not computed again


def test_every_later_request_shares_the_system_prompt(tiny):
    prompts, system = _prompts(tiny)
    _, hits, _ = _run(tiny, True, "sync")

    def common(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    # each request shares the full blocks (block_size 4) of the longest start it has in common with an earlier
    # one: the system prompt at least (two questions also begin alike), never its own last token
    want = [max(common(p, q) for q in prompts[:i]) for i, p in enumerate(prompts) if i]
    assert min(want) >= system
    assert hits == sum(min(c, len(p) - 1) // 4 * 4 for c, p in zip(want, prompts[1:]))


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny):
    prompts, _ = _prompts(tiny)
    with Engine(tiny) as engine:
        outs = []
        for pc in (True, False):
            requests = [Request(i, p, SamplingParams(max_new_tokens=4, prompt_logprobs=1), arrival_step=2 * i)
                        for i, p in enumerate(prompts[:3])]
            engine.start(requests, "async", prefix_caching=pc, block_size=4)
            while engine.has_work():
                engine.step()
            engine.finish()
            outs.append([(r.output, [t.logprob for t in r.prompt_logprobs]) for r in requests])
    assert [len(lp) for _, lp in outs[0]] == [len(p) - 1 for p in prompts[:3]]
    assert outs[0] == outs[1]


def test_prefix_caching_is_checked_by_name():
    with pytest.raises(TypeError, match="prefix_caching must be True or False"):
        minibatch.EngineConfig(prefix_caching="on")


workloads = st.fixed_dictionaries({
    # prompts drawn from a few stems, so that many share blocks; max_new small, blocks few: evictions
    "stems": st.lists(st.integers(0, 2), min_size=1, max_size=12),
    "tails": st.lists(st.integers(0, 9), min_size=12, max_size=12),
    "lengths": st.lists(st.integers(1, 20), min_size=12, max_size=12),
    "block_size": st.sampled_from([1, 2, 4]),
    "spare_blocks": st.integers(0, 12),
    "budget": st.integers(4, 24),
    "eos_at": st.lists(st.integers(1, 5), min_size=12, max_size=12),
})


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_no_block_a_running_request_holds_is_handed_to_another(w):
    """The scheduler alone, tokens made up: at every step, a block in two running requests' tables is a kept
    block at the same place in both, inside the prompt start they have in common; every block comes back."""
    bs = w["block_size"]
    stems = [[7, 3, 9, 1, 4, 4, 8, 2] * 3, [7, 3, 9, 1, 5, 5, 5, 5] * 3, [2] * 24]
    reqs = [Request(i, stems[s][:w["lengths"][i]] + [w["tails"][i]], SamplingParams(max_new_tokens=5, eos_token_id=0))
            for i, s in enumerate(w["stems"])]
    need = max(-(-r.max_len // bs) for r in reqs)
    allocator = BlockAllocator(need + w["spare_blocks"], bs)
    sched = Scheduler(allocator, w["budget"], 4, prefix_caching=True)
    for r in reqs:
        sched.add(r)
    while sched.has_work():
        plan = sched.schedule()
        running = [r for r in sched.running if r.state is not RequestState.FINISHED]
        owner: dict[int, tuple[Request, int]] = {}
        for r in running:
            for i, b in enumerate(r.blocks):
                if b in owner:
                    other, j = owner[b]
                    common = next((k for k, (x, y) in enumerate(zip(r.prompt, other.prompt)) if x != y),
                                  min(len(r.prompt), len(other.prompt)))
                    assert i == j and (i + 1) * bs <= common and b in sched.prefix._key_of, (b, r.rid, other.rid)
                owner[b] = (r, i)
        # a made-up token per sampled row: request i ends (EOS, id 0) at its eos_at[i]-th token
        sched.update(plan, [0 if len(c.request.output) + 1 >= w["eos_at"][c.request.rid] else 1
                            for c in plan.sampling_chunks])
    sched.close()
    assert allocator.num_free == allocator.num_blocks
    assert all(r.state is RequestState.FINISHED for r in reqs)
