"""Paged KV cache: a pool of fixed-size blocks, one block table per request (notebook 01).

The keys and values of every token of every running request live in one big tensor per layer,
cut into blocks of `block_size` cells, one cell per token (its key and value; "slot" is kept for the
IO slots of notebook 04). A request owns a list of blocks (its *block table*);
token number t of that request lives in cell

    block_table[t // block_size] * block_size + t % block_size

so requests of any length share the pool without padding and without copying when they grow.

    pool (num_blocks = 6, block_size = 4)      block tables
    ┌────┬────┬────┬────┬────┬────┐┌────┐
    │ b0 │ b1 │ b2 │ b3 │ b4 │ b5 ││ b6 │     request 0: [b2, b0]   (7 tokens)
    └────┴────┴────┴────┴────┴────┘└────┘     request 1: [b4]       (3 tokens)
                                   scratch   free: b1, b3, b5

The block *allocator* is host-side bookkeeping (plain Python lists). The *storage* is device
memory that only the attention function (attention.py) reads and writes. One extra scratch block past
the end of the pool absorbs writes from padding tokens, so padded batches never touch a real
request's cache.

Policy (a teaching choice, see README "Design decisions"): a request gets all the blocks it can
ever need (prompt + max_new_tokens) when it is admitted. Nothing ever needs to be preempted, and a
request that could never fit is rejected up front. Production engines (vLLM, SGLang) allocate one
block at a time and preempt when the pool runs dry; they fit more requests, at the cost of
recomputation when they guess wrong.
"""

from __future__ import annotations

import math
import operator
from itertools import repeat

import numpy as np
import torch

from .decode_keys import DecodeKeys
from .device import Device, resident


class OutOfBlocks(RuntimeError):
    """Raised when more blocks are asked for than are free."""


class BlockAllocator:
    """Hands out block ids from a free list; checks that no block is ever owned twice."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owned: set[int] = set()
        # id(block table) -> its cell table, and -> the block table itself: what cell_tables computed
        self._cell_tables: dict[int, np.ndarray] = {}
        self._held: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        assert self._owned.isdisjoint(blocks), "a KV block was handed out twice"
        self._owned.update(blocks)
        return blocks

    def free(self, blocks: list[int], keep=()) -> None:
        """Blocks back to the free list, but those in `keep` (a prefix cache's: they stay owned)."""
        self._cell_tables.pop(id(blocks), None)
        self._held.pop(id(blocks), None)
        for b in blocks:
            if b in keep:
                continue
            if b not in self._owned:
                raise RuntimeError(f"KV block {b} freed but not owned (double free?)")
            self._owned.remove(b)
            self._free.append(b)


    def cell_tables(self, block_tables: list[list[int]]) -> list[np.ndarray]:
        """For each block table, the cell of every position it covers: blocks[t // bs] * bs + t % bs.

        Batch building asks every step (batch.py), so each is computed once per block table and kept
        here until `free(blocks)` (a request's block table is fixed from admission on: a new list means
        new blocks). Kept by the list's id, with the list itself held so that no other list can take
        that id meanwhile; the lookups run as C loops (map), since a decode step asks for every row."""
        ids = list(map(id, block_tables))
        tables = list(map(self._cell_tables.get, ids))
        if any(map(operator.is_, tables, repeat(None))):
            size = self.block_size
            for i, blocks in enumerate(block_tables):
                if tables[i] is None:
                    cells = (np.asarray(blocks, dtype=np.int64)[:, None] * size + np.arange(size)).reshape(-1)
                    self._cell_tables[ids[i]], self._held[ids[i]], tables[i] = cells, blocks, cells
        return tables


@resident  # on the device side, as a GPU keeps it (core/device.py)
class PagedKVCache:
    """Device storage: per layer one key and one value tensor of shape [cells, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: "torch.device | str | Device" = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`device`: where the tensors live, a torch device or a minibatch Device (whose `empty`
        allocates them, so that a device of its own process holds them)."""
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.num_cells = (num_blocks + 1) * block_size  # + the scratch block
        self.scratch_cell = num_blocks * block_size
        shape = (self.num_cells, num_kv_heads, head_dim)
        # zeroed, not just allocated: padding keys are masked, but garbage (NaN) in them would still
        # poison the attention's sums
        alloc = device.empty if isinstance(device, Device) else (
            lambda shape, dtype: torch.empty(shape, device=device, dtype=dtype))
        self.keys = [alloc(shape, dtype).zero_() for _ in range(num_layers)]
        self.values = [alloc(shape, dtype).zero_() for _ in range(num_layers)]
        self.key_table = DecodeKeys()  # the decode layout's key table, kept from step to step (decode_keys.py)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
