"""The Triton decode kernel (triton_decode.py) against the einsum reference.

On a CPU the kernel runs in Triton's interpreter, which must be switched on before anything imports
triton (torch and transformers do, if it is installed), so from the shell:

    pip install triton && TRITON_INTERPRET=1 python -m pytest tests/test_paged_kernel.py

PyTorch's CPU wheels do not bring Triton, so in CI and on most laptops these tests are skipped.
On a GPU they run the compiled kernel (and tests/test_gpu.py times nothing: scripts/experiments/step_ab.py does).
"""

import os

import pytest
import torch

pytest.importorskip("triton")

import minibatch  # noqa: E402
from decode_tables import LaunchSpy, decode_batch  # noqa: E402
from minibatch.model import triton_decode  # noqa: E402
from minibatch.model.attention import PagedMeta, _decode_attention  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs a GPU, or TRITON_INTERPRET=1 set before pytest starts")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture(scope="module")
def work():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 12, 3, 9, 7, 4, 20, 2)]


def _decode_batch(ctx_lens):
    return decode_batch(ctx_lens, device=DEVICE)


@pytest.mark.parametrize("ctx_lens,window,splits", [
    ([5, 11, 3], None, None), ([17, 2, 9, 30, 1], None, None), ([20, 13], 6, None),
    ([150, 7, 260], None, 3), ([150, 7, 260], None, 2), ([300], 40, 5), ([70, 200], None, None)])
def test_kernel_matches_the_einsum_reference(ctx_lens, window, splits):
    """With and without a split over the keys; a split range may hold no visible key (window, short rows)."""
    cache, batch = _decode_batch(ctx_lens)
    rows, heads, dim = batch.decode_rows, 4, 16
    query = torch.randn(1, heads, rows, dim, device=DEVICE)
    ref = _decode_attention(query, cache.keys[0].index_select(0, batch.kv_indices),
                            cache.values[0].index_select(0, batch.kv_indices), PagedMeta(cache, batch), window, None)
    got = triton_decode.decode_attention(query, cache.keys[0], cache.values[0], batch, window, None, splits)
    assert got.shape == ref.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ctx_lens,splits", [([150, 7, 260, 40], 3), ([70, 200, 9, 31, 5], None)])
def test_the_lean_launch_gives_the_defaults_output(ctx_lens, splits, monkeypatch):
    """At 4-64 rows the kernel runs 2 warps and 2 stages (triton_decode.LEAN): the same output as with
    Triton's defaults (4 and 3), up to float32 rounding, with and without a split over the keys."""
    cache, batch = _decode_batch(ctx_lens)
    assert 4 <= batch.decode_rows <= 64 and triton_decode.warps_stages(batch.decode_rows) == (2, 2)
    query = torch.randn(1, 4, batch.decode_rows, 16, device=DEVICE)
    args = (query, cache.keys[0], cache.values[0], batch, None, None, splits)
    lean = triton_decode.decode_attention(*args)
    monkeypatch.setattr(triton_decode, "LEAN", False)
    assert triton_decode.warps_stages(batch.decode_rows) == (4, 3) == triton_decode.warps_stages(1)
    torch.testing.assert_close(triton_decode.decode_attention(*args), lean, atol=1e-5, rtol=1e-5)


def test_settings_for_every_launch_give_the_same_output(monkeypatch):
    """triton_decode.SETTINGS (keys per loop step, warps, stages for every launch: floor_matrix.py's attn=)
    changes how the keys are walked, not the result: 128 keys a step against the shipped 64."""
    cache, batch = _decode_batch([150, 7, 260, 40])
    query = torch.randn(1, 4, batch.decode_rows, 16, device=DEVICE)
    args = (query, cache.keys[0], cache.values[0], batch, None, None, None)
    shipped = triton_decode.decode_attention(*args)
    seen = []
    monkeypatch.setattr(triton_decode, "_decode_kernel", LaunchSpy(
        triton_decode._decode_kernel, seen, lambda kw: (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])))
    monkeypatch.setattr(triton_decode, "SETTINGS", (128, 4, 2))
    torch.testing.assert_close(triton_decode.decode_attention(*args), shipped, atol=1e-5, rtol=1e-5)
    assert seen == [(128, 4, 2)]


def test_split_count():
    cpu = torch.device("cpu")  # (counts 132 SMs, an H200's, when there is no GPU to ask)
    assert triton_decode.num_splits(128, 8, 2048, cpu) == 1  # 1024 programs already
    assert triton_decode.num_splits(1, 8, 2048, cpu) == 32  # 8 programs: split to fill the SMs
    assert triton_decode.num_splits(1, 8, 128, cpu) == 2  # but never below one chunk of keys
    with pytest.raises(ValueError, match="splits must be"):
        cache, batch = _decode_batch([5])
        triton_decode.decode_attention(torch.zeros(1, 4, batch.decode_rows, 16), cache.keys[0], cache.values[0],
                                       batch, None, None, 0)


def test_generate_with_the_kernel_gives_the_same_tokens(work, monkeypatch):
    random_llama = minibatch.load_model("random-llama", device=DEVICE, dtype=torch.float32)
    kw = dict(max_new_tokens=8, max_batch_tokens=32, block_size=4)
    flat = minibatch.generate(random_llama, work, **kw)
    monkeypatch.setattr(random_llama, "decode_layout", True)
    monkeypatch.setattr(random_llama, "kv_bucket", 8)
    monkeypatch.setattr(random_llama, "decode_attention", "triton")
    for mode in ("sync", "async"):
        assert minibatch.generate(random_llama, work, mode=mode, **kw) == flat


def test_the_kernel_compiles_as_one_opaque_operator():
    """torch.compile sees the kernel as the custom operator `minibatch::paged_decode`: no graph break,
    the same numbers (the CPU half of what CompiledStep relies on; the GPU half is tests/test_gpu.py)."""
    import torch._dynamo

    cache, batch = _decode_batch([150, 7, 260])
    query = torch.randn(1, 4, batch.decode_rows, 16, device=DEVICE)

    def attend(q):
        return triton_decode.decode_attention(q * 1.0, cache.keys[0], cache.values[0], batch, None, None) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")  # a graph break would raise
    torch.testing.assert_close(compiled(query), attend(query), atol=0, rtol=0)
