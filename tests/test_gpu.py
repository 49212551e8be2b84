"""What only a GPU can show: CUDA graphs give the same tokens, and share one memory pool."""

import time

import pytest
import torch

import minibatch
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.buckets import KEY_BUCKETS, TOKEN_BUCKETS
from minibatch.speed.compiled import CompiledStep
from minibatch.tools.floors import pool_memory
from minibatch.core.timeline import Timeline
from minibatch.serving.service import Serving

pytestmark = pytest.mark.cuda


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def test_graphs_same_tokens_as_eager_float32():
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(12, model.vocab_size)
    kw = dict(max_new_tokens=20, max_batch_size=8, max_batch_tokens=64)
    eager = minibatch.generate(model, work, cuda_graphs=False, **kw)
    for mode in ("sync", "async"):
        assert minibatch.generate(model, work, mode=mode, cuda_graphs=True, **kw) == eager
    sampled = dict(temperature=0.8, top_p=0.9, seed=4, **kw)
    assert (minibatch.generate(model, work, mode="async", **sampled)
            == minibatch.generate(model, work, mode="sync", cuda_graphs=False, **sampled))
    # no top-k/top-p: the sampler skips the sort; a top-k as large as the vocabulary filters nothing but
    # takes the sorted path, and must give the same tokens
    unsorted = minibatch.generate(model, work, mode="async", temperature=0.8, seed=4, **kw)
    assert unsorted == minibatch.generate(model, work, mode="sync", cuda_graphs=False, temperature=0.8,
                                          top_k=model.vocab_size, seed=4, **kw)


def test_prefill_and_mixed_steps_are_graphs_too():
    """Prefill and mixed steps are padded to bucketed sizes and replayed as graphs (graphs.pad_flat):
    the same tokens as eager steps in float32, as decode-only graphs ("decode"), and as sync."""
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(12, model.vocab_size, seed=3)
    kw = dict(max_new_tokens=12, max_batch_size=8, max_batch_tokens=48, arrival_steps=[2 * i for i in range(12)])
    eager = minibatch.generate(model, work, cuda_graphs=False, **kw)
    assert minibatch.generate(model, work, cuda_graphs="decode", **kw) == eager
    with minibatch.Engine(model) as engine:
        for mode in ("sync", "async"):
            assert engine.generate(work, mode=mode, cuda_graphs=True, **kw) == eager
        keys = [c["key"] for res in engine.kept.values() for c in res.runner.captures]
    from minibatch.core.batch import LAYOUT_FIELDS  # a graph's key: slot, previous slot, T, K, R, then the layout
    prefill = [k for k in keys if k[5 + LAYOUT_FIELDS.index("padded")]]
    assert prefill and len(prefill) < len(keys)  # graphs of both kinds
    assert all(k[2] in TOKEN_BUCKETS and k[3] in KEY_BUCKETS for k in prefill)


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_decode_attentions_agree_with_the_einsum_reference_float32(attention):
    from minibatch.model import triton_decode

    if attention == "triton" and not triton_decode.available():
        pytest.skip("needs triton")
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    assert model.decode_attention == ("triton" if triton_decode.available() else "sdpa")  # the GPU default
    work = prompts(12, model.vocab_size, seed=3)
    kw = dict(max_new_tokens=20, max_batch_size=8, max_batch_tokens=64)
    model.decode_attention = attention
    fast = minibatch.generate(model, work, mode="async", **kw)
    model.decode_attention = "einsum"
    assert minibatch.generate(model, work, mode="async", **kw) == fast


def test_compiled_decode_steps_give_the_same_tokens():
    """torch.compile'd decode steps (float32): the same tokens as eager; sync and async agree."""
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    work = torch.randint(0, model.vocab_size, (8, 24), generator=g).tolist()  # one decode shape: one compile
    kw = dict(max_new_tokens=16, max_batch_size=8, max_batch_tokens=256)
    eager = minibatch.generate(model, work, cuda_graphs=False, **kw)
    with minibatch.Engine(model) as engine:
        assert engine.generate(work, mode="sync", compile=True, **kw) == eager
        assert engine.generate(work, mode="async", compile=True, **kw) == eager
        # q/k/v and gate/up ran as one product each (siblings.py): 3 of every layer's 7 linear calls merged
        assert max(engine._compiled.merged, default=0) == 3 * model.num_layers
    unmerged = CompiledStep(model, merge=False)
    with minibatch.Engine(model) as engine:
        engine._compiled = unmerged
        assert engine.generate(work, mode="async", compile=True, **kw) == eager
    assert unmerged.shapes  # it compiled, through torch.compile's own Inductor backend


