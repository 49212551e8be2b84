"""From a batch plan to flat, ragged host tensors (notebook 01).

The model sees one sequence of T tokens: all scheduled chunks of all requests laid end to end, no
padding ("ragged" batch). For a plan with a 3-token prefill chunk of request A and one decode token
each for B and C:

    input_ids      a0 a1 a2 | b7 | c4        T = 5
    positions       0  1  2 |  7 |  4        RoPE needs the true position in each request
    q_seq           0  0  0 |  1 |  2        which chunk (row of the plan) each token belongs to
    cell_mapping    where each token's key/value is written in the paged cache
    logits_indices  2, 3, 4                  the last token of each chunk that samples

Attention must not mix requests: token i may look at cached token j only if both belong to the same
request and pos(j) <= pos(i). The keys to read are listed as `kv_indices` (cache cells, built from
each request's block table) with their `kv_seq` and `kv_pos`; the attention function turns these
into a mask on the device (attention.py).

Everything here is built on the host (CPU) as int64 tensors, then copied to the device in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .kv_cache import PagedKVCache
from .requests import Request
from .scheduler import BatchPlan


@dataclass
class Batch:
    """The tensors of one forward step. Same class on host and device (see `to`)."""

    input_ids: torch.Tensor  # [T] token ids; 0 where the token is not known yet (async placeholder)
    positions: torch.Tensor  # [T]
    q_seq: torch.Tensor  # [T] chunk index of each token
    cell_mapping: torch.Tensor  # [T] cache cell each token's K/V is written to
    kv_indices: torch.Tensor  # [K] cache cells to read
    kv_seq: torch.Tensor  # [K] chunk index of each cell read
    kv_pos: torch.Tensor  # [K] position of each cell read
    logits_indices: torch.Tensor  # [R] which of the T tokens produce a new token
    temperature: torch.Tensor  # [R] float32 sampling parameters, one row per sampled token
    top_k: torch.Tensor  # [R]
    top_p: torch.Tensor  # [R] float32
    seed: torch.Tensor  # [R]
    counter: torch.Tensor  # [R] index of the token being sampled within its request (RNG counter)
    # not tensors: the layout, known on the host when the step is launched
    decode_rows: int = 0  # > 0: decode layout, keys laid out as [decode_rows, K // decode_rows] (see build_batch)
    all_greedy: bool = False  # every sampled row has temperature 0: sampling is one argmax (sampling.py)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_sampled(self) -> int:
        return self.logits_indices.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        moved = {n: getattr(self, n).to(device, non_blocking=non_blocking) for n in TENSOR_FIELDS}
        return Batch(**moved, **self.layout())

    def layout(self) -> dict:
        """The non-tensor fields (LAYOUT_FIELDS): what a step's shapes and code path depend on."""
        return {n: getattr(self, n) for n in LAYOUT_FIELDS}


#: the host-side layout facts that travel with a batch but are not tensors
LAYOUT_FIELDS = ("decode_rows", "all_greedy")
TENSOR_FIELDS = tuple(f.name for f in fields(Batch) if f.name not in LAYOUT_FIELDS)


def needs_placeholder(r: Request, pos: int) -> bool:
    """True if the token at position pos of r is not on the host yet (async: it is being sampled)."""
    return pos >= len(r.prompt) + len(r.output)


