"""What the HTTP server does before it says it is ready (server.py's lifespan; notebook 08).

    warm_up          short requests, one per sampling variant the server compiles, so that no client pays
                     for a first step's compile or graph capture
    capture_progress a line at each tenth of the start-up CUDA graphs (`serve --capture-up-to`)
    freeze_heap      everything alive once warm kept out of full garbage collections (`--gc-freeze on`)
    http_stack       which event loop and HTTP parser uvicorn runs, for the ready line
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import sys
import time

from .handlers import ServerState

# the sampling variants a decode step takes a path of its own for (greedy, sampled, sampled with top-k/top-p:
# sampling.py); compiled, the first two compile a token choice each and the third samples eagerly (compiled.py)
VARIANTS = (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=8))


def warm_up(state: ServerState) -> None:
    """Short requests before the server says it is ready, so the first clients pay no first-step cost:
    one, or with --compile one per sampling variant, one after the other, so that the forward and each
    variant's token choice are compiled, and each variant's decode graph captured, before a client waits
    on them."""
    ids = list(range(1, min(9, state.model.vocab_size)))
    for variant in VARIANTS if state.serving.get("compile") else VARIANTS[:1]:
        state.served.submit(ids, max_new_tokens=2, seed=0, **variant).wait()


def freeze_heap() -> int:
    """Move every object alive now (modules, the model, compiled code, the warm-up's graphs) out of
    the garbage collector's reach -> how many. They live as long as the server; left in, each full
    collection walks all of them while holding the interpreter lock, and a streaming server allocates
    enough to run one every few thousand steps: a stall of every request at once (BENCHMARKS.md,
    "The 8B server's earlier runs"). Collected once first, so that no garbage of the start-up is kept for good."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def http_stack(http: str) -> str:
    """Which event loop and HTTP parser uvicorn runs (for "auto": what uvicorn found installed)."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"event loop {loop}, HTTP {http}"


def capture_progress(out=None):
    """A `Serving.capture_progress` callback that says how far the start-up captures are, a line at
    each tenth of them (they take a minute or more for an 8B model, before the server is ready)."""
    started, said = time.monotonic(), [0]

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // total
        if tenth > said[0]:
            said[0] = tenth
            print(f"minibatch: start-up CUDA graphs {done}/{total} ({time.monotonic() - started:.0f} s)",
                  file=out or sys.stderr, flush=True)

    return progress
