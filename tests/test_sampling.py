"""Device sampling: greedy = argmax, seeded sampling reproducible and independent of the batch."""

import torch

import minibatch
from minibatch.core.sampling import sample, uniform_noise


def _params(n, temperature=1.0, top_k=0, top_p=1.0, seed=None, counter=None):
    return (torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
            torch.arange(n) if seed is None else seed, torch.zeros(n, dtype=torch.long) if counter is None else counter)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    assert torch.equal(sample(logits, *_params(6, temperature=0.0)), logits.argmax(-1))


def test_noise_depends_only_on_seed_and_counter():
    a = uniform_noise(torch.tensor([5, 7, 5]), torch.tensor([3, 3, 3]), 100)
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert (a > 0).all() and (a < 1).all()


def test_top_k_1_is_greedy():
    logits = torch.randn(8, 40)
    assert torch.equal(sample(logits, *_params(8, top_k=1)), logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 4)
    assert sample(logits, *_params(4, top_p=0.01)).tolist() == [0, 0, 0, 0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 4000
    toks = sample(probs.log().expand(n, 3), *_params(n, counter=torch.arange(n)))
    freq = torch.bincount(toks, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_generate_is_reproducible_and_batch_independent(random_llama):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12]
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95, seed=11)
    a = minibatch.generate(random_llama, prompts, **kw)
    b = minibatch.generate(random_llama, prompts, max_batch_size=1, max_batch_tokens=4, **kw)
    assert a == b
    c = minibatch.generate(random_llama, prompts, **{**kw, "seed": 12})
    assert c != a


def test_noise_never_reaches_one_on_a_large_vocabulary():
    """u == 1.0 would give +inf Gumbel noise and force that token (a bug found in review)."""
    u = uniform_noise(torch.arange(64), torch.arange(64), 1 << 17)
    assert (u < 1).all() and (u > 0).all()


def test_top_p_one_filters_nothing():
    """top_p = 1.0 keeps the whole vocabulary: the far half of it is drawn as often as its mass says.

    512 draws over a 32768-token vocabulary (each draw has its own counter, so its own noise): the
    lower half of the tokens holds ~16% of the mass, so ~80 draws land there; a filter that dropped
    that tail, or part of it, would show as too few.
    """
    vocab, n = 1 << 15, 512
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, -1)
    # in chunks of 128 rows (rows are independent) to keep the [rows, vocab] temporaries small
    toks = torch.cat([sample(logits.expand(128, -1), *_params(128, top_p=1.0, counter=torch.arange(i, i + 128)))
                      for i in range(0, n, 128)])
    tail = probs.argsort()[: vocab // 2]
    share = torch.isin(toks, tail).float().mean().item()
    mass = probs[tail].sum().item()
    assert abs(share - mass) < 0.05, (share, mass)  # 3 standard deviations of a 512-draw share


def test_all_greedy_fast_path_matches_the_full_sampler(random_llama):
    """A batch whose rows are all greedy skips the sort; it must pick what the full sampler picks."""
    import dataclasses

    from minibatch.core.batch import build_batch
    from minibatch.core.requests import Request, SamplingParams
    from minibatch.core.scheduler import Scheduler

    cache = random_llama.make_cache(32, 4)
    sched = Scheduler(cache.allocator, 64, 8)
    for i, p in enumerate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12]):
        sched.add(Request(i, p, SamplingParams(max_new_tokens=4)))
    batch = build_batch(sched.schedule(), cache)
    assert batch.all_greedy
    fast = random_llama.next_tokens(batch, cache)
    full = random_llama.next_tokens(dataclasses.replace(batch, all_greedy=False), cache)
    assert torch.equal(fast, full)
    sched.add(Request(3, [7, 7], SamplingParams(temperature=0.8, seed=1, max_new_tokens=4)))
    assert not build_batch(sched.schedule(), cache).all_greedy  # one sampled row: the full sampler


