"""Waking a server's stream readers once per stream or once per update, side by side in one process.

    PYTHONPATH=$PWD python scripts/experiments/wakeups_ab.py OUT_DIR

The engine's loop thread hands each request's new tokens to its TokenStream; a reader awaiting it on an
asyncio event loop (a server's SSE response) is woken through `call_soon_threadsafe`, a write to the
event loop's self-pipe. "per stream" wakes each reader as its chunk is put (TokenStream.put without a
Wakeups); "per update" gathers them and wakes each event loop once (TokenStream.put with a Wakeups, what
ServingLoop.deliver does). N streams each get one token per step, with a sleep between steps standing in for
the device's time, so that the readers catch up. Rounds alternate the two. Prints the CPU
microseconds per token of the putting thread (the engine's loop) and of the event loop's thread,
and their ratio; writes wakeups_ab.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minibatch.serving.stream import Chunk, TokenStream, Wakeups  # noqa: E402


def run(streams_n: int, steps: int, step_s: float, gathered: bool) -> dict:
    streams = [TokenStream(i, 1) for i in range(streams_n)]
    loop = asyncio.new_event_loop()
    cpu: dict[str, float] = {}
    got = [0]

    async def read(s):
        async for c in s:
            got[0] += len(c.token_ids)

    async def read_all():
        await asyncio.gather(*(read(s) for s in streams))

    def event_loop_thread():
        t = time.thread_time()
        loop.run_until_complete(read_all())
        cpu["event_loop"] = time.thread_time() - t
        loop.close()

    th = threading.Thread(target=event_loop_thread)
    th.start()
    time.sleep(0.2)  # every reader waiting
    t = time.thread_time()
    for step in range(steps):
        wakeups = Wakeups() if gathered else None
        finish = "length" if step == steps - 1 else None
        for s in streams:
            s.put(Chunk([step], "", finish), time.perf_counter(), wakeups)
        if wakeups is not None:
            wakeups.send()
        time.sleep(step_s)
    cpu["engine_loop"] = time.thread_time() - t
    th.join()
    tokens = streams_n * steps
    if got[0] != tokens:
        raise AssertionError(f"the readers got {got[0]} of {tokens} tokens")
    return {k: 1e6 * v / tokens for k, v in cpu.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"per stream": [], "per update": []}
    for i in range(args.rounds):
        for name, gathered in (("per stream", False), ("per update", True)):
            r = run(args.streams, args.steps, args.step_ms / 1e3, gathered)
            rows[name].append(r)
            print(f"round {i + 1} {name:10s} engine loop {r['engine_loop']:5.1f} us/token  event loop "
                  f"{r['event_loop']:5.1f} us/token", flush=True)
    med = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in rows.items()}
    a, b = med["per stream"], med["per update"]
    print(f"median over {args.rounds} rounds, {args.streams} streams: engine loop {a['engine_loop']:.1f} -> "
          f"{b['engine_loop']:.1f} us/token ({b['engine_loop'] / a['engine_loop']:.2f}x), event loop "
          f"{a['event_loop']:.1f} -> {b['event_loop']:.1f} us/token ({b['event_loop'] / a['event_loop']:.2f}x)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json.dump({"config": vars(args), "rounds": rows, "median": med}, open(out / "wakeups_ab.json", "w"), indent=1)


if __name__ == "__main__":
    main()