def input_token(r: Request, pos: int) -> int:
    """The token at position pos of r if the host knows it yet, else the placeholder 0 (notebook 05)."""
    if needs_placeholder(r, pos):
        return 0
    return r.prompt[pos] if pos < len(r.prompt) else r.output[pos - len(r.prompt)]  # no list copies


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size in `sizes` that holds n (n itself if none does)."""
    return next((b for b in sorted(sizes) if b >= n), n)


def build_batch(plan: BatchPlan, cache: PagedKVCache, kv_bucket: int = 1, decode_layout: bool = False,
                row_buckets: tuple[int, ...] = (), decode_bucket: int | None = None) -> Batch:
    """Flatten a plan into host tensors. Cost: O(T) Python work + a few vectorized ops over K.

    kv_bucket > 1 pads the key list to a multiple of kv_bucket with the cache's scratch cell, which no
    query may attend to (kv_seq = -1). On a GPU this keeps the attention kernel's shapes from changing
    every step: cuDNN attention builds a new plan for every new shape, which takes long (BENCHMARKS.md,
    history: the first sync loop).

    decode_layout: when every chunk is a single decode token, lay the keys out as a table of
    [rows, L] (row r = request r's context, padded with the scratch cell to L, a multiple of
    decode_bucket) and pad the rows to a size in `row_buckets` (padding rows read only the scratch
    cell). Attention then costs rows x L instead of rows x (sum of all contexts), and the shapes
    come from a small set, so each (rows, L) pair can be a CUDA graph (graphs.py). L is a multiple of
    `decode_bucket` (default: kv_bucket): a smaller bucket reads less padding per step but needs more
    graphs (model.py says which sizes we use and why).
    """
    ids, pos, qseq, cells, logits_idx = [], [], [], [], []
    samp: list[tuple] = []
    for i, c in enumerate(plan.chunks):
        r = c.request
        ids.extend(input_token(r, p) for p in range(c.start, c.end))
        pos.extend(range(c.start, c.end))
        qseq.extend([i] * c.num_tokens)
        cells.extend(cache.cells(r.blocks, c.start, c.end))
        if c.sample:
            logits_idx.append(len(ids) - 1)
            s = r.sampling
            samp.append((s.temperature, s.top_k, s.top_p, s.seed, r.num_sampled - 1))

    ends = [c.end for c in plan.chunks]
    tables = [c.request.blocks for c in plan.chunks]
    decode = decode_layout and all(c.num_tokens == 1 and c.sample for c in plan.chunks)
    if decode:  # pad rows: a dummy token at position 0 that writes and reads only the scratch cell
        for i in range(len(plan.chunks), bucket(len(plan.chunks), row_buckets)):
            ids.append(0), pos.append(0), qseq.append(i), cells.append(cache.scratch_cell)
            logits_idx.append(i), samp.append((0.0, 0, 1.0, 0, 0))
            ends.append(1), tables.append([cache.scratch_cell // cache.block_size])
    kv_indices, kv_seq, kv_pos = _key_list(ends, tables, cache, (decode_bucket or kv_bucket) if decode else kv_bucket,
                                           decode)
    temp, topk, topp, seed, counter = zip(*samp) if samp else ((), (), (), (), ())
    i64 = torch.int64
    return Batch(
        input_ids=torch.tensor(ids, dtype=i64),
        positions=torch.tensor(pos, dtype=i64),
        q_seq=torch.tensor(qseq, dtype=i64),
        cell_mapping=torch.tensor(cells, dtype=i64),
        kv_indices=kv_indices,
        kv_seq=kv_seq,
        kv_pos=kv_pos,
        logits_indices=torch.tensor(logits_idx, dtype=i64),
        temperature=torch.tensor(temp, dtype=torch.float32),
        top_k=torch.tensor(topk, dtype=i64),
        top_p=torch.tensor(topp, dtype=torch.float32),
        seed=torch.tensor(seed, dtype=i64),
        counter=torch.tensor(counter, dtype=i64),
        decode_rows=len(ends) if decode else 0,
        all_greedy=bool(temp) and all(t == 0 for t in temp),
    )


def _key_list(ends: list[int], tables: list[list[int]], cache: PagedKVCache, kv_bucket: int, decode: bool):
    """Cache cells to read for each chunk: every token 0..end-1 of its request, via its block table.

    Flat layout: all chunks' keys end to end, padded at the end to a multiple of kv_bucket.
    Decode layout: one row of L = round_up(max(ends), kv_bucket) per chunk, each padded.
    Padding entries point at the scratch cell with kv_seq = -1, so no query attends to them.
    """
    n = len(ends)
    ends_t = torch.tensor(ends, dtype=torch.int64)
    table = torch.zeros(n, max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    bs = cache.block_size
    if decode:
        width = -(-max(ends) // kv_bucket) * kv_bucket
        kv_pos = torch.arange(width).repeat(n, 1)  # [n, L]
        valid = kv_pos < ends_t[:, None]
        rows = torch.arange(n)[:, None].expand(n, width)
        cells = table[rows, (kv_pos // bs).clamp(max=table.shape[1] - 1)] * bs + kv_pos % bs
        kv_indices = torch.where(valid, cells, cache.scratch_cell).flatten()
        kv_seq = torch.where(valid, rows, -1).flatten()
        return kv_indices, kv_seq, torch.where(valid, kv_pos, 0).flatten()
    kv_seq = torch.repeat_interleave(torch.arange(n), ends_t)
    starts = torch.cumsum(ends_t, 0) - ends_t
    kv_pos = torch.arange(int(ends_t.sum())) - torch.repeat_interleave(starts, ends_t)
    kv_indices = table[kv_seq, kv_pos // bs] * bs + kv_pos % bs
    pad = -len(kv_indices) % kv_bucket
    if pad:
        kv_indices = torch.cat([kv_indices, torch.full((pad,), cache.scratch_cell)])
        kv_seq = torch.cat([kv_seq, torch.full((pad,), -1)])
        kv_pos = torch.cat([kv_pos, torch.zeros(pad, dtype=torch.int64)])
    return kv_indices, kv_seq, kv_pos
