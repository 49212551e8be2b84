"""The race of notebook 04: one IO slot + an injected delay corrupts outputs every time; two slots never."""

import pytest
import torch

import minibatch


@pytest.fixture(scope="module")
def work():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 3, 9, 4)]


@pytest.mark.parametrize("stage", ["H2D", "compute"])
def test_one_slot_with_delay_corrupts_every_time(random_llama, work, stage):
    kw = dict(max_new_tokens=6, max_batch_tokens=32)
    ref = minibatch.generate(random_llama, work, mode="sync", **kw)
    for _ in range(3):
        bad = minibatch.generate(random_llama, work, mode="async", num_slots=1, allow_races=True,
                                 inject_delays={stage: 0.03}, **kw)
        assert bad != ref


def test_one_slot_keeps_the_racy_order_even_when_every_step_is_launch_bound(random_llama, work, loop_order):
    """On a GPU without CUDA graphs every step is launch-bound (StepRunner.launch_bound), and a two-slot
    async loop then updates with batch N before it launches N+1, which on a GPU also hides notebook 04's
    race. A one-slot loop keeps launching N+1 first, or the race it is there to show would vanish."""
    events = loop_order(launch_bound=lambda batch: True)
    kw = dict(max_new_tokens=6, max_batch_tokens=32)
    ref = minibatch.generate(random_llama, work, mode="sync", **kw)
    for slots in (1, 2):
        events.clear()
        out = minibatch.generate(random_llama, work, mode="async", num_slots=slots, allow_races=slots == 1, **kw)
        assert slots == 1 or out == ref  # (one slot may race even with no delay injected)
        for n in range(1, max(step for kind, step in events if kind == "launch") + 1):
            launched_first = events.index(("launch", n)) < events.index(("update", n - 1))
            assert launched_first == (slots == 1), (slots, n, events)


@pytest.mark.parametrize("stage", ["H2D", "compute", "D2H"])
def test_two_slots_with_the_same_delay_are_right(random_llama, work, stage):
    kw = dict(max_new_tokens=6, max_batch_tokens=32)
    ref = minibatch.generate(random_llama, work, mode="sync", **kw)
    for _ in range(3):
        assert minibatch.generate(random_llama, work, mode="async", inject_delays={stage: 0.03}, **kw) == ref


@pytest.mark.parametrize("attention", ["einsum", "sdpa"])
@pytest.mark.parametrize("decode_bucket", [8, 4])
def test_decode_layout_gives_the_same_tokens(random_llama, work, monkeypatch, attention, decode_bucket):
    kw = dict(max_new_tokens=8, max_batch_tokens=32, block_size=4)
    flat = minibatch.generate(random_llama, work, **kw)
    monkeypatch.setattr(random_llama, "decode_layout", True)
    monkeypatch.setattr(random_llama, "kv_bucket", 8)
    monkeypatch.setattr(random_llama, "decode_kv_bucket", decode_bucket)
    monkeypatch.setattr(random_llama, "decode_attention", attention)
    laid = minibatch.generate(random_llama, work, **kw)
    laid_async = minibatch.generate(random_llama, work, mode="async", **kw)
    assert laid == flat and laid_async == flat


def test_padded_rows_give_the_same_tokens(random_llama, work, monkeypatch):
    from minibatch.core.batch import build_batch
    from minibatch.core.buckets import ROW_BUCKETS
    from minibatch.core.graphs import StepRunner

    def padded(self, plan):  # the CUDA-graph layout (rows padded to a bucket), forced on the CPU
        return build_batch(plan, self.cache, 8, True, ROW_BUCKETS)

    kw = dict(max_new_tokens=8, max_batch_tokens=32, block_size=4)
    flat = minibatch.generate(random_llama, work, **kw)
    monkeypatch.setattr(StepRunner, "build", padded)
    monkeypatch.setattr(random_llama, "kv_bucket", 8)
    for mode in ("sync", "async"):
        assert minibatch.generate(random_llama, work, mode=mode, **kw) == flat


def test_compile_is_for_cuda_models(random_llama):
    with pytest.raises(ValueError, match="compile=True is for CUDA models"):
        minibatch.generate(random_llama, [[1]], compile=True)
    with pytest.raises(TypeError, match="compile must be True, False or \"dynamic\""):
        minibatch.generate(random_llama, [[1]], compile="yes")


def test_bad_slot_and_delay_arguments(random_llama):
    with pytest.raises(ValueError, match="num_slots"):
        minibatch.generate(random_llama, [[1]], num_slots=3)
    with pytest.raises(ValueError, match="inject_delays"):
        minibatch.generate(random_llama, [[1]], inject_delays={"GPU": 1.0})
