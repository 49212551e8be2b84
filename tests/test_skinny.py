"""speed/skinny.py: the kernel for products of a few rows by a narrow weight, where it is used, and how.

The kernel itself runs on a GPU, or on a CPU in Triton's interpreter (switched on before anything
imports triton: `pip install triton && TRITON_INTERPRET=1 python -m pytest tests/test_skinny.py`);
elsewhere those tests are skipped. The operator and the graph pass run everywhere (off CUDA the
operator is F.linear). tests/test_gpu.py checks a compiled step that uses the kernel.
"""

import os
import shutil

import pytest
import torch

from minibatch.speed import skinny

KERNEL = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def test_the_kernel_is_chosen_for_few_rows_and_narrow_outputs_only():
    """`settings`: one row and at most 2048 output columns, or 2-4 rows and at most 1024, or, with K of at
    most 1024, 1-4 rows and at most SHORT_K (where it was measured to win or tie); else cuBLAS."""
    plain = dict(block_n=4, block_k=1024, warps=4, stages=3)
    assert skinny.settings(1, 1024, 1024) == plain
    assert skinny.settings(1, 2048, 8192) is not None and skinny.settings(4, 1024, 3072) is not None
    assert skinny.settings(4, 2048, 8192) is None  # a 1B model's down product at 4 rows: cuBLAS is faster
    assert skinny.settings(max(skinny.WIDEST) + 1, 1024, 2048) is None  # 5 rows and more: cuBLAS
    assert skinny.settings(1, 4096, 2048) is None  # a wide output of a longer K: cuBLAS is as fast
    # the 0.6B model's merged q/k/v (K = 1024): plain at one row, tensor cores at 2-4, cuBLAS from 5
    assert skinny.settings(1, skinny.SHORT_K, 1024) == plain
    tile = dict(block_n=32, block_k=128, warps=4, stages=5, dot=True)
    assert skinny.settings(2, skinny.SHORT_K, 1024) == tile == skinny.settings(4, skinny.SHORT_K, 512)
    assert skinny.settings(5, skinny.SHORT_K, 1024) is None and skinny.settings(1, skinny.SHORT_K + 1, 1024) is None
    assert skinny.settings(0, 1024, 1024) is None


def test_short_k_off_leaves_wide_products_of_short_k_on_cublas(monkeypatch):
    """SHORT_K = 0 (floor_matrix.py's short_k=0): WIDEST alone decides."""
    monkeypatch.setattr(skinny, "SHORT_K", 0)
    assert skinny.settings(1, 4096, 1024) is None and skinny.settings(4, 2048, 1024) is None
    assert skinny.settings(1, 2048, 1024) is not None and skinny.settings(4, 1024, 1024) is not None


def test_a_wider_rule_gives_its_new_products_the_setting_timed_for_them(monkeypatch):
    """With WIDEST widened (an experiment's rule), products of more than 4 rows, and of 2-4 rows wider than
    2048 columns, run on tensor cores; one row, and the narrow products of 2-4 rows, keep the shipped setting."""
    monkeypatch.setattr(skinny, "WIDEST", {1: 8192, 8: 8192})
    shipped = dict(block_n=4, block_k=1024, warps=4, stages=3)
    assert skinny.settings(1, 4096, 1024) == shipped and skinny.settings(1, 1024, 3072) == shipped
    for rows, n in ((4, 4096), (2, 6144), (8, 1024)):
        assert skinny.settings(rows, n, 1024) == dict(block_n=32, block_k=128, warps=4, stages=5, dot=True)
    assert skinny.settings(9, 1024, 1024) is None


def test_timed_settings_take_their_products_whatever_the_rule(monkeypatch):
    """TIMED (an experiment's settings, floor_matrix.py --skinny-settings): a product with its (rows, n, k) gets
    that setting even where WIDEST would leave it on cuBLAS; every other product keeps the rule, other row
    counts of the same shape included; a caller's change to the returned setting leaves TIMED as it was."""
    tile = dict(block_n=32, block_k=256, warps=4, stages=4, dot=True)
    monkeypatch.setattr(skinny, "TIMED", {(4, 4096, 2048): tile})
    assert skinny.settings(4, 4096, 2048) == tile and skinny.settings(1, 4096, 2048) is None
    assert skinny.settings(4, 1024, 2048) == dict(block_n=4, block_k=2048, warps=4, stages=3)
    skinny.settings(4, 4096, 2048)["stages"] = 2
    assert skinny.TIMED[(4, 4096, 2048)]["stages"] == 4


