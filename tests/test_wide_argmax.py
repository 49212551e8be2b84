"""The vocabulary's argmax in two steps (speed/wide_argmax.py): the same index as argmax, ties and NaN included."""

import shutil

import pytest
import torch

import minibatch
from decode_tables import after_pass
from minibatch.speed import siblings, wide_argmax

VOCAB = 151936  # Qwen3's: 128 pieces of 1187


def test_pieces_divide_the_row():
    assert wide_argmax.piece_width(VOCAB) == 1187
    assert wide_argmax.piece_width(128256) == 1336  # Llama 3's
    assert wide_argmax.piece_width(32768) == 1024
    assert wide_argmax.piece_width(65521) is None  # a prime: no piece divides it
    assert wide_argmax.piece_width(4096) is None  # too short to cut into 8 pieces of 1,024


def rows_with_ties_and_nan():
    """Rows whose largest value sits once, at several places (within a piece, across pieces, at the ends),
    under NaN, and nowhere but -inf."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-50, 50, (10, VOCAB), generator=g).float()  # integer values: many equal ones
    x[1, [5, 6, 4000, 150000]] = 1000.0  # ties within the first piece and across pieces
    x[2, [VOCAB - 1, 1187]] = 1000.0  # a tie at a piece's first position and at the row's end
    x[3, 0] = 1000.0
    x[4, VOCAB - 1] = 1000.0
    x[5, [70000, 3]] = float("nan")  # NaN counts as the largest
    x[6] = float("-inf")
    x[7, [1186, 1187]] = 1000.0  # the last of one piece and the first of the next
    return x


def test_two_steps_give_argmax_bit_for_bit():
    x = rows_with_ties_and_nan()
    want = x.argmax(dim=-1)
    assert want[1].item() == 5 and want[5].item() == 3 and want[6].item() == 0  # what the rows were made for
    assert torch.equal(wide_argmax.two_step_argmax(x, 1187), want)
    assert torch.equal(wide_argmax.two_step_argmax(x.to(torch.bfloat16), 1187), x.to(torch.bfloat16).argmax(-1))
    assert torch.equal(wide_argmax.two_step_argmax(x[:3].reshape(3, 1, VOCAB), 1187), want[:3, None])


def split_by(fn, *inputs):
    """Compile `fn` with a backend that runs wide_argmax.split, then the graph as it is: (replaced, graph, out)."""
    return after_pass(wide_argmax.split, fn, *inputs)


@pytest.mark.parametrize("form", ["method", "function", "dim_keyword", "float_first"])
def test_the_pass_replaces_a_wide_argmax(form):
    x = rows_with_ties_and_nan()
    fn = {"method": lambda t: t.argmax(-1) + 0, "function": lambda t: torch.argmax(t, -1) + 0,
          "dim_keyword": lambda t: t.argmax(dim=1) + 0, "float_first": lambda t: t.float().argmax(dim=-1) + 0}[form]
    replaced, gm, out = split_by(fn, x)
    assert replaced == 1 and "two_step_argmax" in gm.code
    assert torch.equal(out, x.argmax(dim=-1))


def test_what_the_pass_leaves_alone():
    x = rows_with_ties_and_nan()
    for fn in (lambda t: t.argmax(0), lambda t: t.argmax(-1, keepdim=True), lambda t: t.argmax(),
               lambda t: t[:, :4096].argmax(-1), lambda t: t[:, :65521].argmax(-1)):
        replaced, gm, out = split_by(fn, x)
        assert replaced == 0 and torch.equal(out, fn(x))


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which(
        "clang++")), reason="Inductor compiles C++ on a CPU")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_backend_splits_the_argmax_of_a_step_and_can_leave_it(monkeypatch, device):
    """Through siblings.backend and Inductor (its C++ kernels on a CPU, Triton's on a GPU): the split argmax
    gives argmax's index, ties and NaN included; with ENABLED off the backend keeps argmax as it is."""
    x = rows_with_ties_and_nan().to(device)
    for enabled, count in ((True, 1), (False, 0)):
        monkeypatch.setattr(wide_argmax, "ENABLED", enabled)
        backend = siblings.backend(f"{device}-argmax-test")
        backend.mode = None
        torch._dynamo.reset()
        out = torch.compile(lambda t: t.float().argmax(dim=-1), backend=backend)(x)
        assert backend.argmaxes[-1] == count and torch.equal(out, x.argmax(dim=-1))


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="Inductor compiles C++ on a CPU")
def test_a_compiled_decode_step_with_a_wide_vocabulary_gives_the_eager_tokens():
    """A greedy compiled decode step (CompiledStep, static rows) of a model with a vocabulary of 32,768: the
    pass cut its argmax into pieces, and the tokens are the eager step's."""
    import transformers

    from minibatch.core.batch import build_batch
    from minibatch.core.buckets import ROW_BUCKETS
    from minibatch.core.requests import Request, SamplingParams
    from minibatch.core.scheduler import Scheduler
    from minibatch.model.model import _TINY_SHAPE
    from minibatch.speed.compiled import CompiledStep

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**_TINY_SHAPE, "vocab_size": 32768}), dtype=torch.float32)
    model = minibatch.load_model(hf, device="cpu")
    cache = model.make_cache(128, 16)
    scheduler = Scheduler(cache.allocator, 4096, 8)
    for i in range(3):
        scheduler.add(Request(i, list(range(1 + i, 9 + 3 * i)), SamplingParams(max_new_tokens=4)))
    plan = scheduler.schedule()
    scheduler.update(plan, model.next_tokens(build_batch(plan, cache, model.kv_bucket), cache).tolist())
    batch = build_batch(scheduler.schedule(), cache, model.kv_bucket, True, ROW_BUCKETS, model.decode_kv_bucket)
    torch._dynamo.reset()
    step = CompiledStep(model, mode="cpu-argmax-step-test")
    step._backend().mode = None  # (a mode of its own: only this test's compiles; Inductor's default options)
    assert torch.equal(step(batch, cache), model.next_tokens(batch, cache))
    assert step.argmaxes == [1]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="Inductor compiles C++ on a CPU")
def test_a_symbolic_row_count_keeps_one_argmax(monkeypatch):
    """A compile whose row count is symbolic (a server's `compile="dynamic"` sampler) keeps argmax as it is
    (the module's docstring says why), and every row count gets argmax's index."""
    x = rows_with_ties_and_nan()
    backend = siblings.backend("cpu-argmax-rows-test")
    backend.mode = None
    torch._dynamo.reset()
    fn = torch.compile(lambda t: t.float().argmax(dim=-1), backend=backend)
    for rows in (3, 5, 10):
        part = x[:rows].clone()
        torch._dynamo.mark_dynamic(part, 0)  # (as CompiledStep marks a dynamic-row batch's logits)
        assert torch.equal(fn(part), x[:rows].argmax(dim=-1)), f"{rows} rows"
    assert backend.argmaxes == [0]  # one compile served every row count, and it kept the argmax
