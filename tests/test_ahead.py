"""speed/ahead.py: which weights our kernels ask into L2 ahead of the cuBLAS products that read them.

The plan (a graph pass) and the choice at launch run everywhere; the prefetches themselves only on a GPU
(inline assembly, which Triton's interpreter lacks): tests/test_gpu.py checks a compiled step with them.
"""

import torch

from minibatch.model import triton_decode  # noqa: F401 (registers minibatch::paged_decode)
from minibatch.speed import ahead, skinny

OPS = torch.ops.minibatch


def _layer_pair(x, w_o, w_gu, w_d, w_qkv, kc, vc, kvi, kvs, kvp, pos):
    """Two decode attentions with the products between them, as a decode step orders them."""
    a = OPS.paged_decode(x, kc, vc, kvi, kvs, kvp, pos, 1, 0, 1.0, 0)
    h = OPS.skinny_linear(a, w_o)  # (ours)
    h = torch.nn.functional.linear(h, w_gu)  # (cuBLAS)
    h = OPS.skinny_linear(h, w_d)
    h = torch.nn.functional.linear(h, w_qkv)
    b = OPS.paged_decode(h, kc, vc, kvi, kvs, kvp, pos, 1, 0, 1.0, 0)
    return torch.nn.functional.linear(b, w_o)


def _inputs():
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 8), (8, 8), (48, 8), (8, 24), (16, 8), (4, 1, 8), (4, 1, 8), (4,), (4,), (4,), (1,)]
    return [torch.randn(s, generator=g) for s in shapes]


def test_plan_covers_the_products_up_to_the_next_attention():
    """Each of our calls gets the weights after it, in graph order, up to the next decode attention: the
    first attention all four between the two; the output product the rest; the second attention the last
    product. The products on cuBLAS plan nothing."""
    ahead.clear()
    gm = torch.fx.symbolic_trace(_layer_pair)
    x, w_o, w_gu, w_d, w_qkv, kc = (inputs := _inputs())[:6]
    assert ahead.plan(gm, skinny._placeholders(gm, inputs), skinny._weight) == 4  # two attentions (keyed by their key cache, the same here) and two products
    plans = ahead._PLAN
    assert [w.data_ptr() for w in plans[w_o.data_ptr()]] == [w.data_ptr() for w in (w_gu, w_d, w_qkv)]
    assert [w.data_ptr() for w in plans[w_d.data_ptr()]] == [w_qkv.data_ptr()]
    assert [w.data_ptr() for w in plans[kc.data_ptr()]] == [w_o.data_ptr()]  # (the second attention's, last)
    assert w_gu.data_ptr() not in plans and w_qkv.data_ptr() not in plans
    ahead.clear()


def test_choose_stops_at_the_first_product_the_skinny_kernel_takes():
    """At 1 row the 0.6B shapes' output product (1024 columns) is skinny.py's: an attention before it asks
    for nothing; at 8 rows every product is cuBLAS's, and the list stops where BYTES or MAX would be passed."""
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    o, gate_up, down, qkv = (torch.empty(n, k, **bf16) for n, k in ((1024, 2048), (6144, 1024), (1024, 3072),
                                                                      (4096, 1024)))
    assert skinny.settings(1, 1024, 2048) is not None and skinny.settings(8, 1024, 2048) is None
    assert ahead.choose([o, gate_up, down, qkv], 1, skinny.settings) == []
    assert ahead.choose([gate_up, down, qkv], 1, skinny.settings) == [gate_up]  # (the output product's plan at 1 row)
    assert ahead.choose([o, gate_up, down, qkv], 8, skinny.settings) == [o, gate_up, down, qkv]  # 4 + 12 + 6 + 8 MB
    assert ahead.choose([gate_up] * 3, 8, skinny.settings) == [gate_up] * 2  # (a third would pass 32 MB)
    assert ahead.choose([o] * 6, 8, skinny.settings) == [o] * ahead.MAX


def test_launch_args_fill_the_unused_places():
    w = torch.empty(1024, 2048, dtype=torch.bfloat16, device="meta")
    args, constants = ahead.launch_args([w, w], w)
    assert args[:4] == [w] * 4 and args[4:] == [1024 * 2048 * 2 // 128] * 2 + [0, 0]
    assert constants == dict(AHEAD_START=0, AHEAD_END=2, AHEAD_STEP=64)
    assert ahead.launch_args([], w)[1]["AHEAD_END"] == 0


def test_nothing_is_asked_for_off_cuda_or_when_off(monkeypatch):
    x = torch.randn(4, 4)
    ahead._PLAN[x.data_ptr()] = [torch.randn(4, 4)]
    monkeypatch.setattr(ahead, "ENABLED", True)
    assert ahead.targets(x, 1, skinny.settings) == []  # (a CPU tensor)
    monkeypatch.setattr(ahead, "usable", lambda t: True)
    assert len(ahead.targets(x, 1, lambda *shape: None)) == 1
    monkeypatch.setattr(ahead, "FROM_ATTENTION", True)  # only the attention asks, and for everything
    assert ahead.targets(x, 1, lambda *shape: None) == []
    assert len(ahead.targets(x, 1, lambda *shape: {}, attention=True)) == 1
    ahead.clear()
