"""A decode batch in the decode layout over rows of cached tokens, and its cache filled with random keys
and values: what the decode kernels' tests (test_paged_kernel.py, test_fresh.py) run on."""

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
