"""The engine: what it owns, how it steps, what it keeps; no host reads inside device work;
load_model leaves the caller's model as given."""

import warnings

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import masking_utils
from transformers.masking_utils import AttentionMaskInterface

import minibatch
from minibatch.model.attention import ATTN_NAME, PagedMeta
from minibatch.core.batch import build_batch
from minibatch.core.graphs import pad_flat
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.core.buckets import ROW_BUCKETS

WORK = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]
KW = dict(max_new_tokens=6, max_batch_tokens=8, max_batch_size=4, block_size=4)


class HostReads(TorchDispatchMode):
    """Counts every read of a tensor's value into Python (`.item()`, `bool(t)`, `int(t)`: one op,
    `_local_scalar_dense`) while active; on a GPU each one is a device-to-host sync."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def host_reads(fn, monkeypatch) -> tuple[int, int]:
    """(host reads of tensor values, masks transformers built) while fn runs."""
    masks = {"n": 0}
    real_mask, real_packed = AttentionMaskInterface._global_mapping[ATTN_NAME], masking_utils.find_packed_sequence_indices

    def counting_mask(*a, **k):
        masks["n"] += 1
        return real_mask(*a, **k)

    def counting_packed(*a, **k):
        masks["n"] += 1
        return real_packed(*a, **k)

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, ATTN_NAME, counting_mask)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting_packed)
    tolists = {"n": 0}  # Python-level reads that may not pass through the dispatcher
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        def counting(self, *a, _real=getattr(torch.Tensor, name), **k):
            tolists["n"] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    with HostReads() as reads:
        fn()
    monkeypatch.undo()
    return reads.n + tolists["n"], masks["n"]


def plans(model):
    """A mixed prefill + decode plan (flat layout) and a decode-only plan, with their cache."""
    cache = model.make_cache(32, 4)
    sched = Scheduler(cache.allocator, max_batch_tokens=6, max_batch_size=4)
    for i, p in enumerate([[5, 6], [7] * 9, [8, 9, 10]]):
        sched.add(Request(i, p, SamplingParams(temperature=0.7, seed=i, max_new_tokens=4)))
    seen = []
    while sched.has_work():
        seen.append(sched.schedule())
        sched.update(seen[-1], [3] * len(seen[-1].sampling_chunks))
    mixed = next(p for p in seen if any(c.num_tokens > 1 for c in p.chunks) and
                 any(c.num_tokens == 1 and c.start >= len(c.request.prompt) for c in p.chunks))
    decode = next(p for p in seen if len(p.chunks) > 1 and all(c.num_tokens == 1 and c.sample for c in p.chunks))
    return cache, mixed, decode


def test_device_work_reads_no_tensor_value_and_builds_no_mask(random_llama, monkeypatch):
    cache, mixed, decode = plans(random_llama)
    for batch in (build_batch(mixed, cache), build_batch(decode, cache, 8, True, ROW_BUCKETS, 8)):
        assert host_reads(lambda: random_llama.next_tokens(batch, cache), monkeypatch) == (0, 0)
    # the detector does see the reads transformers makes when it builds its own mask
    batch = build_batch(mixed, cache)
    with torch.inference_mode():
        seen = host_reads(lambda: random_llama.hf(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                                                  use_cache=False, minibatch=PagedMeta(cache, batch)), monkeypatch)
    assert seen[0] > 0 and seen[1] > 0


@pytest.mark.parametrize("name", ["random-llama", "random-mistral"])
def test_padding_a_flat_batch_changes_no_real_row(name):
    """Prefill and mixed steps on a GPU are padded to bucketed sizes (graphs.pad_flat) so that they can be
    CUDA graphs: padding tokens, keys and rows must leave every real row's logits as they were."""
    model = minibatch.load_model(name, device="cpu")
    cache, mixed, _ = plans(model)
    plain = build_batch(mixed, cache)
    padded = pad_flat(plain, cache.scratch_cell, (16,), (32,), 8, 16, 32)
    assert padded.padded and padded.num_tokens == 16 and padded.kv_indices.shape[0] == 32 and padded.num_sampled == 8
    r = plain.num_sampled
    assert padded.logits_indices[:r].tolist() == plain.logits_indices.tolist()
    assert (padded.q_seq[plain.num_tokens:] == -1).all() and (padded.kv_seq[plain.kv_indices.shape[0]:] == -1).all()
    want, got = model.logits(plain, cache), model.logits(padded, cache)
    assert torch.isfinite(got).all()  # padding tokens see at least one key: no NaN anywhere
    torch.testing.assert_close(got[:r], want, rtol=1e-5, atol=1e-5)
    assert model.next_tokens(padded, cache)[:r].tolist() == model.next_tokens(plain, cache).tolist()
    # sizes that do not fit the slot leave the batch as it was (that step runs eagerly)
    assert pad_flat(plain, cache.scratch_cell, (16,), (32,), 8, 8, 32) is plain
    assert pad_flat(plain, cache.scratch_cell, (4,), (32,), 8, 16, 32) is plain


