"""The teaching core: continuous batching, sync and async, on any device that offers the interface
of device.py. It imports nothing else of minibatch; the rest plugs into it (see below).

    module          what it is                                                               notebook
    engine.py       Engine: device, KV cache, IO slots, step runner; start/step/finish, generate  00
    config.py       EngineConfig: every option of a run, checked once; the RunConfig sized from it 00
    checks.py       the prompts and the options checked against the model, before any work       00
    memory.py       the run's sizes and whether they fit in free memory                           00
    args.py         integers, numbers and flags checked with errors that name them               00
    requests.py     Request and SamplingParams: a request's life cycle and how to continue it    01
    kv_cache.py     the paged KV cache and its block allocator                                    01
    prefix_cache.py full prompt blocks kept by content and shared by requests that start alike    08
    scheduler.py    plans each step under a token budget; chunked prefill, mixed batches          01
    batch.py        a plan flattened into the step's host tensors                                 01
    decode_keys.py  the key list of decode rows, kept from step to step                           01
    sampling.py     greedy, temperature, top-k, top-p, seeded per request                         01
    penalties.py    presence, frequency and repetition penalties from each row's history          08
    sync_loop.py    one step of the synchronous loop: prepare, launch, wait, update               01
    timeline.py     Timeline: what ran when, on which lane; busy fractions and pictures           01
    device.py       the device interface: streams, events, copies, errors; what stays resident;   02
                    a Platform: graphs, padded shapes, free memory per kind of hardware
    launch.py       launch_step: H2D, compute, D2H on three streams chained by events          03-06
    buckets.py      the sizes steps are padded to (few shapes for graphs and compiles)            04
    slots.py        IO slots: host and device buffers of one step, and their events              04
    graphs.py       StepRunner: a step run eagerly or as a CUDA graph; flat steps padded to buckets 04
    carry_over.py   where batch N's sampled tokens go in batch N+1 (placeholders + mask)          05
    async_loop.py   one step of the asynchronous loop: launch N+1, then wait for N                06
    compat.py       the private CPython hook the core uses (devices/ and speed/ keep their own)  01

Plugged in from outside, each importing the core and never the reverse:

    devices/   the backends: cuda, cpu (an emulated device in a process of its own), cpu-threads;
               devices/__init__.py installs their opener (device.open_device) and the host's free
               memory (device.host_bytes_free, from devices/limits.py), cuda.py the GPU's Platform
    model/     a transformers causal LM set up for the paged KV cache (what Engine asks of a model:
               engine.MODEL_NEEDS); the Triton decode attention
    speed/     torch.compile'd decode steps and merged sibling projections (Model.compiled_step)
    serving/   requests that arrive while the engine runs (Serving: engine.open_run stepped from a
               thread of its own, a TokenStream per request), the OpenAI-compatible HTTP server
               and bench-serve
    tools/     the CLI, bench, floors
"""

VERSION = "0.1.0"  # the package's version (pyproject.toml's), here so that any layer can name it

