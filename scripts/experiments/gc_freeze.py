"""How long one of Python's full garbage collections stops a server's process, with and without gc.freeze.

    PYTHONPATH=$PWD python scripts/experiments/gc_freeze.py                   # tiny model, CPU
    python3 scripts/experiments/gc_freeze.py --model FOLDER --device cuda     # a GPU machine

A full collection (generation 2) walks every container object the collector tracks, and the thread
that runs it holds the interpreter lock all the while: in a server, the engine's loop and the HTTP
thread both stop. After importing what `serve` imports and loading the model, there are hundreds of
thousands of such objects, alive for as long as the server. `gc.freeze()` moves them to a generation
the collector never walks (`serve --gc-freeze on`, the default). This script times `gc.collect()`
in such a process: before the freeze, then after it with `--new` containers made since (what a
serving run keeps alive meanwhile: streams, token lists, timeline spans).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def collect_ms(rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        gc.collect()
        out.append(1000 * (time.perf_counter() - started))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new", type=int, default=100_000, help="container objects made after the freeze")
    args = p.parse_args()

    import fastapi  # noqa: F401  (what `serve` imports, so that their objects are counted too)
    import uvicorn  # noqa: F401

    import minibatch
    from minibatch.serving import server  # noqa: F401

    minibatch.load_model(args.model, device=args.device)
    tracked = len(gc.get_objects())
    before = collect_ms(args.rounds)
    gc.freeze()
    frozen = gc.get_freeze_count()
    alive = [{"i": i, "ids": [i]} for i in range(args.new)]  # kept alive through the timing below
    after = collect_ms(args.rounds)
    print(f"tracked objects {tracked}, frozen {frozen}, made after the freeze {2 * len(alive)}")
    print(f"full collection, median of {args.rounds}: {statistics.median(before):.1f} ms before the freeze, "
          f"{statistics.median(after):.1f} ms after it ({statistics.median(after) / statistics.median(before):.2f}x)")


if __name__ == "__main__":
    main()
