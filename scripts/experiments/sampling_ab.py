"""A sampled decode step with and without the sort over the vocabulary, side by side in one process.

    PYTHONPATH=$PWD python scripts/experiments/sampling_ab.py OUT_DIR                       # tiny model, CPU
    python3 scripts/experiments/sampling_ab.py OUT_DIR --model llama3-8b-shape --device cuda --rows 32 --context 512

Every row samples (temperature 0.8) with neither top-k nor top-p, so the batch is `unfiltered` and
the sampler may skip sorting each row's vocabulary (sampling.sample, filtered=False). The same decode
batch runs both ways: "sorted" (the full sampler: sort, top-k/top-p masks, Gumbel-max in sorted
order) and "unsorted" (Gumbel-max over the vocabulary as it is). On a GPU each variant is one CUDA
graph, timed over replays with CUDA events; on the CPU, eager calls timed with the host's clock.
Rounds alternate the two, so that a change in the machine's speed hits both alike. Prints the median
step time of each, their ratio, and whether the tokens are equal (they must be); writes
sampling_ab.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import minibatch  # noqa: E402
from minibatch.tools import bench
from minibatch.tools import floors  # noqa: E402
from minibatch.core.requests import Request, SamplingParams  # noqa: E402
from minibatch.core.scheduler import Scheduler  # noqa: E402
from minibatch.core.graphs import StepRunner  # noqa: E402

BLOCK = 16


def decode_batch(model, rows: int, context: int):
    """A KV cache holding `rows` sampled requests of `context` tokens, and their next decode batch."""
    cache = model.make_cache(rows * (-(-(context + 8) // BLOCK) + 1) + 8, BLOCK)
    sched = Scheduler(cache.allocator, rows * context, rows)
    for i in range(rows):
        sched.add(Request(i, [1 + i % 200] * context, SamplingParams(temperature=0.8, seed=i, max_new_tokens=4)))
    sched.update(sched.schedule(), [2] * rows)  # prompts as if prefilled: the time does not depend on them
    batch = StepRunner(model, cache).build(sched.schedule()).to(model.device)
    assert batch.unfiltered and not batch.all_greedy
    return cache, batch


def timer(model, cache, batch, repeats: int):
    """A function that runs the step `repeats` times and returns (ms per step, tokens)."""
    out = torch.empty(batch.num_sampled, dtype=torch.int64, device=model.device)

    def step():
        out.copy_(model.next_tokens(batch, cache))

    if model.device.type != "cuda":
        def run():
            t = time.perf_counter()
            for _ in range(repeats):
                step()
            return (time.perf_counter() - t) / repeats * 1e3, out.clone()
        return run
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    return lambda: (floors.replay_ms(graph.replay, repeats), out.clone())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    model = minibatch.load_model(args.model, device=args.device)
    if model.device.type == "cpu":
        torch.set_num_threads(1)  # as in the cpu device's process
    cache, batch = decode_batch(model, args.rows, args.context)
    runs = {"sorted": timer(model, cache, dataclasses.replace(batch, unfiltered=False), args.repeats),
            "unsorted": timer(model, cache, batch, args.repeats)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens = {}
    for _ in range(2):  # warm-up
        for k, run in runs.items():
            tokens[k] = run()[1]
    for i in range(args.rounds):
        for k in (runs if i % 2 == 0 else list(runs)[::-1]):
            ms, tokens[k] = runs[k]()
            times[k].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    same = torch.equal(tokens["sorted"], tokens["unsorted"])
    env = {**bench.environment(model), "argv": sys.argv, "date": time.strftime("%Y-%m-%d"),
           "rows": batch.num_sampled, "context": args.context}
    print(f"{model.name} on {env['device']}, {batch.num_sampled} rows x {args.context} "
          f"tokens, vocabulary {model.vocab_size}: decode step sorted {med['sorted']:.3f} ms, unsorted "
          f"{med['unsorted']:.3f} ms (ratio {med['unsorted'] / med['sorted']:.3f}, {args.rounds} alternating rounds "
          f"of {args.repeats}); tokens equal: {same}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_ab.json").write_text(json.dumps({"median_ms": med, "times_ms": times, "tokens_equal": same,
                                                     "env": env}, indent=1, default=str))
    if not same:
        raise SystemExit("error: the two samplers gave different tokens")


if __name__ == "__main__":
    main()
