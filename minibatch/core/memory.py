"""How much memory a `generate` run allocates, and whether the machine has it (checked before allocating).

The big allocations of a run are known from its arguments before anything is allocated:

    KV cache    2 (keys, values) x layers x (num_blocks + 1 scratch) x block_size x kv_heads x head_dim
                x dtype bytes, on the model's device
    IO slots    per slot, host and device buffers of every batch field (slots.py), int64 at most:
                token fields x max_batch_tokens, key fields x the keys of the largest step, row fields x rows
    free list   one Python int per KV block on the host (kv_cache.BlockAllocator)

A run whose estimate exceeds MEMORY_FRACTION of the free memory is refused with the numbers and the
arguments to lower, instead of swapping the machine or failing deep in the allocator.
"""

from __future__ import annotations

import torch

from .batch import TENSOR_FIELDS
from .buckets import KEY_BUCKETS, ROW_BUCKETS, TOKEN_BUCKETS, bucket
from .requests import MAX_LOGPROBS
from .slots import EXTENT, capacities
from .device import host_bytes_free, platform

MEMORY_FRACTION = 0.9  # of the free memory a run may plan for: the rest is for activations, Python, others


def run_sizes(model, config, lengths, max_new_tokens, max_batch_size: int, block_size: int):
    """(num_blocks, max_tokens, max_keys, rows): the KV blocks and the IO slots' capacities of a run of
    `config` (an EngineConfig: its token budget, num_blocks and compile) whose requests have prompts of
    `lengths` tokens; `max_batch_size` and `block_size` as make_config resolved them. A decode step
    is padded to at least two rows with compile="dynamic" (it pads a single row to two: core/graphs.py)."""
    max_batch_tokens, num_blocks = config.max_batch_tokens, config.num_blocks
    min_rows = 2 if config.compile == "dynamic" else 1
    need = sorted((-(-(n + max_new_tokens - 1) // block_size) for n in lengths), reverse=True)
    if num_blocks is None:  # enough for max_batch_size of the longest requests at once
        num_blocks = sum(need[:max_batch_size])
    if need[0] > num_blocks:
        raise ValueError(f"a request needs {need[0]} blocks of {block_size} tokens of KV cache but the cache only "
                         f"has num_blocks={num_blocks}: it could never run")
    # the largest step, with the padding the graph layout may add (batch.py)
    rows = bucket(max(max_batch_size, min_rows), ROW_BUCKETS)
    longest = max(lengths) + max_new_tokens
    width = max(-(-longest // b) * b for b in (model.kv_bucket, model.decode_kv_bucket))
    tokens, keys = max(max_batch_tokens, rows), max(num_blocks * block_size + model.kv_bucket, rows * width)
    if platform(model.device).padded:  # room for prefill steps padded to bucketed sizes (graphs.pad_flat)
        tokens = max(tokens, bucket(max_batch_tokens, TOKEN_BUCKETS))
        keys = max(keys, bucket(keys + 1, KEY_BUCKETS))
    return num_blocks, tokens, keys, rows


def estimate_bytes(model, num_blocks: int, max_tokens: int, max_keys: int, rows: int, block_size: int,
                   num_slots: int) -> dict[str, int]:
    """Bytes a run allocates: KV cache (device), IO slots (host and device), block free list (host)."""
    kv = 2 * model.num_layers * (num_blocks + 1) * block_size * model.num_kv_heads * model.head_dim
    kv *= model.dtype.itemsize
    caps = capacities(max_tokens, max_keys, rows)
    fields = sum(caps[EXTENT.get(name, "R")] for name in TENSOR_FIELDS)
    logprobs = (rows + max_tokens) * (4 * (1 + MAX_LOGPROBS) + 8 * MAX_LOGPROBS)  # float32 values, int64 ids
    io_host = (8 * (fields + 2 * rows) + logprobs) * num_slots  # every field, carry-over mask, sampled ids
    io_dev = (8 * (fields + 2 * rows + max_tokens) + logprobs) * num_slots  # + the patched ids
    return {"kv": kv, "io_host": io_host, "io_dev": io_dev, "allocator": 40 * num_blocks}  # a Python int per block


def available_bytes(device: torch.device) -> tuple[int, int]:
    """(free device memory, free host memory) in bytes; on the CPU both are the same host memory. Host
    memory as the backends measure it (device.host_bytes_free: the machine's free memory, `ulimit -v`, a
    container's cgroup limit); where nothing measures it, no limit."""
    host, own = host_bytes_free(), platform(device).free_bytes(device)
    host = 2**62 if host is None else host
    return (host if own is None else own), host


def fits_beside(model, shape) -> bool:
    """Does a new resource set of `shape` (a config.Shape) fit in the device's free memory as it is now,
    beside what an engine keeps? Always, where the device uses host memory (checked by check_memory)."""
    can = platform(model.device)
    if not can.own_memory:
        return True
    b = estimate_bytes(model, shape.num_blocks, shape.max_tokens, shape.max_keys, shape.rows, shape.block_size,
                       shape.num_slots)
    return b["kv"] + b["io_dev"] <= MEMORY_FRACTION * can.free_bytes(model.device)


def check_memory(model, shape, given_blocks: bool = True, reusable: int = 0) -> None:
    """Refuse a run whose KV cache and IO slots (the sizes of `shape`, a config.Shape) cannot fit in free
    memory, naming the sizes and arguments. `given_blocks`: num_blocks was the caller's, not computed.
    `reusable`: device bytes an engine holds for kept shapes, which it reuses or frees for this run.
    """
    num_blocks, block_size, max_tokens, max_keys, rows = (shape.num_blocks, shape.block_size, shape.max_tokens,
                                                          shape.max_keys, shape.rows)
    b = estimate_bytes(model, num_blocks, max_tokens, max_keys, rows, block_size, shape.num_slots)
    dev_free, host_free = available_bytes(model.device)
    if platform(model.device).own_memory:
        # an engine's kept caches are reused or freed: count them as free, so that a run of a shape that
        # fitted before is never refused
        dev_free += reusable
        needs = [("device", b["kv"] + b["io_dev"], dev_free), ("host", b["io_host"] + b["allocator"], host_free)]
    else:
        needs = [("host", sum(b.values()), host_free)]
    culprit = ("num_blocks or block_size" if b["kv"] + b["allocator"] >= b["io_host"] + b["io_dev"]
               else "max_batch_tokens or max_batch_size")
    gb = 1e9
    for where, need, free in needs:
        if need > MEMORY_FRACTION * free:
            raise ValueError(
                f"this run needs about {need / gb:.1f} GB of {where} memory but {free / gb:.1f} GB are free on "
                f"{model.device} (at most {MEMORY_FRACTION:.0%} is used): KV cache {b['kv'] / gb:.1f} GB for "
                f"num_blocks={num_blocks}{'' if given_blocks else ' (from the prompts and max_new_tokens)'} x "
                f"block_size={block_size}, IO slots {(b['io_host'] + b['io_dev']) / gb:.1f} GB for {max_tokens} "
                f"tokens (max_batch_tokens), {rows} rows (max_batch_size) and {max_keys} keys. Lower {culprit}")
