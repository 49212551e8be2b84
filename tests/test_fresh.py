"""The decode step's query, key and value straight from their projections (model/fresh.py).

On the CPU (CI): the operator's torch path, inside a model's forward, against the layers' own forward
(bit for bit: logits and the cache). With Triton (a GPU, or its interpreter: TRITON_INTERPRET=1 set
before pytest starts, as tests/test_paged_kernel.py says): the kernel against that torch path.
"""

import os
import re

import pytest
import torch

import minibatch
from decode_tables import LaunchSpy, decode_batch
from minibatch.core.batch import build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler
from minibatch.model import fresh, triton_decode

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("name", ["random-qwen3", "random-llama", "random-mistral", "random-qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fresh_path_gives_the_layers_own_logits_and_cache(name, dtype, monkeypatch):
    """A decode step's logits and the cache it leaves, with and without fresh.ENABLED: the same bits."""
    model = minibatch.load_model(name, device="cpu", dtype=dtype)
    assert fresh.install(model.hf) == model.num_layers and fresh.install(model.hf) == 0  # (once)
    shape = ([5, 11, 3], model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    (cache, batch), (twin, _) = decode_batch(*shape), decode_batch(*shape)  # (the same random cache twice)
    own = model.logits(batch, cache)
    calls = []
    monkeypatch.setattr(fresh, "ENABLED", True)
    monkeypatch.setattr(fresh, "reference", lambda *a: calls.append(a) or reference(*a))
    got = model.logits(batch, twin)
    assert len(calls) == model.num_layers  # (the fresh path ran, in every layer)
    assert torch.equal(got, own)
    for a, b in zip((*twin.keys, *twin.values), (*cache.keys, *cache.values)):
        assert torch.equal(a, b)


reference = fresh.reference


def test_a_model_with_the_fresh_forward_still_pickles():
    """install() leaves a model that pickle can copy (as a device process or torch.save needs), the copy's
    layers with the fresh forward bound to themselves."""
    import pickle

    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    fresh.install(model.hf)
    copy = pickle.loads(pickle.dumps(model.hf))
    layer = copy.model.layers[0].self_attn
    assert layer.forward.func is fresh._forward and layer.forward.args == (layer,)
    assert fresh.install(copy) == 0


@pytest.mark.parametrize("device, attention, dynamic_rows, hidden, takes", [
    ("cuda", "triton", False, 1024, True), ("cuda", "triton", False, 2048, True),
    ("cuda", "triton", False, 4096, False), ("cuda", "triton", True, 1024, False),
    ("cuda", "sdpa", False, 1024, False), ("cpu", "triton", False, 1024, False)])
def test_the_small_models_rule_picks_static_row_gpu_steps_of_small_models(device, attention, dynamic_rows,
                                                                          hidden, takes):
    assert fresh.in_compiled_step(device, attention, dynamic_rows, hidden) is takes


def test_a_compiled_step_the_rule_picks_turns_the_path_on_around_its_calls_only(monkeypatch):
    """The hook speed/compiled.py's CompiledStep calls: for a step the rule picks, the layers get the fresh
    forward and each call holds ENABLED on (while IN_SMALL_COMPILES is); elsewhere it does nothing."""
    import types

    from minibatch.speed import compiled

    assert fresh._compiled_step_hook in compiled.AROUND
    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    assert compiled.CompiledStep(model)._around == []  # (a CPU step: the layers keep their own forward)
    assert fresh.install(model.hf) == model.num_layers
    other = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    as_on_a_gpu = types.SimpleNamespace(model=types.SimpleNamespace(device=torch.device("cuda"), hf=other.hf),
                                        attention="triton", dynamic_rows=False)
    around = fresh._compiled_step_hook(as_on_a_gpu)
    assert fresh.install(other.hf) == 0  # (the hook gave the layers the forward)
    assert not fresh.ENABLED
    with around():
        assert fresh.ENABLED
    assert not fresh.ENABLED
    monkeypatch.setattr(fresh, "IN_SMALL_COMPILES", False)
    with around():
        assert not fresh.ENABLED
    assert fresh._compiled_step_hook(types.SimpleNamespace(**{**vars(as_on_a_gpu), "dynamic_rows": True})) is None


def test_prefill_steps_and_the_switch_off_take_the_layers_own_forward(monkeypatch):
    """A flat step (prompts) never takes the fresh path, nor a decode step while ENABLED is off."""
    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    fresh.install(model.hf)
    calls = []
    monkeypatch.setattr(fresh, "reference", lambda *a: calls.append(a) or reference(*a))
    cache, batch = decode_batch([5, 11, 3], model.num_layers, model.num_kv_heads, model.head_dim, torch.float32)
    model.logits(batch, cache)
    assert batch.decode_rows and not calls
    monkeypatch.setattr(fresh, "ENABLED", True)
    sched = Scheduler(cache.allocator, 512, 8)
    sched.add(Request(9, [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=2)))
    flat = build_batch(sched.schedule(), cache, 8, True, ROW_BUCKETS)
    model.logits(flat, cache)
    assert not flat.decode_rows and not calls


def test_a_run_with_the_fresh_path_gives_the_same_tokens(monkeypatch):
    """Through the engine, decode steps in the decode layout (as on a GPU), every layer on the fresh path:
    the tokens of the layers' own forward (bf16, greedy)."""
    monkeypatch.setenv("MINIBATCH_CPU_DEVICE", "cpu-threads")  # (the cpu device process runs its own copy)
    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.bfloat16)
    model.decode_layout = True
    fresh.install(model.hf)
    prompts = [[(5 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate((5, 17, 9, 2))]
    params = SamplingParams(max_new_tokens=12)
    own = minibatch.generate(model, prompts, params)
    calls = []
    monkeypatch.setattr(fresh, "ENABLED", True)
    monkeypatch.setattr(fresh, "reference", lambda *a: calls.append(a) or reference(*a))
    assert minibatch.generate(model, prompts, params) == own
    assert len(calls) >= 11 * model.num_layers  # (every decode step, every layer)


def _raw(rows, heads, kv_heads, dim, dtype, device, positions):
    """A step's projections' outputs (random), RMSNorm weights, and the rotary cos/sin of `positions`."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(rows, n * dim, generator=g).to(device, dtype) for n in (heads, kv_heads, kv_heads))
    weights = [(1 + 0.1 * torch.randn(dim, generator=g)).to(device, dtype) for _ in range(2)]
    freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angle = positions.cpu().float()[:, None] * freq[None, :]
    angle = torch.cat((angle, angle), dim=-1)
    return q, k, v, weights, angle.cos().to(device, dtype), angle.sin().to(device, dtype)


@pytest.mark.parametrize("ctx_lens,window", [([5, 11, 3], None), ([150, 7, 260], None), ([150, 7, 260], 40)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("apart", [False, True])
def test_the_kernel_does_what_the_torch_path_does(ctx_lens, window, norm, dtype, apart, monkeypatch):
    """The decode kernel with FRESH (norm and rotary embedding of q and the new k, the cache write, the new
    key and value taken from registers) against the operator's torch path: the attention and every cache
    cell, with and without a split over the keys (the long rows), a window, q/k norms (Qwen3) or none;
    the new key folded in by the first split's program or (NEW_KEY_APART, where there is a split) by one
    of its own."""
    pytest.importorskip("triton")
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("the Triton kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 wrongly (its own decode kernel too; float16 stands in)")
    device = "cpu" if INTERPRET else "cuda"
    heads, kv_heads, dim = 4, 2, 16
    (cache, batch), (twin, _) = (decode_batch(ctx_lens, 1, kv_heads, dim, dtype, device) for _ in range(2))
    rows = batch.decode_rows
    q, k, v, (qw, kw), cos, sin = _raw(rows, heads, kv_heads, dim, dtype, device, batch.positions)
    weights = (qw, kw) if norm else (None, None)
    args = (q, k, v, *weights, 1e-6, cos, sin)
    keys = (batch.cell_mapping, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions, rows, window or 0,
            dim ** -0.5)
    want = fresh.paged_decode_fresh(*args, cache.keys[0], cache.values[0], *keys, False)
    monkeypatch.setattr(triton_decode, "NEW_KEY_APART", apart)
    combined = []  # the partials each combine launch adds up
    real_combine = triton_decode._combine_kernel
    monkeypatch.setattr(triton_decode, "_combine_kernel", LaunchSpy(real_combine, combined, lambda kw: kw["S"]))
    got = fresh.paged_decode_fresh(*args, twin.keys[0], twin.values[0], *keys, True)
    width = batch.kv_indices.shape[0] // rows
    splits = triton_decode.split_keys(width, triton_decode.num_splits(rows, kv_heads, width, torch.device(device)))[1]
    assert combined == ([splits + apart] if splits > 1 else [])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert got.shape == want.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, want, **tol)
    written = torch.zeros(cache.keys[0].shape[0], dtype=torch.bool)
    written[batch.cell_mapping.cpu()] = True
    for a, b in ((twin.keys[0], cache.keys[0]), (twin.values[0], cache.values[0])):
        assert torch.equal(a[~written.to(a.device)], b[~written.to(a.device)])  # (nothing else touched)
        torch.testing.assert_close(a[written.to(a.device)], b[written.to(a.device)], **tol)


def test_the_kernel_reads_cos_and_sin_in_any_layout():
    """cos and sin [1, R, D] laid out column by column (as Inductor may lay out the one copy every layer
    shares: fresh.py's flexible layout) give the kernel's attention and cache bit for bit as rows do."""
    pytest.importorskip("triton")
    if not (INTERPRET or torch.cuda.is_available()):
        pytest.skip("the Triton kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
    device, dtype, heads, kv_heads, dim = ("cpu" if INTERPRET else "cuda"), torch.float32, 4, 2, 16
    (cache, batch), (twin, _) = (decode_batch([150, 7, 260], 1, kv_heads, dim, dtype, device) for _ in range(2))
    rows = batch.decode_rows
    q, k, v, (qw, kw), cos, sin = _raw(rows, heads, kv_heads, dim, dtype, device, batch.positions)
    columns = [t.t().contiguous().t()[None] for t in (cos, sin)]  # [1, R, D], strides (.., 1, R)
    assert columns[0].stride()[1:] == (1, rows)
    keys = (batch.cell_mapping, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions, rows, 0, dim ** -0.5)
    want = fresh.paged_decode_fresh(q, k, v, qw, kw, 1e-6, cos, sin, cache.keys[0], cache.values[0], *keys, True)
    got = fresh.paged_decode_fresh(q, k, v, qw, kw, 1e-6, *columns, twin.keys[0], twin.values[0], *keys, True)
    assert torch.equal(got, want)
    assert torch.equal(twin.keys[0], cache.keys[0]) and torch.equal(twin.values[0], cache.values[0])


def test_a_torch_without_the_layout_rules_parts_gets_a_warning_not_an_error(monkeypatch):
    """fresh._lowering uses Inductor's lowering module (not a public API): where it lacks a part, a warning
    names it and the operator keeps Inductor's default layout."""
    import torch._inductor.lowering as lowering

    assert fresh._lowering() is True  # (this process's cached call, made first with the real module)
    monkeypatch.delattr(lowering, "make_fallback")
    with pytest.warns(UserWarning, match="layout rule"):
        assert fresh._lowering.__wrapped__() is False


def test_fewer_programs_per_sm_split_the_keys_less(monkeypatch):
    """triton_decode.num_splits (plain arithmetic: no Triton needed) at 4 rows x 8 key/value heads x 512 keys:
    4 splits for the shipped 2 programs per SM (9 wanted, but none shorter than 128 keys from 4 rows on), 8
    (one 64-key chunk each) under the old rule, fewer for fractions, none at 0.125 (PROGRAMS_PER_SM stands in for
    a missing per_sm); 1 to 3 rows keep 64-key splits."""
    from minibatch.model import triton_decode

    cpu = torch.device("cpu")  # (counts 132 SMs, an H200's, when there is no GPU to ask)
    assert triton_decode.num_splits(4, 8, 512, cpu) == 4
    assert triton_decode.num_splits(8, 8, 512, cpu) == 4  # (5 wanted)
    assert triton_decode.num_splits(1, 8, 512, cpu) == 8
    assert triton_decode.num_splits(2, 8, 512, cpu) == 8  # (17 wanted)
    assert [triton_decode.num_splits(4, 8, 512, cpu, per_sm) for per_sm in (1, 0.5, 0.25, 0.125)] == [4, 3, 2, 1]
    assert triton_decode.num_splits(1, 8, 512, cpu, 0.125) == 2
    monkeypatch.setattr(triton_decode, "MIN_SPLIT_KEYS", 64)
    assert triton_decode.num_splits(4, 8, 512, cpu) == 8
    assert triton_decode.num_splits(4, 8, 512, cpu, 1) == 5
    monkeypatch.setattr(triton_decode, "MIN_SPLIT_KEYS", 128)
    monkeypatch.setattr(triton_decode, "MIN_SPLIT_ROWS", 1)
    assert triton_decode.num_splits(1, 8, 512, cpu) == 4


@pytest.mark.parametrize("one_rotary", [True, False])
def test_a_compiled_forward_calls_the_operator_on_the_cache_itself(one_rotary, monkeypatch):
    """Under torch.compile (Inductor, on the CPU here) the operator writes the cache in place: its outputs
    and the cache it leaves are the eager fresh path's (up to the compiled norms' rounding), and the
    generated code copies no cache (a copy per layer would be the whole cache's bytes, every step); every
    layer's call reads one cos and one sin (fresh.ONE_ROTARY; off, a copy of each per layer)."""
    from torch._inductor.utils import run_and_get_code

    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    fresh.install(model.hf)
    monkeypatch.setattr(fresh, "ENABLED", True)
    monkeypatch.setattr(fresh, "ONE_ROTARY", one_rotary)
    shape = ([5, 11, 3], model.num_layers, model.num_kv_heads, model.head_dim, torch.float32)
    (cache, batch), (twin, _) = decode_batch(*shape), decode_batch(*shape)
    with torch.inference_mode():
        eager = model._forward(batch, cache)
        # (no cached graph: a compile from before a change to the operator's tags would hide it)
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
                enable_autograd_cache=False):
            got, code = run_and_get_code(torch.compile(model._forward, fullgraph=True), batch, twin)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip((*twin.keys, *twin.values), (*cache.keys, *cache.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    source = "\n".join(code)
    calls = [c.split(", ") for c in re.findall(r"paged_decode_fresh(?:_exact_strides)?\.default\(([^)]*)\)", source)]
    assert len(calls) == model.num_layers
    assert "clone" not in source
    # one cos and one sin for every layer's call (the operator's flexible layout), else a copy of each per layer
    assert len({tuple(c[6:8]) for c in calls}) == (1 if one_rotary else model.num_layers), [c[6:8] for c in calls]
