"""silu(gate) * up inside skinny.py's gate/up product (speed/gated.py).

On the CPU (CI): the graph pass on a compiled decode step (the operator then runs PyTorch ops) against
the eager step, and the operator's PyTorch path. With Triton (a GPU, or its interpreter: TRITON_INTERPRET=1
set before pytest starts): the kernel's gated epilogue against PyTorch's ops.
"""

import os

import pytest
import torch

import minibatch
from decode_tables import compiled_and_eager, routed_step
from minibatch.speed import gated, siblings, skinny

KERNEL = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("name", ["random-qwen3", "random-llama"])
def test_the_pass_fuses_every_gated_mlp_and_keeps_the_logits(name, monkeypatch):
    """Every layer's merged gate/up product read as silu(gate) * up becomes one skinny_gated call where the
    kernel's rule takes its rows (here 3: MANY_ROWS, the default), and no silu is left; the logits are the eager
    step's (float32, to rounding)."""
    monkeypatch.setattr(gated, "MANY_ROWS", True)
    model, seen, got, want = routed_step(name, gated.fuse)[:4]
    for (fused,), targets in seen:
        assert targets.count(torch.ops.minibatch.skinny_gated.default) == fused
        assert torch.nn.functional.silu not in targets
    assert [counts for counts, _ in seen] == [[model.num_layers]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_pass_leaves_rows_the_kernel_would_not_take(monkeypatch):
    """Without MANY_ROWS a step of 3 rows keeps its product and Inductor's activation: the operator would
    only run PyTorch's ops there, one kernel more than Inductor's fused activation."""
    monkeypatch.setattr(gated, "MANY_ROWS", False)
    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    fused = []

    def fuse(gm, example_inputs):
        fused.append(gated.fuse(gm, example_inputs))
        assert torch.nn.functional.silu in [n.target for n in gm.graph.nodes]

    compiled_and_eager(model, fuse)
    assert fused == [0]


def test_the_pass_leaves_a_product_read_otherwise():
    """A product whose slices are read other than silu(first) * second (here: also added) stays as it is."""
    w = torch.randn(8, 4)

    def f(x):
        both = torch.nn.functional.linear(x, w)
        g, u = torch.narrow(both, -1, 0, 4), torch.narrow(both, -1, 4, 4)
        return torch.nn.functional.silu(g) * u + both.sum()

    gm = torch.fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = torch.randn(2, 4)
    assert gated.fuse(gm, [torch.randn(2, 4)]) == 0


def test_the_operator_without_the_kernel_is_pytorchs_ops():
    """Where the kernel does not run (here: a CPU tensor), the operator is F.linear, silu and a product, bit
    for bit, whichever rows of the weight are the gate's and the up projection's."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    both = torch.nn.functional.linear(x, w)
    y = gated.skinny_gated(x, w, 4, 20, 16)
    assert torch.equal(y, torch.nn.functional.silu(both[:, 4:20]) * both[:, 20:36])


def test_the_settings_cover_the_timed_shape_only(monkeypatch):
    """1-8 rows of the 0.6B shape's gate/up (3072 outputs by 1024 inputs), one row only without MANY_ROWS;
    more rows, or the 1B and 8B shapes' wider products, stay on cuBLAS."""
    assert gated.MANY_ROWS  # (the default)
    monkeypatch.setattr(gated, "MANY_ROWS", False)
    assert gated.settings(1, 3072, 1024) and not any(gated.settings(r, 3072, 1024) for r in (0, 2, 4, 8))
    monkeypatch.setattr(gated, "MANY_ROWS", True)
    assert gated.settings(0, 3072, 1024) is None and gated.settings(gated.MOST_ROWS + 1, 3072, 1024) is None
    assert all(gated.settings(r, 3072, 1024) for r in range(1, gated.MOST_ROWS + 1))
    assert gated.settings(1, 8192, 2048) is None and gated.settings(4, 14336, 4096) is None
    assert gated.settings(1, 1536, 576)["block_k"] == 1024  # (K not a power of 2: a whole piece, masked)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", [
    dict(block_n=4, block_k=64, warps=4, stages=3),
    dict(block_n=4, block_k=64, warps=4, stages=3, defer=True),
    dict(block_n=16, block_k=32, warps=4, stages=2, dot=True),
], ids=["plain", "defer", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter's dot has no bfloat16)
def test_the_kernel_gates_as_pytorchs_ops_do(rows, setting, dtype):
    """launch with `up` against silu(x @ gate.T) * (x @ up.T), the gate's and the up projection's rows apart
    by more than the output's width, K not a multiple of the piece, N not of the columns per program."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g).to(DEVICE, dtype)
    w = (torch.randn(130, 200, generator=g) / 10).to(DEVICE, dtype)
    y = torch.empty(rows, 50, device=DEVICE, dtype=dtype)
    skinny.launch(x, w[3:], y, setting, up=70)
    want = torch.nn.functional.silu(x.float() @ w[3:53].float().T) * (x.float() @ w[73:123].float().T)
    tol = 2e-2 if dtype == torch.float16 else 1e-4  # (float32 tensor-core tiles in full precision, not TF32)
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
def test_the_one_row_setting_takes_a_k_that_is_not_a_power_of_two():
    """settings(1, ...) reads K in one masked piece of the next power of 2 (SmolLM2-360M's 960 inputs)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 960, generator=g).to(DEVICE), (torch.randn(80, 960, generator=g) / 10).to(DEVICE)
    y = torch.empty(1, 40, device=DEVICE)
    skinny.launch(x, w, y, gated.settings(1, 40, 960), up=40)
    want = torch.nn.functional.silu(x @ w[:40].T) * (x @ w[40:].T)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
def test_a_gated_launch_refuses_overlapping_rows_and_splits():
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(40, 64, device=DEVICE)
    y = torch.empty(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="gated product"):
        skinny.launch(x, w, y, dict(block_n=4, block_k=32, warps=4, stages=1), up=8)
    with pytest.raises(ValueError, match="without a split"):
        skinny.launch(x, w, y, dict(block_n=4, block_k=16, warps=4, stages=1, split=2), up=16)
