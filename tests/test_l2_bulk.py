"""Weights asked into L2 in bulk by the decode attention (speed/l2_bulk.py): which ranges, and that the ask
changes nothing the step computes.

On the CPU (CI): the ranges a launch would ask for, and a compiled forward that hands the weights to fresh.py's
operator. On a GPU: the kernel with and without the asks, bit for bit.
"""

import pytest
import torch

import minibatch
from decode_tables import decode_batch
from minibatch.model import fresh, triton_decode
from minibatch.speed import l2_bulk, siblings


def test_ranges_join_tensors_that_sit_end_to_end():
    block = torch.zeros(12, 8, dtype=torch.bfloat16)  # rows of 16 bytes
    gate, up, other = block[0:4], block[4:8], torch.zeros(2, 8, dtype=torch.bfloat16)
    assert [(t.data_ptr(), n) for t, n in l2_bulk.ranges([gate, up, other])] == [
        (gate.data_ptr(), 128), (other.data_ptr(), 32)]
    assert [(t.data_ptr(), n) for t, n in l2_bulk.ranges([up, gate])] == [(up.data_ptr(), 64), (gate.data_ptr(), 64)]


def test_ranges_leave_out_what_a_bulk_request_cannot_take(monkeypatch):
    block = torch.zeros(64, dtype=torch.bfloat16)
    odd = block[1:9]  # 2 bytes past an aligned start
    short = block[0:3]  # 6 bytes
    strided = torch.zeros(8, 8, dtype=torch.bfloat16)[:, :4]
    assert l2_bulk.ranges([odd, short, strided, block[:0]]) == []
    monkeypatch.setattr(l2_bulk, "MAX", 2)
    apart = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(3)]
    assert len(l2_bulk.ranges(apart)) == 2


def test_each_attention_gets_the_weights_read_after_it(monkeypatch):
    """After siblings.pack a layer's asks are 3 ranges (o, gate + up, down), with the next layer's q, k and v
    a 4th, except at the last layer; none while ENABLED is off."""
    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    assert l2_bulk.attach(model.hf) == model.num_layers
    layers = model.hf.model.layers
    first, last = layers[0].self_attn, layers[-1].self_attn
    assert l2_bulk.chosen(first) == []
    monkeypatch.setattr(l2_bulk, "ENABLED", True)
    mlp = layers[0].mlp
    got = l2_bulk.ranges(l2_bulk.chosen(first))
    assert [(t.data_ptr(), n) for t, n in got] == [
        (first.o_proj.weight.data_ptr(), first.o_proj.weight.nbytes),
        (mlp.gate_proj.weight.data_ptr(), mlp.gate_proj.weight.nbytes + mlp.up_proj.weight.nbytes),
        (mlp.down_proj.weight.data_ptr(), mlp.down_proj.weight.nbytes)]
    monkeypatch.setattr(l2_bulk, "REACH", "next")
    nxt = layers[1].self_attn
    got = l2_bulk.ranges(l2_bulk.chosen(first))
    assert len(got) == 4 and got[3][0].data_ptr() == nxt.q_proj.weight.data_ptr()
    assert got[3][1] == sum(w.nbytes for w in (nxt.q_proj.weight, nxt.k_proj.weight, nxt.v_proj.weight))
    assert len(l2_bulk.ranges(l2_bulk.chosen(last))) == 3


def test_a_compiled_forward_hands_the_weights_to_the_operator(monkeypatch):
    """Under torch.compile (Inductor on the CPU) with ENABLED the operator receives each layer's weights and
    the forward computes what it computes without them."""
    from torch._inductor.utils import run_and_get_code

    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    fresh.install(model.hf)
    monkeypatch.setattr(fresh, "ENABLED", True)
    shape = ([5, 11, 3], model.num_layers, model.num_kv_heads, model.head_dim, torch.float32)
    (cache, batch), (twin, _) = decode_batch(*shape), decode_batch(*shape)
    with torch.inference_mode():
        eager = model._forward(batch, cache)
        monkeypatch.setattr(l2_bulk, "ENABLED", True)
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(model._forward, fullgraph=True), batch, twin)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    source = "\n".join(code)
    calls = [line for line in source.splitlines() if "paged_decode_fresh.default(" in line]
    assert len(calls) == model.num_layers
    # the last argument: the layer's four weights (o, gate, up, down), passed as they are
    assert all(line.rstrip().endswith("])") and len(line.rsplit("[", 1)[1].split(",")) == 4 for line in calls), calls


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="bulk prefetch needs a GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("rows", [1, 4])
def test_the_kernel_asking_for_weights_gives_the_same_bits(rows, monkeypatch):
    """fresh.py's kernel with four ranges of weights asked into L2 (AHEAD=4): the same attention and cache,
    bit for bit, as without."""
    heads, kv_heads, dim, dtype = 16, 8, 128, torch.bfloat16
    ctx = [37 + 50 * i for i in range(rows)]
    (cache, batch), (twin, _) = (decode_batch(ctx, 1, kv_heads, dim, dtype, "cuda") for _ in range(2))
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(rows, n * dim, device="cuda", dtype=dtype, generator=g) for n in (heads, kv_heads, kv_heads))
    cos = torch.randn(rows, dim, device="cuda", dtype=dtype, generator=g)
    sin = torch.randn(rows, dim, device="cuda", dtype=dtype, generator=g)
    qw, kw = (torch.rand(dim, device="cuda", dtype=dtype, generator=g) + 0.5 for _ in range(2))
    sizes = [n * 1024 for n in (1024, 6144, 1024, 4096)]
    block = torch.randn(sum(sizes) + 64 * len(sizes), device="cuda", dtype=dtype, generator=g)
    starts = [sum(sizes[:i]) + 64 * i for i in range(len(sizes))]  # (apart in memory: four ranges, not one)
    weights = [block[a: a + n].view(-1, 1024) for a, n in zip(starts, sizes)]
    args = (q, k, v, qw, kw, 1e-6, cos, sin)
    keys = (batch.cell_mapping, batch.kv_indices, batch.kv_seq, batch.kv_pos, batch.positions, rows, 0, dim ** -0.5)
    seen = []
    kernel = triton_decode._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*a, **kw):
                seen.append(kw["AHEAD"])
                return kernel[grid](*a, **kw)
            return run

    monkeypatch.setattr(triton_decode, "_decode_kernel", Spy())
    want = fresh.paged_decode_fresh(*args, cache.keys[0], cache.values[0], *keys, True, [])
    got = fresh.paged_decode_fresh(*args, twin.keys[0], twin.values[0], *keys, True, weights)
    torch.cuda.synchronize()
    assert seen == [0, 4]
    assert torch.equal(got, want)
    assert torch.equal(twin.keys[0], cache.keys[0]) and torch.equal(twin.values[0], cache.values[0])