def small_qwen3_run(seed, lengths=(5, 17, 9, 30), name="random-qwen3"):
    """A random Qwen3 on the GPU (float32; `name`'s shape), four prompts (of 5-30 tokens unless `lengths`
    says), the run's options, and its eager tokens: what the tests of a compiled step's switches below
    compare against."""
    model = minibatch.load_model(name, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    work = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    kw = dict(max_new_tokens=12, max_batch_size=4, max_batch_tokens=256)
    return model, work, kw, minibatch.generate(model, work, cuda_graphs=False, **kw)


def compiled_runs_give(tokens, model, work, kw, modes=("sync", "async")):
    """Compiled runs of `work` (one engine, each mode in turn) give `tokens`; -> that engine's CompiledStep."""
    with minibatch.Engine(model) as engine:
        for mode in modes:
            assert engine.generate(work, mode=mode, compile=True, **kw) == tokens, mode
    return engine._compiled


def test_the_carry_over_as_one_compiled_kernel_gives_the_same_tokens(monkeypatch):
    """compiled.CARRY_OVER: every step's carry-over through a compiled kernel of its own (inside the steps'
    CUDA graphs); async runs carry a token over in every decode step: the eager tokens, sync and async."""
    from minibatch.speed import compiled

    monkeypatch.setattr(compiled, "CARRY_OVER", True)
    model, work, kw, eager = small_qwen3_run(8)
    assert compiled_runs_give(eager, model, work, kw).carry_over is not None


def fresh_of_each_launch(monkeypatch) -> list:
    """A list that gets, for each launch of the Triton decode kernel from now on, its `fresh` argument (None:
    the layers' own q/k/v path)."""
    from minibatch.model import triton_decode

    launches = []
    real_launch = triton_decode.launch
    monkeypatch.setattr(triton_decode, "launch",
                        lambda *a, **k: launches.append(k.get("fresh")) or real_launch(*a, **k))
    return launches


def test_the_fresh_path_gives_the_eager_tokens_compiled_or_not(monkeypatch):
    """model/fresh.py (ENABLED): decode steps hand the projections' q/k/v to the Triton decode kernel, which
    norms, rotates and caches them itself: the tokens of the layers' own forward (float32, Qwen3's q/k
    norms), eager and compiled, sync and async; the kernel ran with FRESH."""
    from minibatch.model import fresh, triton_decode

    if not triton_decode.available():
        pytest.skip("needs triton")
    model, work, kw, own = small_qwen3_run(11)
    assert fresh.install(model.hf) == model.num_layers
    launches = fresh_of_each_launch(monkeypatch)
    monkeypatch.setattr(fresh, "ENABLED", True)
    assert minibatch.generate(model, work, cuda_graphs=False, **kw) == own
    assert launches and all(f is not None for f in launches)
    compiled_runs_give(own, model, work, kw)


def test_a_small_models_compiled_step_takes_the_fresh_path_by_default(monkeypatch):
    """model/fresh.py's rule (IN_SMALL_COMPILES): a small model's static-row compiled steps hand q/k/v to the
    decode kernel, its eager steps keep the layers' own forward: the same tokens, sync and async."""
    from minibatch.model import fresh, triton_decode

    if not triton_decode.available():
        pytest.skip("needs triton")
    model, work, kw, own = small_qwen3_run(12)
    launches = fresh_of_each_launch(monkeypatch)
    compiled_runs_give(own, model, work, kw)
    assert any(f is not None for f in launches) and not fresh.ENABLED
    launches.clear()
    assert minibatch.generate(model, work, cuda_graphs=False, **kw) == own
    assert launches and all(f is None for f in launches)


@pytest.mark.parametrize("apart", [True, False])
def test_the_fresh_path_with_split_keys_gives_the_eager_tokens(apart, monkeypatch):
    """fresh.py's path on rows whose keys are split, the new key on a program of its own
    (triton_decode.NEW_KEY_APART) or the first split's: the eager tokens of the layers' own forward, eager and
    compiled, sync and async."""
    from minibatch.model import fresh, triton_decode

    if not triton_decode.available():
        pytest.skip("needs triton")
    model, work, kw, own = small_qwen3_run(14, lengths=(150, 17, 90, 230))  # (long enough to split their keys)
    fresh.install(model.hf)
    monkeypatch.setattr(fresh, "ENABLED", True)
    monkeypatch.setattr(triton_decode, "NEW_KEY_APART", apart)
    splits = []
    real_split_keys = triton_decode.split_keys

    def counted_split_keys(*args):
        out = real_split_keys(*args)
        splits.append(out[1])
        return out

    monkeypatch.setattr(triton_decode, "split_keys", counted_split_keys)
    assert minibatch.generate(model, work, cuda_graphs=False, **kw) == own
    assert minibatch.generate(model, work, **kw) == own
    torch._dynamo.reset()
    compiled_runs_give(own, model, work, kw)
    assert max(splits) > 1


@pytest.mark.parametrize("rows", [1, 4])
def test_the_skinny_settings_of_the_small_models_products_give_the_eager_tokens(rows, monkeypatch):
    """The 0.6B shape's attention output (K = 2048, in one piece: skinny.ONE_PIECE), down product (K = 3072,
    summed once after the loop at 2-4 rows: skinny.DEFER) and merged q/k/v (4096 x 1024: skinny.SHORT_K, on
    tensor cores at 2-4 rows) on skinny.py's kernel inside compiled steps, in a two-layer model of those
    widths (float32): the eager tokens, sync and async, and the kernel took them."""
    from minibatch.model import model as model_module
    from minibatch.speed import skinny

    shape = dict(model_module.RANDOM_CONFIGS["qwen3-0.6b-shape"][1], vocab_size=512, num_hidden_layers=2)
    monkeypatch.setitem(model_module.RANDOM_CONFIGS, "qwen3-0.6b-widths", ("Qwen3Config", shape))
    taken = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda x, w, y, setting, *a, **k: taken.append((*w.shape, setting))
                        or real_launch(x, w, y, setting, *a, **k))
    model, work, kw, eager = small_qwen3_run(16, lengths=(5, 17, 9, 30)[:rows], name="qwen3-0.6b-widths")
    torch._dynamo.reset()
    compiled_runs_give(eager, model, work, kw)
    assert any(k == 2048 and s["block_k"] == 2048 for _, k, s in taken)
    assert (rows > 1) == any(k == 3072 and s.get("defer") for _, k, s in taken)
    assert any((n, k) == (4096, 1024) and s.get("dot", False) == (rows > 1) for n, k, s in taken)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_gated_mlp_inside_the_skinny_kernel_gives_the_eager_tokens(rows, monkeypatch):
    """speed/gated.py (ENABLED and MANY_ROWS, the defaults): silu(gate) * up inside skinny.py's gate/up product, in a two-layer model of
    the 0.6B shape's widths (float32): the eager tokens, sync and async, and the kernel took every layer's."""
    from minibatch.model import model as model_module
    from minibatch.speed import gated, skinny

    shape = dict(model_module.RANDOM_CONFIGS["qwen3-0.6b-shape"][1], vocab_size=512, num_hidden_layers=2)
    monkeypatch.setitem(model_module.RANDOM_CONFIGS, "qwen3-0.6b-widths", ("Qwen3Config", shape))
    monkeypatch.setattr(gated, "ENABLED", True)
    monkeypatch.setattr(gated, "MANY_ROWS", True)  # (2-8 rows: on tensor cores, float32 tiles in 2 stages)
    ups = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda *a, **k: ups.append(k.get("up")) or real_launch(*a, **k))
    model, work, kw, eager = small_qwen3_run(17, lengths=(5, 17, 9, 30)[:rows], name="qwen3-0.6b-widths")
    torch._dynamo.reset()
    compiled_runs_give(eager, model, work, kw)
    assert shape["intermediate_size"] in ups


