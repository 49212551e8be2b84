"""The command line: the demo (the README's main job) and bench run end to end; bad flags get clear errors."""

import json
import subprocess
import sys

import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "minibatch", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def run_here(capsys, *args):
    """The CLI's main() in this process: (exit status, stdout, stderr) as a subprocess would give them,
    without a fresh interpreter's seconds of imports (the demo test runs the real entry point)."""
    from minibatch.tools.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:  # argparse and main() report bad input by SystemExit, as the real exit does
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_writes_table_and_figure(tmp_path):
    r = run("demo", "--device", "cpu", "--max-new-tokens", "6", "--pairs", "3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "sync" in r.stdout
    assert "wall time async / sync over 3 alternating pairs: median" in r.stdout
    assert "every pair gave the same tokens" in r.stdout
    assert (tmp_path / "demo_timeline.png").stat().st_size > 5000
    events = json.load(open(tmp_path / "demo_trace.json"))["traceEvents"]
    runs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert runs == {"sync", "async"}  # both runs, one trace
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_bench_writes_json(tmp_path, capsys):
    code, _, err = run_here(capsys, "bench", "--model", "random-llama", "--device", "cpu", "--num-prompts", "3",
                            "--prompt-len", "5", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path))
    assert code == 0, err
    data = json.load(open(tmp_path / "bench.json"))
    res = data["results"][0]
    assert res["mode"] == "sync" and res["new_tokens"] == 12 and 0 < res["device_busy"] <= 1
    assert data["environment"]["torch"]


def test_bad_flags_are_named(capsys):
    code, _, err = run_here(capsys, "demo", "--modes", "turbo")
    assert code != 0 and "unknown mode 'turbo'" in err
    code, _, err = run_here(capsys, "bench", "--model", "gpt-17", "--device", "cpu")
    assert code == 2 and "unknown model 'gpt-17'" in err
    code, _, err = run_here(capsys, "bench", "--modes", ",")
    assert code != 0 and "at least one" in err
    code, _, err = run_here(capsys, "demo", "--model", "random-llama", "--device", "cpu")
    assert code == 2 and "has no tokenizer" in err


def test_bench_beside_transformers_and_the_floor(tmp_path, capsys):
    # transformers runs in a process of its own (bench.hf_in_own_process); on a CPU the bench sizes its
    # KV cache to the workload (it would take ~60% of the RAM otherwise): the suite stays light
    code, out, err = run_here(capsys, "bench", "--model", "random-llama", "--device", "cpu", "--num-prompts", "2",
                              "--prompt-len", "4", "--max-new-tokens", "3", "--no-progress", "--hf", "--floor",
                              "--out", str(tmp_path))
    assert code == 0, err
    assert "hf: 2/2 requests with the same tokens as sync" in out  # float32: transformers agrees
    data = json.load(open(tmp_path / "bench.json"))
    assert [x["mode"] for x in data["results"]] == ["sync", "hf"]
    assert data["workload"]["decode_floor_ms"] > 0
    assert "fastest minibatch mode sync" in out and "fastest transformers mode hf" in out


def test_compile_modes_need_a_gpu(capsys):
    code, _, err = run_here(capsys, "bench", "--model", "random-llama", "--device", "cpu", "--modes",
                            "sync,async+compile", "--no-progress")
    assert code == 2 and "+compile and +dynamic modes need a CUDA model" in err
    code, _, err = run_here(capsys, "bench", "--model", "random-llama", "--device", "cpu", "--modes",
                            "async+dynamic", "--no-progress")
    assert code == 2 and "+compile and +dynamic modes need a CUDA model" in err
    code, _, err = run_here(capsys, "bench", "--modes", "async+turbo")
    assert code != 0 and "unknown mode 'async+turbo'" in err


def test_triton_attention_without_triton_is_named(capsys):
    from minibatch.model import triton_decode
    if triton_decode.available():
        pytest.skip("triton is installed here")
    code, _, err = run_here(capsys, "bench", "--model", "random-llama", "--device", "cpu", "--decode-attention",
                            "triton", "--no-progress")
    assert code == 2 and "needs the triton package" in err


def test_host_cost_ab_compares_two_checkouts(tmp_path):
    """scripts/experiments/host_cost_ab.py against this checkout: both sides run the same code, step by step."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "experiments" / "host_cost_ab.py"), str(tmp_path), "--against",
                        str(root), "--rows", "8", "--context", "40", "--steps", "20"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "host_cost_ab.json").read_text())["results"]
    assert set(results) == {"this", "against"} and all(v["total"] > 0 for v in results.values())
    bad = subprocess.run([sys.executable, str(root / "scripts" / "experiments" / "host_cost_ab.py"), str(tmp_path), "--against",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no minibatch package there" in bad.stderr


def test_sampling_ab_times_both_samplers_and_finds_the_same_tokens(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "experiments" / "sampling_ab.py"), str(tmp_path), "--model",
                        "random-llama", "--rows", "4", "--context", "20", "--rounds", "2", "--repeats", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "sampling_ab.json").read_text())
    assert data["tokens_equal"] and set(data["median_ms"]) == {"sorted", "unsorted"}
    assert "tokens equal: True" in r.stdout


def test_bench_says_why_tokens_differ():
    import torch

    from minibatch.tools import bench

    assert bench.agreement_line("async", "sync", 32, 32, torch.bfloat16) == "async: 32/32 requests with the same tokens as sync"
    hf = bench.agreement_line("hf_sync_graphs", "sync", 0, 32, torch.bfloat16)
    assert hf.startswith("hf_sync_graphs: 0/32") and "expected in bfloat16" in hf and "near-tied logits" in hf
    assert "NOT expected" in bench.agreement_line("async", "sync", 31, 32, torch.bfloat16)
    assert "NOT expected" in bench.agreement_line("hf", "sync", 1, 2, torch.float32)