def test_step_by_step_equals_generate(random_llama):
    ref = minibatch.generate(random_llama, WORK, mode="async", **KW)
    with minibatch.Engine(random_llama) as engine:
        requests = [Request(i, p, SamplingParams(max_new_tokens=KW["max_new_tokens"])) for i, p in enumerate(WORK)]
        engine.start(requests, "async", max_batch_tokens=8, max_batch_size=4, block_size=4)
        finished = []
        while engine.has_work():
            finished += engine.step()
        engine.finish()
    assert sorted(r.rid for r in finished) == [0, 1, 2, 3]
    assert [r.output for r in requests] == ref


def test_engine_keeps_the_least_recently_used_shapes(random_llama):
    with minibatch.Engine(random_llama, keep=2) as engine:
        outs = {}
        for budget in (8, 16, 8, 32):  # three shapes; 8 is used again before 32 comes
            outs.setdefault(budget, engine.generate(WORK, **{**KW, "max_batch_tokens": budget}))
            assert engine.generate(WORK, **{**KW, "max_batch_tokens": budget}) == outs[budget]
        kept = [s.max_tokens for s in engine.kept]
        assert kept == [8, 32]  # 16 was the least recently used
        cache8 = engine.kept[next(iter(engine.kept))].cache
        engine.generate(WORK, **KW)
        assert engine.kept[next(reversed(engine.kept))].cache is cache8  # reused, now most recent
    assert engine.dev is None and not engine.kept  # closed: device and resources gone


def test_a_new_shape_drops_kept_resources_that_leave_it_no_room(random_llama, monkeypatch):
    """The memory check counts an engine's kept caches as free (they are dropped when a new shape needs the
    room): so a new shape's resources must not be allocated beside kept ones that leave no room for them.
    A device with memory of its own that holds the new set and half the kept one: the kept set goes."""
    from minibatch.core import memory

    with minibatch.Engine(random_llama) as other:  # the async run's shape, and what a set of it needs
        other.generate(WORK, **{**KW, "mode": "async"})
        shape = next(iter(other.kept))
    b = memory.estimate_bytes(random_llama, shape.num_blocks, shape.max_tokens, shape.max_keys, shape.rows,
                              shape.block_size, shape.num_slots)
    with minibatch.Engine(random_llama) as engine:
        ref = engine.generate(WORK, **KW)
        room = (b["kv"] + b["io_dev"]) / memory.MEMORY_FRACTION + engine.kept_bytes / 2

        class Room(type(memory.platform(random_llama.device))):
            own_memory = True

            def free_bytes(self, device):
                return int(room) - engine.kept_bytes

        monkeypatch.setattr(memory, "platform", lambda device: Room())
        assert engine.generate(WORK, **{**KW, "mode": "async"}) == ref  # another shape: two IO slots
        assert list(engine.kept) == [shape]