def test_compiled_steps_of_few_rows_run_the_skinny_kernel_with_the_eager_tokens(monkeypatch):
    """Decode steps of 1-4 rows: the compiled step sends its narrow products (all of them in this small
    model) to speed/skinny.py's operator, which launches the kernel, and gives the eager tokens
    (float32); sync and async agree; with skinny=False the kernel never runs and the tokens are the same."""
    from minibatch.speed import skinny

    from minibatch.speed import gated

    monkeypatch.setattr(gated, "ENABLED", False)  # (the gate/up product stays a plain one: tests/test_gated.py)
    launches = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda *a: launches.append(a[3]) or real_launch(*a))
    model = minibatch.load_model("random-qwen3", device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    work = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
    kw = dict(max_new_tokens=12, max_batch_size=4, max_batch_tokens=256)
    eager = minibatch.generate(model, work, cuda_graphs=False, **kw)
    assert not launches
    with minibatch.Engine(model) as engine:
        before = len(CompiledStep(model).routed)  # (one record for every compile of these options, per process)
        assert engine.generate(work, mode="sync", compile=True, **kw) == eager
        assert engine._compiled.skinny
        assert engine.generate(work, mode="async", compile=True, **kw) == eager
        # per compile: every product of a layer (merged q/k/v and gate/up are 128 and 256 columns wide in this
        # model: narrow enough for the kernel's rule too), and the LM head (512 columns)
        routed = engine._compiled.routed[before:]
        assert routed and set(routed) == {4 * model.num_layers + 1}
    # the kernel ran (in the warm-up and capture calls; a graph's replays launch it without Python)
    assert launches and all(s == skinny.settings(1, 64, 64) for s in launches)
    launches.clear()
    plain = CompiledStep(model, skinny=False)
    with minibatch.Engine(model) as engine:
        engine._compiled = plain
        assert engine.generate(work, mode="async", compile=True, **kw) == eager
    assert plain.shapes and not launches


def test_kernels_launched_early_give_the_same_tokens(monkeypatch):
    """Programmatic dependent launch (speed/early.py: Inductor's triton.enable_pdl, and our kernels inside
    the compiled step's calls): each kernel may start before the one it reads from has finished, and must
    wait for it before reading. A missing wait would read half-written activations or keys; the tokens
    must be the eager ones (float32), sync and async. (The default step also combines small kernels,
    compiled.COMBO: the same tokens are asked of it.)"""
    from minibatch.speed import early, skinny

    if not early.has_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    if not early.inductor_options(torch.device("cuda")):
        pytest.skip("this torch's Inductor has no triton.enable_pdl")
    launched_early = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda *a, **k: launched_early.append(early.wanted()) or real_launch(*a, **k))
    model = minibatch.load_model("random-qwen3", device="cuda", dtype=torch.float32)
    assert model.decode_attention == "triton"
    g = torch.Generator().manual_seed(7)
    work = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    kw = dict(max_new_tokens=24, max_batch_size=4, max_batch_tokens=256)
    eager = minibatch.generate(model, work, cuda_graphs=False, **kw)
    from minibatch.speed.compiled import COMBO

    step = CompiledStep(model)
    assert step.inductor == {"triton.enable_pdl": True, **COMBO}  # (the default on such a GPU, static rows)
    assert CompiledStep(model, dynamic_rows=True).inductor == {"triton.enable_pdl": True}
    with minibatch.Engine(model) as engine:
        engine._compiled = step
        assert engine.generate(work, mode="sync", compile=True, **kw) == eager
        assert engine.generate(work, mode="async", compile=True, **kw) == eager
    assert step.shapes and launched_early and all(launched_early)


