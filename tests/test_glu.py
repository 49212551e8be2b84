"""silu(gate) * up inside skinny.py's down product (speed/glu.py).

On the CPU (CI): the graph pass on a compiled decode step (the operator then runs PyTorch ops) against
the eager step. With Triton (a GPU, or its interpreter: TRITON_INTERPRET=1 set before pytest starts):
the kernel against those PyTorch ops.
"""

import os

import pytest
import torch

import minibatch
from decode_tables import decode_batch
from minibatch.speed import glu, siblings, skinny
from minibatch.speed.compat import inductor_compile

KERNEL = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("name", ["random-qwen3", "random-llama"])
def test_the_pass_fuses_every_down_product_and_keeps_the_logits(name):
    """Every layer's down product (routed to skinny.py's operator) on silu(gate) * up becomes one
    skinny_glu_linear call, and no silu is left; the logits and the cache the step leaves are the eager
    step's (float32, to rounding)."""
    model = minibatch.load_model(name, device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    fused = []

    def backend(gm, example_inputs):
        siblings.merge(gm, example_inputs)
        skinny.route(gm, example_inputs, on_cuda_only=False)
        fused.append(glu.fuse(gm, example_inputs))
        targets = [n.target for n in gm.graph.nodes]
        assert targets.count(torch.ops.minibatch.skinny_glu_linear.default) == fused[-1]
        assert torch.nn.functional.silu not in targets
        return inductor_compile(gm, example_inputs, None, ())

    shape = ([5, 11, 3], model.num_layers, model.num_kv_heads, model.head_dim)
    (cache, batch), (twin, _) = decode_batch(*shape), decode_batch(*shape)
    torch._dynamo.reset()
    with torch.inference_mode():
        want = model._forward(batch, cache)
        got = torch.compile(model._forward, backend=backend, fullgraph=True)(batch, twin)
    assert fused == [model.num_layers]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip((*twin.keys, *twin.values), (*cache.keys, *cache.values)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_silu_read_elsewhere_is_left_alone():
    """The pass takes only silu(a) * b whose silu and product nothing else reads (else they would be
    computed twice, or vanish from under their other readers)."""
    def alone(x, w):
        return torch.ops.minibatch.skinny_linear.default(torch.nn.functional.silu(x[..., :8]) * x[..., 8:], w)

    def read_elsewhere(x, w):
        act = torch.nn.functional.silu(x[..., :8])
        return torch.ops.minibatch.skinny_linear.default(act * x[..., 8:], w), act

    x, w = torch.randn(3, 16), torch.randn(5, 8)
    want = torch.nn.functional.linear(torch.nn.functional.silu(x[:, :8]) * x[:, 8:], w)
    gm = torch.fx.symbolic_trace(alone)
    assert glu.fuse(gm, ()) == 1
    torch.testing.assert_close(gm(x, w), want)
    gm = torch.fx.symbolic_trace(read_elsewhere)
    assert glu.fuse(gm, ()) == 0
    torch.testing.assert_close(gm(x, w)[0], want)


def test_the_operator_without_the_kernel_is_the_models_own_ops():
    """Where the kernel does not run (here: a CPU tensor), the operator is silu, product and linear as
    PyTorch runs them: bit for bit."""
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    weight = torch.randn(48, 64, generator=g).bfloat16()
    want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight)
    assert torch.equal(glu.skinny_glu_linear(gate, up, weight), want)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", [
    dict(block_n=4, block_k=64, warps=4, stages=3),
    dict(block_n=8, block_k=64, warps=4, stages=1, split=2),
    dict(block_n=16, block_k=32, warps=4, stages=2, dot=True),
], ids=["plain", "split2", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_computes_the_gated_input_as_the_models_ops_do(rows, setting, dtype):
    """launch with `up` against (silu(gate) * up) @ w.T, gate and up slices of one wider tensor (as the
    merged gate/up product leaves them), K not a multiple of the piece, N not of the columns per program."""
    g = torch.Generator().manual_seed(rows)
    both = torch.randn(rows, 400, generator=g).to(DEVICE, dtype)
    gate, up = both[:, :200], both[:, 200:]
    w = (torch.randn(52, 200, generator=g) / 10).to(DEVICE, dtype)
    y = torch.empty(rows, 52, device=DEVICE, dtype=dtype)
    skinny.launch(gate, w, y, setting, up=up)
    want = torch.nn.functional.linear((torch.nn.functional.silu(gate) * up).float(), w.float())
    tol = 5e-2 if setting.get("dot") and DEVICE == "cuda" or dtype == torch.float16 else 1e-4
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)
