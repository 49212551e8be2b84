"""The residual add and RMSNorm inside skinny.py's kernel (speed/prenorm.py).

On the CPU (CI): the graph pass on a compiled decode step (the operator then runs PyTorch ops) against
the eager step. With Triton (a GPU, or its interpreter: TRITON_INTERPRET=1 set before pytest starts):
the kernel's prologue against those PyTorch ops.
"""

import os

import pytest
import torch

from decode_tables import routed_step
from minibatch.speed import gated, prenorm, skinny

KERNEL = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("name", ["random-qwen3", "random-llama"])
def test_the_pass_fuses_every_norm_of_a_sum_and_keeps_the_logits(name):
    """Every RMSNorm of a residual sum that feeds a routed product (all but the first layer's input norm,
    whose input is the embedding) becomes one skinny_norm_linear call; the logits and the cache the step
    leaves are the eager step's (float32, to rounding)."""
    model, seen, got, want, twin, cache = routed_step(name, prenorm.fuse)
    for (fused,), targets in seen:
        assert targets.count(torch.ops.minibatch.skinny_norm_linear.default) == fused
        assert torch.rsqrt in targets  # (the first layer's input norm stays)
    assert [counts for counts, _ in seen] == [[2 * model.num_layers - 1]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip((*twin.keys, *twin.values), (*cache.keys, *cache.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_after_gated_fuse_the_norm_goes_inside_the_gated_products_too():
    """After gated.fuse (as siblings.py's backend runs the passes), each layer's norm before its gate/up goes
    into the skinny_gated call, which becomes skinny_norm_gated, and each norm before a routed q/k/v into a
    skinny_norm_linear call (all but the first layer's, whose input is the embedding); no silu is left; the
    logits and the cache are the eager step's (float32, to rounding)."""
    model, seen, got, want, twin, cache = routed_step("random-qwen3", gated.fuse, prenorm.fuse)
    counts = [(targets.count(torch.ops.minibatch.skinny_norm_gated.default),
               targets.count(torch.ops.minibatch.skinny_norm_linear.default),
               targets.count(torch.ops.minibatch.skinny_gated.default)) for _, targets in seen]
    assert all(torch.nn.functional.silu not in targets for _, targets in seen)
    assert counts == [(model.num_layers, model.num_layers - 1, 0)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip((*twin.keys, *twin.values), (*cache.keys, *cache.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_gated_operator_without_the_kernel_is_the_models_own_ops():
    """skinny_norm_gated where the kernel does not run (a CPU tensor): add, norm, the merged product and
    silu(gate) * up as PyTorch ops, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    norm_weight, weight = torch.rand(64, generator=g).bfloat16(), torch.randn(56, 64, generator=g).bfloat16()
    y, h = prenorm.skinny_norm_gated(x, r, norm_weight, 1e-6, weight, 8, 32, 20)  # (rows apart: 8-27, 32-51)
    hf = (x + r).float()  # transformers' RMSNorm, written out
    normed = norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    both = torch.nn.functional.linear(normed, weight)
    assert torch.equal(h, x + r)
    assert torch.equal(y, torch.nn.functional.silu(both[:, 8:28]) * both[:, 32:52])


def test_the_operator_without_the_kernel_is_the_models_own_ops():
    """Where the kernel does not run (here: a CPU tensor), the operator adds, norms and multiplies with
    PyTorch ops, as transformers' layers do: bit for bit."""
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    norm_weight, weight = torch.rand(64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    y, h = prenorm.skinny_norm_linear(x, r, norm_weight, 1e-6, weight)
    assert torch.equal(h, x + r)
    assert torch.equal(y, torch.nn.functional.linear(prenorm.rms_norm(x + r, norm_weight, 1e-6), weight))


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", [
    dict(block_n=4, block_k=64, warps=4, stages=3),
    dict(block_n=8, block_k=64, warps=4, stages=1, split=2),
    dict(block_n=16, block_k=32, warps=4, stages=2, dot=True),
], ids=["plain", "split2", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_adds_and_norms_as_the_models_ops_do(rows, setting, dtype):
    """launch with `pre` against rms_norm(x + r) @ w.T and x + r, with K not a multiple of the piece, N not
    of the columns per program, the norm's sum over all of K whatever the piece or split."""
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 200, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(200, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(52, 200, generator=g) / 10).to(DEVICE, dtype)
    y, h = torch.empty(rows, 52, device=DEVICE, dtype=dtype), torch.empty(rows, 200, device=DEVICE, dtype=dtype)
    skinny.launch(x, w, y, setting, pre=(r, norm_weight, h, 1e-6))
    assert torch.equal(h, x + r)
    want = torch.nn.functional.linear(prenorm.rms_norm(x + r, norm_weight, 1e-6).float(), w.float())
    tol = 5e-2 if setting.get("dot") and DEVICE == "cuda" or dtype == torch.float16 else 1e-4
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", [
    dict(block_n=4, block_k=64, warps=4, stages=3),
    dict(block_n=16, block_k=32, warps=4, stages=2, dot=True),
], ids=["plain", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_adds_norms_and_gates_as_the_models_ops_do(rows, setting, dtype):
    """launch with `pre` and `up` (skinny_norm_gated's kernel) against silu(g) * u of rms_norm(x + r) @ w.T's
    two halves, and x + r; K not a multiple of the piece, N not of the columns per program."""
    g = torch.Generator().manual_seed(10 + rows)
    x, r = (torch.randn(rows, 200, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(200, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(2 * 52, 200, generator=g) / 10).to(DEVICE, dtype)
    y, h = torch.empty(rows, 52, device=DEVICE, dtype=dtype), torch.empty(rows, 200, device=DEVICE, dtype=dtype)
    skinny.launch(x, w, y, setting, pre=(r, norm_weight, h, 1e-6), up=52)
    assert torch.equal(h, x + r)
    both = torch.nn.functional.linear(prenorm.rms_norm(x + r, norm_weight, 1e-6).float(), w.float())
    want = torch.nn.functional.silu(both[:, :52]) * both[:, 52:]
    tol = 5e-2 if setting.get("dot") and DEVICE == "cuda" or dtype == torch.float16 else 1e-4
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the settings gated.py picks, compiled for a GPU (shared memory is the question)")
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gated_operator_runs_the_kernel_at_the_small_models_shape(rows, dtype, monkeypatch):
    """skinny_norm_gated at the 0.6B shape's gate/up (3072 outputs of 1024 inputs), with the settings gated.py
    picks for 1-8 rows: the kernel compiles and runs (fits the SM's shared memory) and gives PyTorch's result."""
    launched = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda *a, **k: launched.append(k) or real_launch(*a, **k))
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 1024, generator=g).to("cuda", dtype) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(1024, generator=g)).to("cuda", dtype)
    weight = (torch.randn(6144, 1024, generator=g) / 32).to("cuda", dtype)
    y, h = prenorm.skinny_norm_gated(x, r, norm_weight, 1e-6, weight, 0, 3072, 3072)
    assert launched and launched[0]["up"] == 3072 and launched[0]["pre"] is not None
    want = gated.glu_ops(prenorm.rms_norm(x + r, norm_weight, 1e-6), weight, 0, 3072, 3072)
    assert torch.equal(h, x + r)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
