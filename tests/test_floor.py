"""The bench's floors: the bytes a decode step reads, the FLOPs a prefill does, and the --floor output."""

import json
import subprocess
import sys

import pytest
import torch

from minibatch.tools import floors


@pytest.fixture(scope="module")
def model():
    from minibatch import load_model
    return load_model("random-llama", device="cpu")


def test_decode_floor_counts_weights_and_every_rows_keys(model):
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4  # float32
    assert floors.kv_bytes_per_token(model) == per_token
    w = floors.weight_bytes(model)
    embed = model.hf.get_input_embeddings().weight
    tied = model.hf.get_output_embeddings().weight is embed
    all_params = sum(p.numel() * p.element_size() for p in model.hf.parameters())
    assert w == (all_params if tied else all_params - embed.numel() * embed.element_size())
    bw = 1e9  # bytes/s
    assert floors.decode_floor_ms(model, 0, 0, bw) == pytest.approx(w / bw * 1e3)
    assert floors.decode_floor_ms(model, 8, 100, bw) == pytest.approx((w + 8 * 100 * per_token) / bw * 1e3)
    params = w // 4
    assert floors.prefill_floor_ms(model, 64, 1e12) == pytest.approx(2 * params * 64 / 1e12 * 1e3)


def test_measured_rates_are_plausible():
    bw = floors.measure_bandwidth("cpu", nbytes=2**22, repeats=3)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
    rate = floors.measure_matmul_rate("cpu", torch.float32, n=128, repeats=3)
    assert 1e7 < rate < 1e15


def test_bench_floor_output_and_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minibatch", "bench", "--model", "random-llama", "--device", "cpu",
                        "--num-prompts", "2", "--prompt-len", "4", "--max-new-tokens", "4", "--no-progress",
                        "--floor", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode floor at batch 2, context 6:" in r.stdout and "sync: decode step / floor" in r.stdout
    w = json.load(open(tmp_path / "bench.json"))["workload"]
    assert w["floor_batch"] == 2 and w["floor_context"] == 6
    assert 0 < w["decode_weight_bytes_ms"] < w["decode_floor_ms"]
    assert w["memory_bandwidth_gbs"] > 0 and w["matmul_tflops"] > 0 and w["prefill_floor_ms"] > 0
    assert w["decode_step_over_floor"]["sync"] > 0
