"""The server's HTTP thread with asyncio + h11 and with uvloop + httptools, side by side (Linux: /proc).

    PYTHONPATH=$PWD python scripts/experiments/server_http_ab.py OUT_DIR                   # tiny model, CPU
    python3 scripts/experiments/server_http_ab.py OUT_DIR --model FOLDER --device cuda --num-prompts 256 ...

uvicorn runs the event loop and the HTTP parser that serve's `--loop` and `--http` name: asyncio's own
loop and the pure-Python h11, or uvloop (libuv) and httptools (a C parser), which `auto` picks where they
are installed. The event loop runs in the server's main thread and shares the interpreter, so the GIL,
with the engine's loop thread: what it spends per streamed token is time the engine's loop may wait.

Each round starts one server per variant, in alternation, sends the workload once untimed (first-step
costs), then once more at rate inf while reading the CPU seconds of the server's main thread and of
the whole server process from /proc. Prints CPU microseconds per streamed token of each, their
ratio, and the token throughput bench-serve saw; writes server_http_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"asyncio+h11": ["--loop", "asyncio", "--http", "h11"],
            "uvloop+httptools": ["--loop", "uvloop", "--http", "httptools"]}


def cpu_s(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds (fields 14 and 15, after the command's name)."""
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(url: str, proc, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"no ready /health at {url} after {timeout} s")


def bench(args, url: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "minibatch", "bench-serve", "--url", url, "--rates", "inf",
           "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len), "--max-tokens",
           str(args.max_tokens), "--processes", str(args.processes), "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = next(iter(json.load(open(out / "bench_serve.json"))["runs"].values()))
    r = run["rates"]["inf"]
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} requests failed: {r['errors'][:3]}")
    return r


def one(args, variant: str, out: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    log = open(out / f"server-{variant}.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--model", args.model, "--device",
                             args.device, "--port", str(args.port), "--max-batch-size", str(args.num_prompts),
                             *VARIANTS[variant]], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(url, proc)
        with tempfile.TemporaryDirectory() as tmp:  # (bench-serve's own files: only its numbers are kept)
            bench(args, url, Path(tmp))  # untimed
            main, whole = f"/proc/{proc.pid}/task/{proc.pid}/stat", f"/proc/{proc.pid}/stat"
            m0, p0 = cpu_s(main), cpu_s(whole)
            r = bench(args, url, Path(tmp))
        m1, p1 = cpu_s(main), cpu_s(whole)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    tokens = r["completed"] * r["mean_output_tokens"]
    return {"main_us_per_token": 1e6 * (m1 - m0) / tokens, "process_us_per_token": 1e6 * (p1 - p0) / tokens,
            "tok_per_s": r["output_throughput"], "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8431)
    args = p.parse_args()
    for module in ("uvloop", "httptools"):
        __import__(module)  # (ImportError here, not a server that fails to start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.rounds):
        for variant in VARIANTS:
            r = one(args, variant, out)
            rows[variant].append(r)
            print(f"round {i + 1} {variant:17s} main thread {r['main_us_per_token']:6.1f} us/token  process "
                  f"{r['process_us_per_token']:6.1f} us/token  {r['tok_per_s']:7.1f} tok/s", flush=True)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in rows.items()}
    a, b = med["asyncio+h11"], med["uvloop+httptools"]
    print(f"median over {args.rounds} rounds: main thread {a['main_us_per_token']:.1f} -> "
          f"{b['main_us_per_token']:.1f} us/token ({b['main_us_per_token'] / a['main_us_per_token']:.2f}x), "
          f"process {a['process_us_per_token']:.1f} -> {b['process_us_per_token']:.1f} us/token "
          f"({b['process_us_per_token'] / a['process_us_per_token']:.2f}x), tok/s {a['tok_per_s']:.0f} -> "
          f"{b['tok_per_s']:.0f}")
    json.dump({"config": vars(args), "rounds": rows, "median": med}, open(out / "server_http_ab.json", "w"), indent=1)


if __name__ == "__main__":
    main()
