"""The command line: the demo (the README's main job) and bench run end to end; bad flags get clear errors."""

import json
import subprocess
import sys

import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "minibatch", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_demo_writes_table_and_figure(tmp_path):
    r = run("demo", "--device", "cpu", "--max-new-tokens", "6", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "sync" in r.stdout
    assert (tmp_path / "demo_timeline.png").stat().st_size > 5000
    events = json.load(open(tmp_path / "demo_trace.json"))["traceEvents"]
    runs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert runs == {"sync", "async"}  # both runs, one trace
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_bench_writes_json(tmp_path):
    r = run("bench", "--model", "random-llama", "--device", "cpu", "--num-prompts", "3", "--prompt-len", "5",
            "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    data = json.load(open(tmp_path / "bench.json"))
    res = data["results"][0]
    assert res["mode"] == "sync" and res["new_tokens"] == 12 and 0 < res["device_busy"] <= 1
    assert data["environment"]["torch"]


def test_bad_flags_are_named():
    r = run("demo", "--modes", "turbo")
    assert r.returncode != 0 and "unknown mode 'turbo'" in r.stderr
    r = run("bench", "--model", "gpt-17", "--device", "cpu")
    assert r.returncode == 2 and "unknown model 'gpt-17'" in r.stderr
    r = run("bench", "--modes", ",")
    assert r.returncode != 0 and "at least one" in r.stderr
    r = run("demo", "--model", "random-llama", "--device", "cpu")
    assert r.returncode == 2 and "has no tokenizer" in r.stderr


def test_bench_beside_transformers_and_the_floor(tmp_path):
    r = run("bench", "--model", "random-llama", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "4",
            "--max-new-tokens", "3", "--no-progress", "--hf", "--floor", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "hf: 2/2 requests with the same tokens as sync" in r.stdout  # float32: transformers agrees
    data = json.load(open(tmp_path / "bench.json"))
    assert [x["mode"] for x in data["results"]] == ["sync", "hf"]
    assert data["workload"]["weight_floor_ms"] > 0
    assert "fastest minibatch mode sync" in r.stdout and "fastest transformers mode hf" in r.stdout


def test_compile_modes_need_a_gpu():
    r = run("bench", "--model", "random-llama", "--device", "cpu", "--modes", "sync,async+compile", "--no-progress")
    assert r.returncode == 2 and "+compile modes need a CUDA model" in r.stderr
    r = run("bench", "--modes", "async+turbo")
    assert r.returncode != 0 and "unknown mode 'async+turbo'" in r.stderr


def test_triton_attention_without_triton_is_named():
    from minibatch import triton_decode
    if triton_decode.available():
        pytest.skip("triton is installed here")
    r = run("bench", "--model", "random-llama", "--device", "cpu", "--decode-attention", "triton", "--no-progress")
    assert r.returncode == 2 and "needs the triton package" in r.stderr
    r = run("bench", "--modes", "async+turbo")
    assert r.returncode != 0 and "unknown mode 'async+turbo'" in r.stderr