def test_one_piece_reads_k_of_2048_at_once(monkeypatch):
    """ONE_PIECE (on): K of 2048 in one piece on products of at most 1024 columns (what timed faster, alone
    and in the 0.6B step), larger K in pieces of 1024 (or, DEFER, of 512 with 2-4 rows), and the 1B model's
    2048-column attention output (untimed) in pieces of 1024; off, pieces of 1024."""
    monkeypatch.setattr(skinny, "DEFER", False)
    assert [skinny.settings(r, 1024, k)["block_k"] for r in (1, 4) for k in (1024, 2048, 3072)] == [1024, 2048, 1024] * 2
    assert skinny.settings(1, 2048, 2048)["block_k"] == 1024
    monkeypatch.setattr(skinny, "ONE_PIECE", False)
    assert skinny.settings(1, 1024, 2048)["block_k"] == 1024


def test_defer_takes_two_to_four_rows_with_k_over_2048_in_pieces_of_512(monkeypatch):
    """DEFER (on): 2-4 rows with K over 2048 get the products summed once after the loop; one row, and K of
    2048 or less, keep their setting; off, the 4-row down product has pieces of 1024."""
    assert skinny.settings(4, 1024, 3072) == dict(block_n=4, block_k=512, warps=4, stages=3, defer=True)
    assert skinny.settings(2, 1024, 3072)["defer"]
    assert "defer" not in skinny.settings(1, 1024, 3072) and "defer" not in skinny.settings(4, 1024, 2048)
    monkeypatch.setattr(skinny, "DEFER", False)
    assert skinny.settings(4, 1024, 3072) == dict(block_n=4, block_k=1024, warps=4, stages=3)


def test_the_operator_off_cuda_is_linear():
    """skinny_linear on the CPU: F.linear's result, for inputs with leading dimensions too."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 3, 64, generator=g), torch.randn(32, 64, generator=g)
    y = torch.ops.minibatch.skinny_linear(x, w)
    assert y.shape == (1, 3, 32) and torch.equal(y, torch.nn.functional.linear(x, w))


class _Three(torch.nn.Module):
    """A narrow product, a wide one (wider than SHORT_K lets in) and one with a bias: only the first is the
    kernel's."""

    def __init__(self):
        super().__init__()
        self.narrow = torch.nn.Linear(64, 32, bias=False)
        self.wide = torch.nn.Linear(32, skinny.SHORT_K + 1024, bias=False)
        self.biased = torch.nn.Linear(skinny.SHORT_K + 1024, 16)

    def forward(self, x):
        return self.biased(self.wide(self.narrow(x)))


@pytest.mark.parametrize("rows, routed", [(2, 1), (max(skinny.WIDEST) + 4, 0)])
def test_route_sends_narrow_products_of_few_rows_to_the_operator(rows, routed):
    """The graph pass, on the graph torch.compile captures: the narrow product without a bias goes to
    skinny_linear when the rows are few, nothing else does, and the result is unchanged."""
    torch.manual_seed(1)
    module = _Three().eval()
    x = torch.randn(1, rows, 64)
    seen = []

    def backend(gm, example_inputs):
        seen.append(skinny.route(gm, example_inputs, on_cuda_only=False))
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen.append(targets.count(torch.ops.minibatch.skinny_linear.default))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(module, backend=backend, dynamic=False)(x)
        want = module(x)
    assert seen == [routed, routed]
    assert torch.allclose(got, want, atol=1e-5)


def test_route_hands_symbolic_row_counts_to_the_operator():
    """A compile with a symbolic row count (what a server's dynamic-rows step makes): the pass cannot
    know the rows, so it routes the narrow product and the operator decides per call; one compile
    serves 2 and 9 rows with unchanged results."""
    torch.manual_seed(1)
    module = _Three().eval()
    seen = []

    def backend(gm, example_inputs):
        seen.append(skinny.route(gm, example_inputs, on_cuda_only=False))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, dynamic=True)
    with torch.no_grad():
        for rows in (2, 9):
            x = torch.randn(1, rows, 64)
            assert torch.allclose(compiled(x), module(x), atol=1e-5)
    assert seen == [1]


def test_route_leaves_cpu_graphs_alone_by_default():
    torch.manual_seed(1)
    module = _Three().eval()
    seen = []

    def backend(gm, example_inputs):
        seen.append(skinny.route(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=backend, dynamic=False)(torch.randn(1, 2, 64))
    assert seen == [0]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="Inductor compiles C++ on a CPU")
def test_the_backend_runs_the_pass_and_inductor_compiles_the_operator():
    """siblings.backend with skinny=True on a CPU graph: the pass routes nothing there (CPU weights),
    and a compile of a graph that holds the operator works through Inductor (its fake implementation)."""
    from minibatch.speed import siblings

    torch.manual_seed(1)
    module = _Three().eval()
    x = torch.randn(1, 2, 64)
    b = siblings.backend("cpu-skinny-test", True, True)
    b.mode = None  # (Inductor's default options)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(module, backend=b, dynamic=False)(x)

        def with_op(x):
            return torch.ops.minibatch.skinny_linear(x, module.narrow.weight) * 2

        doubled = torch.compile(with_op, backend=b, dynamic=False)(x)
    assert b.routed == [0, 0]
    assert torch.allclose(got, module(x), atol=1e-5)
    assert torch.allclose(doubled, 2 * module.narrow(x), atol=1e-5)


