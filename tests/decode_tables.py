"""A decode batch in the decode layout over rows of cached tokens, and its cache filled with random keys
and values: what the decode kernels' tests (test_paged_kernel.py, test_fresh.py) run on, with a spy on
their launches; and one decode step, or any function, compiled through the graph passes (the passes'
tests)."""

from __future__ import annotations

import torch

from minibatch.core.batch import build_batch
from minibatch.core.buckets import ROW_BUCKETS
from minibatch.core.kv_cache import PagedKVCache
from minibatch.core.requests import Request, SamplingParams
from minibatch.core.scheduler import Scheduler


def decode_batch(ctx_lens, layers=1, kv_heads=2, dim=16, dtype=torch.float32, device="cpu", block_size=4,
                 bucket=8):
    """(cache, batch): one decode step of rows with `ctx_lens` cached tokens each (random cache; the same
    for the same arguments, so two calls give two equal caches)."""
    torch.manual_seed(0)
    cache = PagedKVCache(layers, kv_heads, dim, 256, block_size, device=device, dtype=dtype)
    sched = Scheduler(cache.allocator, 512, 8)
    for i, n in enumerate(ctx_lens):
        sched.add(Request(i, [(7 * i + j) % 97 + 1 for j in range(n)], SamplingParams(max_new_tokens=4)))
    sched.update(sched.schedule(), [2] * len(ctx_lens))  # the prompts' step (nothing computed: random cache)
    batch = build_batch(sched.schedule(), cache, bucket, True, ROW_BUCKETS).to(device)
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.randn_like(t))
    return cache, batch


def compiled_and_eager(model, graph_pass, ctx_lens=(5, 11, 3)):
    """One decode step of `model` (its weights stacked: siblings.pack) run eagerly, and compiled through a
    backend that runs siblings.merge, then `graph_pass(gm, example_inputs)`, then Inductor, on an equal
    cache: (compiled logits, eager logits, the compiled step's cache, the eager step's cache)."""
    from minibatch.speed import siblings
    from minibatch.speed.compat import inductor_compile

    def backend(gm, example_inputs):
        siblings.merge(gm, example_inputs)
        graph_pass(gm, example_inputs)
        return inductor_compile(gm, example_inputs, None, ())

    shape = (list(ctx_lens), model.num_layers, model.num_kv_heads, model.head_dim)
    (cache, batch), (twin, _) = decode_batch(*shape), decode_batch(*shape)
    torch._dynamo.reset()
    with torch.inference_mode():
        want = model._forward(batch, cache)
        got = torch.compile(model._forward, backend=backend, fullgraph=True)(batch, twin)
    return got, want, twin, cache


def after_pass(graph_pass, fn, *inputs):
    """fn(*inputs) compiled with a backend that runs `graph_pass(gm, example_inputs)` and then the graph as it
    is (no Inductor): (the pass's count, the graph after it, the output)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((graph_pass(gm, example_inputs), gm))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    return seen[0][0], seen[0][1], out


def routed_step(name: str, *passes):
    """compiled_and_eager for the random model `name` (float32, its weights stacked) through skinny.route
    (CPU graphs too: the operators then run PyTorch ops) and then `passes`: (model, [(each pass's count, the
    graph's call targets after them) per compile], compiled logits, eager logits, compiled cache, eager cache)."""
    import minibatch
    from minibatch.speed import siblings, skinny

    model = minibatch.load_model(name, device="cpu", dtype=torch.float32)
    siblings.pack(model.hf)
    seen = []

    def run(gm, example_inputs):
        skinny.route(gm, example_inputs, on_cuda_only=False)
        counts = [p(gm, example_inputs) for p in passes]
        seen.append((counts, [n.target for n in gm.graph.nodes]))

    return (model, seen, *compiled_and_eager(model, run))


class LaunchSpy:
    """Stands in for a Triton kernel: notes `note(keyword arguments)` of each launch in `seen`, then launches."""

    def __init__(self, kernel, seen: list, note):
        self.kernel, self.seen, self.note = kernel, seen, note

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.seen.append(self.note(kwargs))
            return self.kernel[grid](*args, **kwargs)
        return run
