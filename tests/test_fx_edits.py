"""speed/fx_edits.py: the graph edits the compiled step's passes share, on small graphs traced by torch.fx."""

import torch
import torch.nn.functional as F

from decode_tables import after_pass
from minibatch.speed import fx_edits


class _Two(torch.nn.Module):
    def forward(self, x, w, b):
        return F.linear(x, w) + F.linear(x, w, b)


def _traced():
    gm = torch.fx.symbolic_trace(_Two())
    x, w, b = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5)
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), (x, w, b)):
        node.meta["example_value"] = value
    return gm, (x, w, b)


def test_a_product_without_a_bias_is_found_and_one_with_a_bias_is_not():
    gm, inputs = _traced()
    real = fx_edits.placeholders(gm, inputs)
    assert [v is t for v, t in zip(real.values(), inputs)] == [True] * 3
    found = [fx_edits.bias_free_product(n, (F.linear,)) for n in gm.graph.nodes]
    hits = [f for f in found if f is not None]
    assert len(hits) == 1 and fx_edits.calls(hits[0][0], "x", kind="placeholder", users=2)
    x, w, value = hits[0]
    assert value is inputs[0] and fx_edits.weight_of(w, real) is inputs[1]
    assert fx_edits.rows_of(value) == 6
    assert fx_edits.weight_of(next(n for n in gm.graph.nodes if n.op == "output"), real) is None


def test_a_merged_weight_is_the_stacked_tensor_behind_it():
    """siblings.merge's weight, as_strided over the first sibling's weight from offset 0, stands for the
    stacked rows (pack): weight_of gives that view; calls counts readers only where asked."""
    stacked = torch.randn(8, 4)
    graph = torch.fx.Graph()
    first = graph.placeholder("w")
    merged = graph.call_function(torch.as_strided, (first, (8, 4), (4, 1), 0))
    graph.output((merged, merged))
    got = fx_edits.weight_of(merged, {first: stacked[:3]})
    assert torch.equal(got, stacked) and got.data_ptr() == stacked.data_ptr()
    assert fx_edits.calls(merged, torch.as_strided, users=None) and not fx_edits.calls(merged, torch.as_strided, users=2)


def doubled(x, w):
    return 2 * F.linear(x, w)


def test_replace_and_recompile_change_what_the_module_computes():
    gm, (x, w, b) = _traced()
    node = next(n for n in gm.graph.nodes if fx_edits.bias_free_product(n, (F.linear,)))
    new = fx_edits.replace(gm, node, doubled, node.args[:2])
    assert new.op == "call_function" and node not in gm.graph.nodes
    assert fx_edits.recompiled(gm, 0) == 0 and "doubled" not in gm.code  # (nothing changed: no new code)
    assert fx_edits.recompiled(gm, 1) == 1 and "doubled" in gm.code
    y = torch.randn(7, 4)
    torch.testing.assert_close(gm(y, w, b), 2 * F.linear(y, w) + F.linear(y, w, b))


def _rotary_angles(inv_freq, positions):
    """transformers' rotary angles before 5.24: [1, D/2, 1] @ [1, 1, R] in float32, then [1, R, D/2]."""
    return (inv_freq[None, :, None] @ positions[:, None, :]).transpose(1, 2)


def test_a_product_over_one_term_becomes_a_multiply_with_the_same_bits():
    """outer_products: the rotary angles' [.., M, 1] @ [.., 1, N] (operator @, torch.matmul, torch.bmm) becomes
    a broadcast multiply, bit for bit; products over more than one term, and integer ones, stay."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    positions = torch.tensor([[5.0, 511.0, 77.0, 4095.0]])
    for fn in (_rotary_angles, lambda f, p: torch.matmul(f[None, :, None], p[:, None, :]),
               lambda f, p: torch.bmm(f[None, :, None], p[:, None, :])):
        changed, gm, out = after_pass(fx_edits.outer_products, fn, inv_freq, positions)
        assert changed == 1 and "matmul" not in gm.code and "bmm" not in gm.code
        assert torch.equal(out, fn(inv_freq, positions))
    a, b = torch.randn(3, 4, 2), torch.randn(3, 2, 5)
    changed, gm, out = after_pass(fx_edits.outer_products, lambda x, y: x @ y, a, b)
    assert changed == 0 and torch.equal(out, a @ b)
    ints = torch.arange(4)[None, :, None], torch.arange(3)[None, None, :]
    assert after_pass(fx_edits.outer_products, lambda x, y: x @ y, *ints)[0] == 0


def test_float32_products_over_one_term_stay_where_tf32_is_allowed():
    """With TF32 allowed a float32 product rounds its inputs to TF32 first, so a multiply would not give its
    bits: outer_products leaves float32 products alone then (bf16 ones still become multiplies)."""
    f, p = torch.rand(64), torch.tensor([[5.0, 511.0]])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert after_pass(fx_edits.outer_products, _rotary_angles, f, p)[0] == 0
        assert after_pass(fx_edits.outer_products, _rotary_angles, f.bfloat16(), p.bfloat16())[0] == 1
    finally:
        torch.set_float32_matmul_precision(before)
    assert after_pass(fx_edits.outer_products, _rotary_angles, f, p)[0] == 1
