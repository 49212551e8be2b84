"""One model's engine: its run configuration, its loops and the checks before a run.

Above: the tools (and the server). Below: everything else.

    engine.py      Engine: device, KV cache, IO slots, step runner and graphs; start/step/finish   00
    config.py      EngineConfig: every option of a run, checked once; the RunConfig sized from it  00
    checks.py      the prompts and the options checked against the model, before any work          00
    memory.py      the run's sizes and whether they fit in free memory                             00
    sync_loop.py   one step of the synchronous loop: prepare, launch, wait, update                 01
    async_loop.py  one step of the asynchronous loop: launch N+1, then wait for N                  06
    serving.py     the loop's turns; in a background thread while serving, taking submits        08
    stream.py      TokenStream: one request's tokens as they are made (threads and asyncio)      08
"""

from .engine import Engine, generate

__all__ = ["Engine", "generate"]
