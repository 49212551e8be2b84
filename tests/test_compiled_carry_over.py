"""The carry-over as one compiled kernel (speed/compiled.py: CARRY_OVER, `carry_over_sum`): the same ids as
core/carry_over.py's four ops, and forward_step runs it where a compiled step brings it. On a GPU,
tests/test_gpu.py runs it inside compiled steps."""

from types import SimpleNamespace

import pytest
import torch

from minibatch.core import launch
from minibatch.core.carry_over import apply_carry_over
from minibatch.speed import compiled
from minibatch.speed.compiled import CompiledStep, carry_over_sum


def cases():
    """(input ids with placeholders, previous step's output, mask): rows going nowhere, fewer and more rows
    than inputs, no row at all, an output buffer longer than the mask."""
    g = torch.Generator().manual_seed(4)
    out = []
    for t, r, spare in ((1, 1, 0), (6, 3, 2), (3, 6, 0), (9, 0, 4), (40, 17, 5)):
        ids = torch.randint(1, 1000, (t,), generator=g)
        dest = torch.randperm(max(t, r), generator=g)[:r]
        mask = torch.where((dest < t) & (torch.rand(r, generator=g) < 0.7), dest, torch.full_like(dest, -1))
        ids[mask[mask >= 0]] = 0  # a placeholder where a token lands
        out.append((ids, torch.randint(1, 1000, (r + spare,), generator=g), mask))
    return out


@pytest.mark.parametrize("case", range(5))
def test_one_reduction_gives_the_ids_of_the_four_ops(case):
    ids, prev, mask = cases()[case]
    want, got = torch.empty_like(ids), torch.full_like(ids, -7)
    apply_carry_over(want, ids, prev, mask)
    carry_over_sum(got, ids, prev, mask)
    assert torch.equal(got, want)


def test_it_traces_with_symbolic_sizes():
    """One compile for every size (dynamic=True), as CompiledStep makes it (here without Inductor's code
    generation, which a CPU would do in C++): the same ids for sizes that differ from the first."""
    fn = torch.compile(carry_over_sum, dynamic=True, backend="aot_eager")
    for ids, prev, mask in cases()[1:]:
        want, got = torch.empty_like(ids), torch.empty_like(ids)
        apply_carry_over(want, ids, prev, mask)
        fn(got, ids, prev, mask)
        assert torch.equal(got, want)


def test_a_compiled_step_brings_it_only_when_asked_and_on_a_gpu(monkeypatch):
    import minibatch

    model = minibatch.load_model("random-llama", device="cpu", dtype=torch.float32)
    assert CompiledStep(model).carry_over is None  # off by default
    monkeypatch.setattr(compiled, "CARRY_OVER", True)
    assert CompiledStep(model).carry_over is None  # a CPU step keeps the eager ops (no C++ compile for this)


def test_forward_step_runs_the_compiled_steps_carry_over_where_there_is_one():
    class Taken(Exception):
        pass

    class Step:
        def carry_over(self, *args):
            raise Taken

    ids, prev, mask = cases()[1]
    args = SimpleNamespace(patched_ids=torch.empty_like(ids), input_ids=ids, source=prev, carry=mask)
    with pytest.raises(Taken):
        launch.forward_step(None, None, args, Step())
    with pytest.raises(AttributeError, match="batch"):  # the eager ops ran, then the (absent) batch was read
        launch.forward_step(None, None, args, SimpleNamespace(carry_over=None))
    want = torch.empty_like(ids)
    apply_carry_over(want, ids, prev, mask)
    assert torch.equal(args.patched_ids, want)