@pytest.mark.skipif(not KERNEL, reason="the kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", [
    dict(block_n=4, block_k=32, warps=4, stages=3),
    dict(block_n=8, block_k=64, warps=4, stages=1, split=2),
    dict(block_n=4, block_k=32, warps=4, stages=3, split=4),
    dict(block_n=16, block_k=32, warps=4, stages=2, dot=True),
    dict(block_n=16, block_k=16, warps=4, stages=2, split=3, dot=True),
    skinny.settings(1, 1024, 1024),
    {**skinny.settings(1, 1024, 1024), "block_n": 32, "block_k": 256, "stages": 4, "dot": True},
    dict(block_n=4, block_k=64, warps=4, stages=3, defer=True),
    dict(block_n=8, block_k=32, warps=4, stages=1, split=2, defer=True),
], ids=["plain", "split2", "split4", "dot", "dot-split3", "shipped", "wide-rule", "defer", "defer-split2"])
def test_the_kernel_computes_the_product(rows, setting):
    """launch against x @ w.T (float32) with K not a multiple of the piece, N not of the columns per
    program, rows of x and w strided wider than K; with K splits the same bits on every call (the
    partial sums are added in a fixed order)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 260, generator=g).to(DEVICE)[:, :200]
    w = torch.randn(52, 230, generator=g).to(DEVICE)[:, :200]
    y, again = (torch.empty(rows, 52, device=DEVICE) for _ in range(2))
    skinny.launch(x, w, y, setting)
    skinny.launch(x, w, again, setting)
    tol = 5e-2 if setting.get("dot") and DEVICE == "cuda" else 1e-4  # (tensor cores: TF32 on a GPU)
    assert torch.allclose(y, x @ w.T, atol=tol, rtol=tol)
    assert torch.equal(y, again)


def test_route_takes_merged_sibling_products_where_they_are_narrow_enough(monkeypatch):
    """A merged q/k/v or gate/up product's weight is an `as_strided` view of the first sibling's (siblings.merge),
    not a graph input: route reads its shape through the view, so it goes to the operator when `WIDEST` lets
    its width through, and stays on F.linear when not; the logits are unchanged either way."""
    import minibatch
    from minibatch.speed import siblings

    model = minibatch.load_model("random-qwen3", device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    ids = torch.randint(0, model.vocab_size, (1, 1), generator=torch.Generator().manual_seed(0))
    mlp = model.hf.model.layers[0].mlp
    merged_widths = (2 * mlp.gate_proj.out_features, model.hf.model.layers[0].self_attn.q_proj.out_features
                     + 2 * model.hf.model.layers[0].self_attn.k_proj.out_features)

    def forward(x):
        return model.hf(input_ids=x, use_cache=False).logits

    with torch.no_grad():
        want = forward(ids)
    for widest, per_layer in ((max(merged_widths), 4), (min(merged_widths) - 1, 2)):
        # (o and down are narrower than either merged product in this model: they always go)
        monkeypatch.setattr(skinny, "WIDEST", {1: widest})
        monkeypatch.setattr(skinny, "SHORT_K", 0)  # (this small model's K: SHORT_K would let both through)
        seen = []

        def backend(gm, example_inputs):
            siblings.merge(gm, example_inputs)
            seen.append(skinny.route(gm, example_inputs, on_cuda_only=False))
            return gm.forward

        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(forward, backend=backend, dynamic=False)(ids)
        assert seen == [per_layer * model.num_layers], widest
        assert torch.allclose(got, want, atol=1e-5)


def test_early_launch_only_where_the_gpu_has_it(monkeypatch):
    """Programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or more, and never runs
    under Triton's CPU interpreter (which has no grid-dependency instructions, whichever way
    TRITON_INTERPRET says on); our kernels want it only inside a compiled step's calls."""
    from minibatch.speed import early

    cuda = torch.device("cuda", 0)
    assert not early.has_pdl(torch.device("cpu")) and early.inductor_options(torch.device("cpu")) == {}
    monkeypatch.setattr(early, "_capability", lambda index: 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not early.has_pdl(cuda)
    monkeypatch.setattr(early, "_capability", lambda index: 9)
    assert early.has_pdl(cuda)
    for on in ("1", "true", "ON"):
        monkeypatch.setenv("TRITON_INTERPRET", on)
        assert not early.has_pdl(cuda)
    assert not early.wanted()
    with early.inside():
        assert early.wanted()
        monkeypatch.setattr(early, "ENABLED", False)
        assert not early.wanted()
    monkeypatch.setattr(early, "ENABLED", True)
    assert not early.wanted()