def test_a_failed_run_drops_its_resources(random_llama, monkeypatch):
    with minibatch.Engine(random_llama) as engine:
        ref = engine.generate(WORK, **KW)
        shape = next(iter(engine.kept))

        def stop(plan, done):
            if plan.step == 2:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            engine.generate(WORK, on_step=stop, **KW)
        assert shape not in engine.kept and engine.run is None
        assert engine.generate(WORK, **KW) == ref


def test_generate_takes_an_engine_and_nothing_is_stashed_on_the_model(random_llama):
    before = set(vars(random_llama))
    with minibatch.Engine(random_llama) as engine:
        assert minibatch.generate(engine, WORK, **KW) == minibatch.generate(random_llama, WORK, **KW)
    assert set(vars(random_llama)) == before


@pytest.mark.parametrize("assign", [False, True])  # in place (same tensors), or new tensors
def test_weights_loaded_between_runs_are_the_ones_used(assign):
    """An engine kept across runs: weights loaded into the model after a run are used by the next one
    (the cpu device process had computed with the copy it forked; kept CUDA graphs would read the old
    tensors)."""
    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    other = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32, seed=1)
    work = [[5, 9, 2, 7], [3, 3, 1]]
    want = minibatch.generate(other, work, max_new_tokens=6)
    with minibatch.Engine(model) as engine:
        before = engine.generate(work, max_new_tokens=6)
        model.hf.load_state_dict(other.hf.state_dict(), assign=assign)
        assert engine.generate(work, max_new_tokens=6) == want != before
        assert engine.generate(work, max_new_tokens=6, mode="async") == want


def test_engine_needs_a_loaded_model():
    with pytest.raises(TypeError, match="load_model"):
        minibatch.Engine("tiny")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_model_keeps_a_given_models_dtype_and_device(dtype):
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changes, so nothing to warn about
        model = minibatch.load_model(hf)
    assert model.dtype == dtype and next(hf.parameters()).dtype == dtype
    assert model.device.type == "cpu" and model.hf is hf
    assert hf.config._attn_implementation == ATTN_NAME  # what it does change, as documented


def test_load_model_says_when_it_changes_a_given_model():
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2), dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"in place: dtype torch.float32 -> torch.bfloat16"):
        model = minibatch.load_model(hf, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 == next(hf.parameters()).dtype


def test_offline_runs_refuse_stop_strings(tiny):
    """Stop strings are matched in streamed text (a serving run's); an offline run would ignore them."""
    from minibatch.core.requests import Request, SamplingParams

    with pytest.raises(ValueError, match="stop strings"):
        minibatch.generate(tiny, ["The for statement"], max_new_tokens=8, stop="\n")
    with minibatch.Engine(tiny) as engine, pytest.raises(ValueError, match="stop strings"):
        engine.start([Request(0, [1, 2, 3], SamplingParams(max_new_tokens=4, stop=("x",)))])


def test_launch_bound_steps_are_the_eager_ones_and_the_graphs_still_to_capture(random_llama, monkeypatch):
    """StepRunner.launch_bound, which the async loop asks before each launch: only where the host launches
    the kernels itself (a GPU), for a step that runs eagerly or whose graph is not captured yet."""
    from types import SimpleNamespace

    from minibatch.core import graphs

    runner = graphs.StepRunner(random_llama, random_llama.make_cache(8, 4))
    decode, flat = (SimpleNamespace(decode_rows=r, padded=False, penalized=False) for r in (4, 0))
    assert not runner.launch_bound(decode, "key")  # the cpu device computes in workers of its own

    class HostLaunches(type(graphs.platform(random_llama.device))):
        host_launches = True

    monkeypatch.setattr(graphs, "platform", lambda device: HostLaunches())
    assert runner.launch_bound(decode, "key")  # eager: no graphs in this runner
    runner.use_graphs = True
    assert runner.launch_bound(decode, "key")  # a graph, still to capture
    runner.graphs["key"] = object()
    assert not runner.launch_bound(decode, "key")  # a replay: one launch
    assert runner.launch_bound(flat, "key")  # unpadded flat steps run eagerly, graphs or not