def test_the_unsorted_path_picks_what_the_sorted_one_picks():
    """Without top-k or top-p nothing needs the sorted vocabulary: the Gumbel-max over the vocabulary
    as it is must give the sorted path's tokens (rows greedy and sampled, several temperatures)."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 2000, 300
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5])[torch.arange(n) % 5]
    params = (temperature, torch.zeros(n, dtype=torch.long), torch.ones(n), torch.arange(n) * 7919, torch.arange(n) % 13)
    full, fast = sample(logits, *params), sample(logits, *params, filtered=False)
    assert torch.equal(full, fast)
    assert (full != logits.argmax(-1)).sum() > n // 4  # most sampled rows did sample, not argmax


def test_the_host_marks_batches_without_top_k_or_top_p(random_llama):
    import dataclasses

    from minibatch.core.batch import build_batch
    from minibatch.core.requests import Request, SamplingParams
    from minibatch.core.scheduler import Scheduler

    cache = random_llama.make_cache(32, 4)
    sched = Scheduler(cache.allocator, 64, 8)
    for i, p in enumerate([[1, 2, 3], [4, 5, 6, 7, 8]]):
        sched.add(Request(i, p, SamplingParams(temperature=0.9, seed=i, max_new_tokens=4)))
    batch = build_batch(sched.schedule(), cache)
    assert batch.unfiltered and not batch.all_greedy
    fast = random_llama.next_tokens(batch, cache)
    full = random_llama.next_tokens(dataclasses.replace(batch, unfiltered=False), cache)
    assert torch.equal(fast, full)
    for filtering in (SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=0.9, top_p=0.9)):
        cache = random_llama.make_cache(32, 4)
        sched = Scheduler(cache.allocator, 64, 8)
        sched.add(Request(0, [1, 2, 3], SamplingParams(temperature=0.9, max_new_tokens=4)))
        sched.add(Request(1, [7, 7], filtering.replace(max_new_tokens=4)))
        assert not build_batch(sched.schedule(), cache).unfiltered  # one filtering row: the sorted path


def test_generate_gives_the_same_tokens_with_and_without_the_sort(random_llama):
    """top_k equal to the vocabulary filters nothing but takes the sorted path: same tokens."""
    work = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12, [3, 1]]
    kw = dict(max_new_tokens=12, temperature=0.9, seed=5, max_batch_size=4, max_batch_tokens=16)
    for mode in ("sync", "async"):
        assert (minibatch.generate(random_llama, work, mode=mode, **kw)
                == minibatch.generate(random_llama, work, mode=mode, top_k=random_llama.vocab_size, **kw))


def test_seeds_equal_modulo_2_32_give_different_noise():
    big = [5, 5 + 2**32, 5 + 2**40, 2**63 - 1, 2**63 - 1 - 2**32, 2**32 - 1, 2**32, 0]
    u = uniform_noise(torch.tensor(big), torch.zeros(len(big), dtype=torch.long), 64)
    assert len({tuple(row.tolist()) for row in u}) == len(big)


def test_seeds_below_2_32_keep_their_stream():
    # the stream of a seed < 2**32, as the hash of the low 32 bits alone gives it (stored outputs stay valid)
    from minibatch.core.sampling import _M32, _mix32
    seed, counter = torch.tensor([0, 5, 2**32 - 1]), torch.tensor([0, 3, 9])
    key = _mix32(_mix32(seed & _M32) ^ ((counter * 0x2545F491) & _M32))
    v = torch.arange(32)
    h = _mix32(key[:, None] ^ ((v[None, :] * 0x27D4EB2D) & _M32))
    assert torch.equal(uniform_noise(seed, counter, 32), ((h >> 9).to(torch.float32) + 0.5) / float(1 << 23))


def test_no_two_seeds_in_a_sample_of_the_range_share_a_stream():
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(0, 2**62, (3000,), generator=g) * 2 + torch.randint(0, 2, (3000,), generator=g),
                       torch.arange(2**32 - 8, 2**32 + 8), torch.arange(2000)]).unique()
    u = uniform_noise(seeds, torch.zeros(len(seeds), dtype=torch.long), 4)
    assert len({tuple(row.tolist()) for row in u}) == len(seeds)


def test_request_seeds_across_2_32_sample_differently(random_llama):
    # request i samples with seed + i: with seed 2**32 - 1, request 1 must not repeat seed 0's request 0
    prompt = [1, 2, 3]
    kw = dict(max_new_tokens=8, temperature=1.0)
    wrap = minibatch.generate(random_llama, [prompt, prompt], seed=2**32 - 1, **kw)
    zero = minibatch.generate(random_llama, [prompt], seed=0, **kw)
    assert wrap[1] != zero[0]
    assert minibatch.generate(random_llama, [prompt], seed=5, **kw) != minibatch.generate(
        random_llama, [prompt], seed=5 + 2**32, **kw)
