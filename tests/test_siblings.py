"""Sibling projections stacked into one tensor, and merged into one product in a compiled graph."""

import pytest
import torch

import minibatch
from minibatch import siblings


def linear_calls(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in siblings._LINEAR)


@pytest.mark.parametrize("name", ["random-llama", "random-qwen2"])  # qwen2: q/k/v have biases
def test_packing_moves_weights_but_changes_no_value(name):
    model = minibatch.load_model(name, device="cpu", dtype=torch.float32)
    hf = model.hf
    ids = torch.randint(0, model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
    assert siblings.pack(hf) == 2 * model.num_layers  # q/k/v and gate/up in every layer
    assert siblings.pack(hf) == 0  # packed already
    attn = hf.model.layers[0].self_attn
    assert siblings._consecutive([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    if name == "random-qwen2":
        assert siblings._consecutive([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert all(torch.equal(before[k], v) for k, v in hf.state_dict().items())
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids, use_cache=False).logits, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["random-llama", "random-qwen2"])
def test_a_compiled_graph_runs_siblings_as_one_product(name):
    """The merge pass on the graph torch.compile captures (run as it is, without Inductor): three of each
    layer's seven linear calls go into a sibling's, and the logits stay those of the eager model."""
    model = minibatch.load_model(name, device="cpu", dtype=torch.float32)
    hf = model.hf
    siblings.pack(hf)
    ids = torch.randint(0, model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    seen = []

    def backend(gm, example_inputs):
        calls = linear_calls(gm)
        seen.append((calls, siblings.merge(gm, example_inputs), linear_calls(gm)))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda x: hf(input_ids=x, use_cache=False).logits, backend=backend, fullgraph=True)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        out = step(ids)
    layers = model.num_layers
    assert seen == [(7 * layers + 1, 3 * layers, 4 * layers + 1)]
    assert torch.allclose(out, ref, rtol=0, atol=1e-5)


def test_weights_that_are_not_stacked_are_left_alone():
    """Without pack (separate tensors), or with siblings whose biases differ in kind, nothing merges."""
    q, k = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=True)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = q, k, torch.nn.Linear(8, 4, bias=False)

        def forward(self, x):
            return self.q_proj(x).sum() + self.k_proj(x).sum() + self.v_proj(x).sum()

    m = Attn()
    assert siblings.pack(m) == 0
    seen = []

    def backend(gm, example_inputs):
        seen.append(siblings.merge(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(torch.compile(m, backend=backend)(x), m(x))
    assert seen == [0]
