"""Each private PyTorch/CPython hook of the package (the compat.py of minibatch/core, minibatch/devices and
minibatch/speed), exercised on the installed versions: a hook that stops doing what the package relies
on fails here, by name."""

import gc
import os

import numpy as np
import pytest
import torch

from minibatch.core import compat as core_compat
from minibatch.devices import compat as devices_compat
from minibatch.speed import compat as speed_compat


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(4)
    before = speed_compat.tensor_version(t)
    t.add_(1)
    t[0] = 5.0
    assert speed_compat.tensor_version(t) == before + 2
    p = torch.nn.Parameter(torch.zeros(3))
    v = speed_compat.tensor_version(p)
    with torch.no_grad():
        p.copy_(torch.ones(3))  # as load_state_dict writes weights: same address, new values
    assert speed_compat.tensor_version(p) > v
    with torch.inference_mode():
        assert speed_compat.tensor_version(torch.zeros(2)) == -1  # no counter kept: the documented fallback


def test_rebind_data_keeps_the_parameter_object():
    lin = torch.nn.Linear(3, 2)
    p = lin.weight
    block = torch.arange(12.0).reshape(4, 3)
    speed_compat.rebind_data(p, block[2:4])
    assert lin.weight is p and isinstance(p, torch.nn.Parameter)  # the same object, a view of the block now
    assert p.data_ptr() == block[2:4].data_ptr()
    block[2, 0] = -7.0
    assert p[0, 0].item() == -7.0  # writes to the block show through
    assert torch.equal(lin(torch.eye(3)), torch.eye(3) @ block[2:4].T + lin.bias)
    with pytest.raises(ValueError, match="cannot stand in"):
        speed_compat.rebind_data(p, torch.zeros(3, 3))


def test_linear_is_what_dynamo_records():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 3)
    out = torch.compile(lin, backend=backend, fullgraph=True)(torch.randn(2, 4))
    assert out.shape == (2, 3)
    assert any(t in speed_compat.LINEAR_TARGETS for t in seen), seen
    assert speed_compat.LINEAR in speed_compat.LINEAR_TARGETS
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    assert torch.equal(speed_compat.LINEAR(x, w), x @ w.T)  # a graph rewrite may insert it as a linear call


def test_persistent_rows_widens_inductors_rule_for_few_rows_only_inside():
    """persistent_rows(8): a reduction of 4 rows x 1024 without a contiguity hint (the first RMSNorm, fused with
    the embedding's gather) becomes persistent; 16 rows or 2048 elements stay looped; what Inductor's own rule
    makes persistent still is; outside, Inductor's rule is back."""
    from types import SimpleNamespace

    import sympy
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    def features(rows, n, hint=ReductionHint.DEFAULT):
        return SimpleNamespace(numel=sympy.Integer(rows), reduction_numel=sympy.Integer(n),
                               get_reduction_hint=lambda: hint)

    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
        assert not V.choices.should_use_persistent_reduction(features(4, 1024), False)
        with speed_compat.persistent_rows(8):
            rule = V.choices.should_use_persistent_reduction
            assert rule(features(4, 1024), False) and rule(features(8, 1000), False)
            assert not rule(features(16, 1024), False) and not rule(features(4, 2048), False)
            assert rule(features(64, 1024, ReductionHint.INNER), False)  # (Inductor's own rule)
        assert not V.choices.should_use_persistent_reduction(features(4, 1024), False)
        with speed_compat.persistent_rows(0):
            assert not V.choices.should_use_persistent_reduction(features(4, 1024), False)


def test_inductor_compile_runs_a_graph():
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return speed_compat.inductor_compile(gm, example_inputs, None)

    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend=backend)
    x = torch.randn(8)
    assert torch.allclose(fn(x), torch.relu(x) * 2 + 1)
    assert calls == [1]
    from torch._inductor import list_mode_options

    assert list_mode_options("max-autotune-no-cudagraphs", dynamic=False)  # the mode names the runner passes


