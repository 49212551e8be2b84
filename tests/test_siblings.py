"""Sibling projections stacked into one tensor, and merged into one product in a compiled graph."""

import shutil

import pytest
import torch

import minibatch
from minibatch.speed.compat import LINEAR_TARGETS
from minibatch.speed import siblings


def randomize_biases(module):
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))


def merged_by(module, x, grad=False):
    """Compile `module` with a backend that runs siblings.merge, then the graph as it is; (merged, out)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(siblings.merge(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        out = torch.compile(module, backend=backend)(x)
    return seen, out


class Attn(torch.nn.Module):
    """q/k/v siblings, called in the order given, with an optional in-place change of the input between."""

    def __init__(self, rows=(8, 4, 4), order=("q", "k", "v"), bias=False, in_place=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, r, bias=bias) for r in rows)
        self.order, self.in_place = order, in_place

    def forward(self, x):
        outs = []
        for i, name in enumerate(self.order):
            if self.in_place and i == 1:
                x.mul_(2)
            outs.append(getattr(self, name + "_proj")(x).sum(-1))
        return torch.stack(outs)


def linear_calls(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS)


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
    randomize_biases(hf)  # (transformers starts them at zero: a dropped bias would go unseen)
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


def test_siblings_in_any_order_merge_and_give_the_same_outputs():
    m = Attn(rows=(8, 3, 5), order=("v", "q", "k"), bias=True)
    randomize_biases(m)
    assert siblings.pack(m) == 1
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = m(x)
        seen, out = merged_by(m, x)
    assert seen == [2] and torch.allclose(out, want, atol=1e-6)


def test_what_merge_leaves_alone():
    """Separate tensors (not packed), stacked weights not at the storage's start, siblings whose
    biases differ in kind, an in-place change between the siblings, autograd recording: no merge."""
    x = torch.randn(3, 8)
    assert merged_by(Attn(), x)[0] == [0]  # not packed
    m = Attn()
    flat = torch.zeros(8 + 16 * 8)  # stacked, but from offset 8 of their storage
    row = 8
    for lin in (m.q_proj, m.k_proj, m.v_proj):
        n = lin.weight.numel()
        lin.weight.data = flat[row: row + n].view(lin.weight.shape)
        row += n
    assert siblings._consecutive([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
    assert merged_by(m, x)[0] == [0]
    assert siblings.pack(m) == 1 and merged_by(m, x)[0] == [2]  # pack moves them to the start
    m = Attn()
    m.k_proj = torch.nn.Linear(8, 4, bias=True)  # one sibling with a bias, the others without
    assert siblings.pack(m) == 0
    m = Attn(in_place=True)
    siblings.pack(m)
    with torch.no_grad():
        want = m(x.clone())
        seen, out = merged_by(m, x.clone())
    assert seen == [0] and torch.allclose(out, want)
    m = Attn()
    siblings.pack(m)
    assert merged_by(m, x, grad=True)[0] == [0]  # k's and v's gradients would be lost


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="Inductor compiles C++ on a CPU")
def test_the_backend_compiles_the_merged_graph_once_for_every_caller():
    """siblings.backend through Inductor (on the CPU here; CompiledStep uses it on GPUs): the merged graph
    gives the model's logits, and a second torch.compile of the same forward with the backend of the same
    mode (as a second engine makes) reuses that compilation instead of compiling again."""
    model = minibatch.load_model("random-qwen2", device="cpu", dtype=torch.float32)
    randomize_biases(model.hf)
    siblings.pack(model.hf)
    ids = torch.randint(0, model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    backend = siblings.backend("cpu-test")  # a mode of its own: counts only this test's compiles
    assert siblings.backend("cpu-test") is backend
    backend.mode = None  # (Inductor's default options)

    def forward(x):
        return model.hf(input_ids=x, use_cache=False).logits

    with torch.no_grad():
        want = forward(ids)
        first = torch.compile(forward, backend=siblings.backend("cpu-test"))(ids)
        second = torch.compile(forward, backend=siblings.backend("cpu-test"))(ids)
    assert backend.merged == [3 * model.num_layers]  # one compile, q/k/v and gate/up merged in it
    assert torch.allclose(first, want, atol=1e-5) and torch.equal(first, second)


def test_inductor_config_reaches_the_compile(monkeypatch):
    """CompiledStep(inductor=...) and siblings.backend(inductor=...): one backend per set of options
    however they are passed, and its config patches go to Inductor on top of the mode's; on a CPU the
    compiled step adds no early-launch config of its own."""
    from minibatch.speed import compat, compiled, early

    seen = []
    monkeypatch.setattr(siblings, "inductor_compile", lambda gm, ex, mode, patches: seen.append(patches) or gm.forward)
    a = siblings.backend("cpu-patch-test", True, False, {"b": 2, "a": 1})
    assert siblings.backend("cpu-patch-test", True, False, {"a": 1, "b": 2}) is a
    assert siblings.backend("cpu-patch-test", True, False) is not a
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda x: x * 2, backend=a)(torch.ones(3))
    assert seen == [(("a", 1), ("b", 2))]
    assert early.inductor_options(torch.device("cpu")) == {}
    step = compiled.CompiledStep(minibatch.load_model("random-llama", device="cpu", dtype=torch.float32),
                                 inductor={"fallback_random": True})
    assert step.inductor == {"fallback_random": True}
    import torch._inductor.compile_fx as compile_fx

    given = []
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, ex, config_patches=None: given.append(config_patches))
    compat.inductor_compile(None, [], "max-autotune-no-cudagraphs", (("triton.enable_pdl", True),))
    compat.inductor_compile(None, [], None, ())
    assert given[0]["triton.enable_pdl"] is True and given[0]["max_autotune"] is True  # the mode's and ours
    assert given[1] is None