def test_a_kernel_launched_early_waits_for_the_one_before():
    """Two of skinny.py's products in a row inside a CUDA graph, launched early: the second is launched
    while the first still runs (the first lets it launch after its main loop) and must wait before
    reading the first one's output. Same result as the two products one after the other (float32)."""
    from minibatch.speed import early, skinny

    if not early.has_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 1024, device="cuda", generator=g)
    w1, w2 = (torch.randn(1024, 1024, device="cuda", generator=g) / 32 for _ in range(2))
    setting = dict(skinny.settings(1, 1024, 1024), pdl=True)
    mid, out = torch.empty(1, 1024, device="cuda"), torch.empty(1, 1024, device="cuda")

    def chain():
        skinny.launch(x, w1, mid, setting)
        skinny.launch(mid, w2, out, setting)

    chain()  # (compiles the kernel before capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(20):
        x.normal_(generator=g)
        graph.replay()
        want = torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)
        assert torch.allclose(out, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("rows, n, k", [(1, 1024, 2048), (2, 1024, 3072), (4, 1024, 3072), (1, 2048, 8192)])
def test_the_skinny_kernel_in_bf16_at_a_small_models_shapes(rows, n, k, early, monkeypatch):
    """skinny_linear where it runs the kernel (the 0.6B and 1B shapes' narrow products), bf16 as real
    models run: within bf16 rounding of F.linear, for a 3-D input whose rows are a slice of a wider tensor;
    with the early-launch variant of the kernel (compiled where the GPU has it) or without."""
    import contextlib

    from minibatch.speed import early as early_launch
    from minibatch.speed import skinny

    assert skinny.settings(rows, n, k) is not None
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(1, rows, k + 64, device="cuda", dtype=torch.bfloat16, generator=g)[..., :k]  # rows strided
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    with early_launch.inside() if early else contextlib.nullcontext():
        got = torch.ops.minibatch.skinny_linear(x, w)
    want = torch.nn.functional.linear(x, w)
    assert got.shape == want.shape == (1, rows, n)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_one_compile_serves_every_context_length_with_the_triton_attention():
    """With the Triton attention the keys' length is dynamic in the compiled step: contexts that cross
    several key buckets compile once per row count, and sync and async still agree in bf16."""
    from minibatch.model import triton_decode

    if not triton_decode.available():
        pytest.skip("needs triton")
    model = minibatch.load_model("random-llama", device="cuda")
    g = torch.Generator().manual_seed(6)
    work = torch.randint(0, model.vocab_size, (8, 40), generator=g).tolist()
    kw = dict(max_new_tokens=150, max_batch_size=8, max_batch_tokens=512, temperature=0.0)
    from torch._dynamo.utils import counters

    engine = minibatch.Engine(model)
    before = counters["stats"]["unique_graphs"]
    sync = engine.generate(work, mode="sync", compile=True, **kw)  # contexts 40 -> 190: four 64-key buckets
    compiled = engine._compiled
    assert compiled.dynamic_keys and {s[1] for s in compiled.shapes} == {None}
    rows = {s[0] for s in compiled.shapes}
    assert counters["stats"]["unique_graphs"] - before == len(rows)  # one compile per row count
    assert engine.generate(work, mode="async", compile=True, **kw) == sync
    assert counters["stats"]["unique_graphs"] - before == len(rows)
    engine.close()


def test_a_dynamic_rows_compile_serves_every_batch_size_once():
    """compile="dynamic" (what a server runs): requests arriving step by step take the batch through
    several row buckets, all served by one compile; sync and async agree in bf16."""
    from torch._dynamo.utils import counters

    model = minibatch.load_model("random-llama", device="cuda")
    work = prompts(10, model.vocab_size, seed=8)
    kw = dict(max_new_tokens=24, max_batch_size=16, max_batch_tokens=512, temperature=0.0,
              arrival_steps=[0, 2, 4, 6, 8, 10, 12, 14, 16, 18])
    engine = minibatch.Engine(model)
    before = counters["stats"]["unique_graphs"]
    sync = engine.generate(work, mode="sync", compile="dynamic", **kw)
    compiled = engine._compiled
    assert compiled.dynamic_rows and {s[0] for s in compiled.shapes} == {None}
    (resources,) = engine.kept.values()
    rows = {c["key"][5] for c in resources.runner.captures} - {0}  # decode_rows (slots.bound_args' key)
    assert len(rows) >= 4 and 1 not in rows  # several batch sizes; a single row is padded to two
    # one compile of the forward and one of the (greedy) sampler for all of them
    assert counters["stats"]["unique_graphs"] - before == 2
    assert engine.generate(work, mode="async", compile="dynamic", **kw) == sync
    assert counters["stats"]["unique_graphs"] - before == 2
    # one request at a time: its single row is padded to two, and the IO slots have room for them
    one = dict(kw, max_batch_size=1, arrival_steps=None)
    assert engine.generate(work[:2], mode="async", compile="dynamic", **one) == \
        engine.generate(work[:2], mode="sync", compile="dynamic", **one)
    engine.close()


def test_a_dynamic_rows_compile_samples_with_top_k_and_top_p_at_a_real_vocabulary_size():
    """With a symbolic row count, torch 2.11's Inductor could not generate the top-k/top-p sampler's
    kernels for a 128256-entry vocabulary (its cumulative sum is a split scan), and a server's warm-up
    failed on it: the forward is compiled apart and such batches sample eagerly (speed/compiled.py).
    Every sampling variant, in one engine, as a server's warm-up submits them; sync and async agree."""
    import transformers

    from minibatch.model.model import _TINY_SHAPE

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**_TINY_SHAPE, "vocab_size": 128256})
    with torch.device("cuda"):
        model = minibatch.load_model(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    work = prompts(6, model.vocab_size, seed=3)
    variants = (dict(temperature=0.0), dict(temperature=0.9), dict(temperature=0.9, top_k=20),
                dict(temperature=0.9, top_p=0.8))
    engine = minibatch.Engine(model)
    with Serving(engine, max_batch_size=4, compile=True) as server:
        assert engine._compiled.dynamic_rows  # what serving makes of compile=True on a GPU
        for v in variants:
            assert len(server.submit(work[0], max_new_tokens=4, seed=0, **v).wait().token_ids) == 4, v
    for v in variants:
        kw = dict(max_new_tokens=8, max_batch_size=8, max_batch_tokens=256, seed=1, **v)
        assert engine.generate(work, mode="async", compile="dynamic", **kw) == \
            engine.generate(work, mode="sync", compile="dynamic", **kw), v
    engine.close()


def test_bf16_sync_and_async_with_graphs_agree():
    """bf16: sync and async replay the same graphs on the same shapes, so they agree exactly.

    (A bf16 graph run and a bf16 eager run need not: cuBLAS may pick other kernels while capturing, and
    a random-weight model's near-flat logits turn that rounding into different argmaxes, so a request
    can diverge after a few tokens. Exact parity across kernels is checked in float32 above.)
    """
    model = minibatch.load_model("llama3-1b-shape", device="cuda", dtype=torch.bfloat16)
    work = prompts(12, model.vocab_size)
    kw = dict(max_new_tokens=20, max_batch_size=8, max_batch_tokens=64, cuda_graphs=True)
    assert minibatch.generate(model, work, mode="async", **kw) == minibatch.generate(model, work, mode="sync", **kw)


def test_varlen_flat_attention_matches_the_masked_one():
    """bf16 flat steps take FlashAttention's varlen kernel (attention.py): a mixed step (decode rows, the end
    of a chunked prompt) gives the masked SDPA's logits to bf16 rounding; padded to buckets as well, eagerly and
    as a CUDA graph replayed on another step's inputs (other tokens, other cache cells, the same padded shape)."""
    import dataclasses

    from minibatch.core.graphs import StepRunner, pad_flat
    from minibatch.core.scheduler import Scheduler

    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.bfloat16)
    assert model.flat_attention == "varlen"
    cache = model.make_cache(64, 16)
    runner = StepRunner(model, cache)

    def mixed_step(seed: int):  # 40 + 7 + 17 of 30 tokens (a chunked prompt), then its mixed step
        sched = Scheduler(cache.allocator, 64, 8)
        for i, n in enumerate([40, 7, 30]):
            sched.add(Request(i, [(5 * i + j + seed) % 200 + 1 for j in range(n)], SamplingParams(max_new_tokens=8)))
        plan = sched.schedule()
        sched.update(plan, model.next_tokens(runner.build(plan).to("cuda"), cache).tolist())
        mixed = runner.build(sched.schedule())  # two decode rows and the prompt's last 13 tokens
        assert not mixed.decode_rows and mixed.num_sampled == 3 and mixed.num_tokens == 15
        padded = pad_flat(mixed, cache.scratch_cell, TOKEN_BUCKETS, KEY_BUCKETS, 8, 4096, 8192)
        assert padded.padded and padded.num_tokens > mixed.num_tokens
        return mixed, padded

    def masked(batch):
        model.flat_attention = "sdpa"
        try:
            return model.logits(batch.to("cuda"), cache).float()
        finally:
            model.flat_attention = "varlen"

    mixed, padded = mixed_step(0)
    got = {"sdpa": masked(mixed), "varlen": model.logits(mixed.to("cuda"), cache).float(),
           "padded": model.logits(padded.to("cuda"), cache).float()[:3]}
    from minibatch.model import attention  # the padded path of the kernel itself, on a padded batch's layer inputs
    q = torch.randn(1, 32, padded.num_tokens, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(padded.kv_indices.shape[0], 8, 64, device="cuda", dtype=torch.bfloat16)
    out = attention._varlen_attention(q, k, k, attention.PagedMeta(cache, padded.to("cuda")), None, None)
    assert torch.isfinite(out).all() and (out[0, mixed.num_tokens:] == 0).all()
    scale = got["sdpa"].abs().max().item()
    for kind in ("varlen", "padded"):
        assert torch.isfinite(got[kind]).all() and (got[kind] - got["sdpa"]).abs().max().item() < 0.05 * scale, kind

    captured = padded.to("cuda")  # the graph's inputs: a later step's are copied into them
    model.logits(captured, cache)  # warm-up outside the capture, as graphs.StepRunner does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = model.logits(captured, cache)
    mixed2, padded2 = mixed_step(7)
    assert not torch.equal(padded2.cell_mapping, padded.cell_mapping)  # other cells: the graph reads them as data
    want = masked(mixed2)
    new = padded2.to("cuda")
    for f in dataclasses.fields(new):
        a, b = getattr(captured, f.name), getattr(new, f.name)
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape, f.name
            a.copy_(b)
    graph.replay()
    got = graphed.float()[:3]
    assert torch.isfinite(got).all() and (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert (got - masked(mixed)).abs().max().item() > 0.05 * scale  # (the replay did not give the first step back)


def test_async_matches_hf_generate_on_gpu():
    model = minibatch.load_model("random-qwen3", device="cuda", dtype=torch.float32)
    work = prompts(6, model.vocab_size, seed=1)
    outs = minibatch.generate(model, work, max_new_tokens=12, mode="async", max_batch_size=4, max_batch_tokens=32)
    for p, o in zip(work, outs):
        ref = model.hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref


def test_races_on_gpu():
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(4, model.vocab_size, seed=2)
    kw = dict(max_new_tokens=6, max_batch_tokens=64, cuda_graphs=False)
    ref = minibatch.generate(model, work, mode="sync", **kw)
    for stage in ("H2D", "compute"):
        bad = minibatch.generate(model, work, mode="async", num_slots=1, allow_races=True,
                                 inject_delays={stage: 0.05}, **kw)
        assert bad != ref
        assert minibatch.generate(model, work, mode="async", inject_delays={stage: 0.05}, **kw) == ref


def test_shared_pool_costs_about_one_graph():
    model = minibatch.load_model("llama3-1b-shape", device="cuda")
    shared = pool_memory(model, rows=16, context=256, shared=True)
    separate = pool_memory(model, rows=16, context=256, shared=False)
    print(f"\npool growth per capture (bytes): shared {shared}, separate {separate}")
    # (the first separate capture's growth can be negative: the allocator may release cached blocks
    # as the capture begins; the printed numbers are in BENCHMARKS.md, CUDA graphs in one memory pool)
    assert separate[1] > 0.5 * shared[0]  # a second private pool costs about as much as one graph
    assert shared[1] < 0.25 * shared[0]  # in the shared pool the second graph costs little


def test_device_clock_spans_on_gpu():
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    tl = Timeline()
    minibatch.generate(model, prompts(4, model.vocab_size), max_new_tokens=8, mode="async", timeline=tl)
    lanes = {s.lane for s in tl.spans}
    assert {"CPU", "H2D", "compute", "D2H"} <= lanes and 0 < tl.device_busy() <= 1


@pytest.mark.parametrize("extras", [None, "logprobs", "penalties"])
def test_the_loops_make_no_implicit_host_sync(monkeypatch, extras):
    """Both loops, eager and with graphs, with prefill steps and requests arriving mid-run, under
    torch.cuda.set_sync_debug_mode("error"): only the loop's one intended wait (d2h_done) may sync.
    With "logprobs", every request also asks for its tokens' and its prompt's logprobs (sampling.logprobs)
    and holds an end id back for its first eight tokens (min_tokens); with "penalties", every other
    request has all three penalties on (penalties.py) and sync and async agree."""
    from minibatch.devices.cuda import CudaEvent

    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(6, model.vocab_size, seed=6)
    arrivals = [0, 2, 4, 6, 9, 12]
    real_sync = CudaEvent.synchronize

    def intended_wait(self, timeout=None):  # the one wait the loops make, outside the check
        torch.cuda.set_sync_debug_mode(0)
        try:
            real_sync(self, timeout)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    logprobs = 5 if extras == "logprobs" else None
    asks = dict(logprobs=logprobs, prompt_logprobs=logprobs)
    if logprobs:  # (with logprobs also min_tokens: an end id held back for eight tokens, sampling.choose)
        asks.update(min_tokens=8, eos_token_id=model.vocab_size - 1)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=16, **asks, **(penalties if extras == "penalties" and i % 2 else {}))

    outputs = {}
    for graphs in (True, False):
        with minibatch.Engine(model) as engine:
            for mode in ("sync", "async"):
                kw = dict(max_batch_size=4, max_batch_tokens=32, cuda_graphs=graphs)
                warm = [Request(i, p, params(i), arrival_step=a) for i, (p, a) in enumerate(zip(work, arrivals))]
                engine.start(warm, mode, **kw)  # warm-up: captures, loads
                while engine.has_work():
                    engine.step()
                engine.finish()
                ref = [r.output for r in warm]
                requests = [Request(i, p, params(i), arrival_step=a) for i, (p, a) in enumerate(zip(work, arrivals))]
                engine.start(requests, mode, **kw)
                monkeypatch.setattr(CudaEvent, "synchronize", intended_wait)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    while engine.has_work():
                        engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    monkeypatch.undo()
                engine.finish()
                assert [r.output for r in requests] == ref
                outputs[graphs, mode] = ref
                if logprobs:
                    assert all(len(r.logprobs) == len(r.output) and len(r.prompt_logprobs) == len(r.prompt) - 1
                               for r in requests)
    if extras == "penalties":  # float32: the loops and graphs agree token for token
        assert outputs[True, "sync"] == outputs[True, "async"] == outputs[False, "sync"] == outputs[False, "async"]


def test_logprobs_on_the_gpu_match_the_model_with_graphs():
    """Decode steps with logprobs are CUDA graphs (their own shapes); prompt scoring steps stay eager. Both
    agree with Hugging Face's forward in float32, and greedy tokens are each row's top-1."""
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(4, model.vocab_size, seed=3)
    requests = [Request(i, p, SamplingParams(max_new_tokens=12, logprobs=4, prompt_logprobs=2)) for i, p in enumerate(work)]
    with minibatch.Engine(model) as engine:
        engine.start(requests, "async", max_batch_size=4, max_batch_tokens=16, cuda_graphs=True)
        while engine.has_work():
            engine.step()
        engine.finish()
        assert engine.run is None and any(engine.kept[s].runner.graphs for s in engine.kept)
    for r in requests:
        ids = r.prompt + r.output
        with torch.no_grad():
            ref = torch.log_softmax(model.hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1).cpu()
        got = [t.logprob for t in r.prompt_logprobs + r.logprobs]
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert got == pytest.approx(want, abs=2e-3)
        assert all(t.top[0][0] == t.token for t in r.logprobs)


@pytest.mark.parametrize("name", ["random-llama", "random-qwen2", "random-qwen3", "random-mistral"])
def test_a_float32_model_given_to_load_model_keeps_float32_and_matches_its_generate(name):
    import transformers

    from minibatch.model.model import RANDOM_CONFIGS

    cls_name, kwargs = RANDOM_CONFIGS[name]
    torch.manual_seed(7)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs),
                                                           dtype=torch.float32)
    work = prompts(4, hf.config.vocab_size, seed=8)
    refs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in work]  # before load_model touches it
    model = minibatch.load_model(hf)  # no dtype, no device: it keeps float32, on its GPU
    assert model.dtype == torch.float32 and model.device.type == "cuda"
    for mode in ("sync", "async"):
        assert minibatch.generate(model, work, max_new_tokens=10, mode=mode, max_batch_size=4,
                                  max_batch_tokens=32) == refs