def test_raise_recompile_limit_only_raises():
    import torch._dynamo as dynamo

    # torch's own patch restores the limit after the block; monkeypatch.setattr on torch's config
    # module deletes the attribute on undo under pytest >= 9.2, which breaks every later compile
    with dynamo.config.patch(recompile_limit=8):
        speed_compat.raise_recompile_limit(64)
        assert dynamo.config.recompile_limit == 64
        speed_compat.raise_recompile_limit(16)
        assert dynamo.config.recompile_limit == 64  # never lowered


def test_raise_recompile_limit_lets_many_shapes_compile():
    import torch._dynamo as dynamo

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    with dynamo.config.patch(recompile_limit=2):
        speed_compat.raise_recompile_limit(12)
        torch._dynamo.reset()
        fn = torch.compile(lambda x: x + 1, backend=backend, dynamic=False)
        for n in range(1, 7):  # six shapes: past the old limit of 2, under the new one
            fn(torch.zeros(n))
    assert len(compiles) == 6


def test_mark_dynamic_makes_one_compile_serve_every_length():
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend=backend)
    for n in (5, 9, 13):
        x = torch.zeros(n)
        speed_compat.mark_dynamic(x, 0)
        assert fn(x).shape == (n,)
    assert len(compiles) == 1


def _seen(holder, name, owners=1):
    # (a plain call, not inside an assert: pytest's assertion rewriting keeps references to the
    # expressions it shows, which would count as holders)
    return core_compat.referenced_elsewhere(holder[name] if isinstance(holder, list) else getattr(holder, name), owners)


def test_referenced_elsewhere_sees_a_view():
    arrays = [np.zeros((4, 4))]
    alone = _seen(arrays, 0)
    view = arrays[0].reshape(-1)  # a batch's flat view keeps its base alive
    viewed = _seen(arrays, 0)
    del view
    gc.collect()
    after = _seen(arrays, 0)
    assert (alone, viewed, after) == (False, True, False)

    class Holder:
        pass

    h = Holder()
    h.a = np.zeros(3)
    alone = _seen(h, "a")
    other = h.a
    held, known = _seen(h, "a"), _seen(h, "a", owners=2)  # `other` unknown, then counted as an owner
    del other
    assert (alone, held, known) == (False, True, False)


def test_object_at_returns_the_object_of_an_address():
    obj = {"weights": [1, 2, 3]}
    assert devices_compat.object_at(id(obj)) is obj
    module = torch.nn.Linear(2, 2)
    assert devices_compat.object_at(id(module)) is module


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_object_at_finds_the_forked_copy():
    """What the cpu device process relies on: after a fork, the child's copy sits at the same address."""
    obj = torch.arange(5)
    address = id(obj)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            ok = torch.equal(devices_compat.object_at(address), torch.arange(5))
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert answer == b"1"


def test_share_fd_gives_a_descriptor_of_the_storage():
    t = torch.zeros(16, dtype=torch.int64)
    t.share_memory_()
    fd, nbytes = devices_compat.share_fd(t.untyped_storage())
    assert nbytes == t.numel() * t.element_size()
    assert os.fstat(fd).st_size >= nbytes
    t[3] = 42
    data = os.pread(fd, nbytes, 0)  # the descriptor maps the tensor's own memory
    assert np.frombuffer(data, np.int64)[3] == 42


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compile_on_the_gpu_with_a_mode():
    def backend(gm, example_inputs):
        return speed_compat.inductor_compile(gm, example_inputs, "max-autotune-no-cudagraphs")

    torch._dynamo.reset()
    lin = torch.nn.Linear(64, 32).cuda()
    x = torch.randn(8, 64, device="cuda")
    out = torch.compile(lin, backend=backend)(x)
    assert torch.allclose(out, lin(x), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rebind_data_on_the_gpu():
    lin = torch.nn.Linear(8, 4).cuda()
    block = torch.randn(10, 8, device="cuda")
    p = lin.weight
    speed_compat.rebind_data(p, block[6:10])
    assert lin.weight is p and p.data_ptr() == block[6:10].data_ptr()
    assert speed_compat.tensor_version(p) >= 0