def test_the_cpu_device_runs_as_threads_once_cuda_has_started():
    """A forked child cannot touch CUDA again: after this process has used its GPU, get_device("cpu")
    gives the thread emulation (same semantics), and says so."""
    import minibatch.devices as device

    torch.zeros(1, device="cuda")
    with pytest.warns(UserWarning, match="runs as cpu-threads"):
        d = device.get_device("cpu")
    with d:
        assert d.kind == "cpu-threads"
        x = d.empty((1,), torch.int64).fill_(1)
        d.stream("a").launch(x.add_, 2)
        d.synchronize(timeout=10)
        assert x.tolist() == [3]


@pytest.mark.parametrize("graphs", ["decode", True], ids=["decode-graphs", "all-graphs"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_graphs_captured_at_start_up_serve_every_step(mode, graphs):
    """Serving(capture_up_to=N) captures the decode graphs of requests up to N tokens before the first
    request (with cuda_graphs=True the prefill and mixed steps' too, on the coarse buckets): then
    requests within N tokens, greedy and sampled, capture nothing more, and give the tokens they give
    offline."""
    from minibatch.speed.startup_graphs import flat_buckets

    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.float32)
    work = prompts(6, model.vocab_size, seed=3)  # prompts of 1-39 tokens, 20 new: within 64
    kw = dict(max_batch_size=4, max_batch_tokens=64, cuda_graphs=graphs)
    with minibatch.Engine(model) as engine:
        seen, serving = [], Serving(engine, mode, capture_up_to=64, **kw)
        serving.capture_progress = lambda *a: seen.append(a)
        with serving as server:
            started = server.stats()
            streams = [server.submit(p, max_new_tokens=20, temperature=0.8 * (i % 2), seed=i) for i, p in enumerate(work)]
            outs = [s.wait(60).token_ids for s in streams]
            stats = server.stats()
            runner = engine.run.runner
            flat = [c["key"] for c in runner.captures if not c["key"][5]]  # (the layout's decode_rows: 0)
    pairs = 1 if mode == "sync" else 2
    rows, widths = 3, 64 // model.decode_kv_bucket  # row buckets 1, 2, 4 (max_batch_size 4)
    # 64 tokens (the budget), 1024 keys: the smallest coarse buckets; async: also after none (an idle loop's)
    flat_shapes = (1 if mode == "sync" else 4) if graphs is True else 0
    assert started["startup_graph_captures"] == started["graph_captures"] == (pairs * rows * widths + flat_shapes) * 2
    assert stats["graph_captures"] == started["graph_captures"], (started, stats)  # nothing captured on the way
    assert seen[-1] == (started["startup_graph_captures"],) * 2 and len(seen) == seen[-1][0]
    if graphs is True:
        assert runner.flat_buckets == flat_buckets(*runner.capacity[:2])
        assert {k[2:5] for k in flat} == {(64, 1024, 4)}
    for i, (p, out) in enumerate(zip(work, outs)):
        assert out == minibatch.generate(model, [p], max_new_tokens=20, temperature=0.8 * (i % 2), seed=i,
                                         cuda_graphs=False)[0]


def test_flat_graphs_captured_at_start_up_with_the_varlen_kernel():
    """The same in bfloat16, where flat steps take FlashAttention's varlen kernel: a capture whose chunks
    are all empty (the padding batch) must run, and then serve every flat step of an 8B-like serving mix
    (prompts arriving while others decode) without another capture."""
    model = minibatch.load_model("random-llama", device="cuda", dtype=torch.bfloat16)
    assert model.flat_attention == "varlen"
    work = prompts(8, model.vocab_size, seed=5)
    with minibatch.Engine(model) as engine:
        with Serving(engine, "async", capture_up_to=128, cuda_graphs=True, max_batch_size=4,
                     max_batch_tokens=96) as server:
            started = server.stats()
            streams = []
            for i, p in enumerate(work):
                streams.append(server.submit(p, max_new_tokens=24, eos_token_id=None))
                time.sleep(0.01)  # (arrivals spread over the others' decoding: mixed steps)
            outs = [s.wait(60).token_ids for s in streams]
            stats = server.stats()
            kinds = {bool(c["key"][5]) for c in engine.run.runner.captures}
    assert kinds == {True, False}  # decode graphs and flat graphs
    assert stats["graph_captures"] == started["graph_captures"] == started["startup_graph_captures"], (started, stats)
    assert [len(o) for o in outs] == [24] * len(work)
