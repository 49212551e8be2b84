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
The host builds a batch every step, so the work is vectorized: each request's cells are computed
once (its block table is fixed at admission), and a step costs a few numpy slices per chunk plus
copies over the keys, not Python work per key.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .buckets import bucket
from .decode_keys import decode_keys
from .kv_cache import PagedKVCache
from .penalties import history
from .requests import MAX_BANNED, Request
from .scheduler import BatchPlan


@dataclass
class Batch:
    """The tensors of one forward step. Same class on host and device (see `to`).

    A host batch is read-only: in the decode layout its key tensors are views of the table that
    the next step's batch is built from (decode_keys.py).
    """

    input_ids: torch.Tensor  # [T] token ids; 0 where the token is not known yet (async placeholder)
    positions: torch.Tensor  # [T]
    q_seq: torch.Tensor  # [T] chunk index of each token
    cell_mapping: torch.Tensor  # [T] cache cell each token's K/V is written to
    kv_indices: torch.Tensor  # [K] cache cells to read
    kv_seq: torch.Tensor  # [K] chunk index of each cell read
    kv_pos: torch.Tensor  # [K] position of each cell read
    logits_indices: torch.Tensor  # [R] which of the T tokens produce a new token
    chunk_starts: torch.Tensor  # [C] flat layout: where chunk i's tokens start, then their end (T of them)
    key_starts: torch.Tensor  # [C] where chunk i's keys start in kv_indices, then their end; both empty in the decode layout
    temperature: torch.Tensor  # [R] float32 sampling parameters, one row per sampled token
    top_k: torch.Tensor  # [R]
    top_p: torch.Tensor  # [R] float32
    seed: torch.Tensor  # [R]
    counter: torch.Tensor  # [R] index of the token being sampled within its request (RNG counter)
    score_indices: torch.Tensor  # [S] tokens whose logits score the next prompt token (prompt logprobs)
    score_targets: torch.Tensor  # [S] that next prompt token
    banned: torch.Tensor  # [R * MAX_BANNED] ids row r may not sample (min_tokens), -1 past them; empty unless `bans`
    history_rows: torch.Tensor  # [H] the penalized rows' earlier tokens (penalties.py): which row,
    history_ids: torch.Tensor  # [H] which token,
    history_output: torch.Tensor  # [H] 1 if an output token, 0 if the prompt's; all three empty unless `penalized`
    penalties: torch.Tensor  # [R * 3] float32 presence, frequency, repetition per row; empty unless `penalized`
    # not tensors: the layout, known on the host when the step is launched
    decode_rows: int = 0  # > 0: decode layout, keys laid out as [decode_rows, K // decode_rows] (see build_batch)
    all_greedy: bool = False  # every sampled row has temperature 0: sampling is one argmax (sampling.py)
    unfiltered: bool = False  # no row uses top-k or top-p: sampling needs no sort (sampling.py)
    padded: bool = False  # a flat batch padded to bucketed sizes (graphs.pad_flat): like a decode batch, it can be a CUDA graph
    logprobs: bool = False  # some row wants logprobs, or some token scores the prompt (sampling.logprobs)
    bans: bool = False  # some row holds its end-of-sequence ids back (min_tokens: sampling.choose)
    penalized: bool = False  # some row has a penalty on (penalties.py): an eager step, never a graph
    # host only: where the decode layout's keys came from, so an IO slot can copy just what changed
    # since it last held them (decode_keys.py); None for other batches and on the device
    key_source: object = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_sampled(self) -> int:
        return self.logits_indices.shape[0]

    def rows(self):
        """Decode rows (0: not the decode layout), as the model's forward reads them. A compiled step
        with a dynamic row count (speed/compiled.py) sets decode_rows to DYNAMIC_ROWS, so that the
        count comes from a tensor's length, which torch.compile can keep symbolic, and not from a
        Python int, which it would compile each value of anew: in the decode layout every row is one
        token, so the count is the number of tokens."""
        return self.input_ids.shape[0] if self.decode_rows == DYNAMIC_ROWS else self.decode_rows

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        moved = {n: getattr(self, n).to(device, non_blocking=non_blocking) for n in TENSOR_FIELDS}
        return Batch(**moved, **self.layout())

    def layout(self) -> dict:
        """The non-tensor fields (LAYOUT_FIELDS): what a step's shapes and code path depend on."""
        return {n: getattr(self, n) for n in LAYOUT_FIELDS}


#: decode_rows of a batch whose row count a compiled step reads from its tensors (Batch.rows)
DYNAMIC_ROWS = -1

#: the host-side layout facts that travel with a batch but are not tensors
LAYOUT_FIELDS = ("decode_rows", "all_greedy", "unfiltered", "padded", "logprobs", "bans", "penalized")
TENSOR_FIELDS = tuple(f.name for f in fields(Batch) if f.name not in LAYOUT_FIELDS + ("key_source",))


def needs_placeholder(r: Request, pos: int) -> bool:
    """True if the token at position pos of r is not on the host yet (async: it is being sampled)."""
    return pos >= len(r.prompt) + len(r.output)


def input_token(r: Request, pos: int) -> int:
    """The token at position pos of r if the host knows it yet, else the placeholder 0 (notebook 05).

    (The same test as needs_placeholder, written out: it runs once per decoding request per step.)"""
    prompt = r.prompt
    if pos < len(prompt):
        return prompt[pos]
    k, out = pos - len(prompt), r.output
    return out[k] if k < len(out) else 0  # no list copies


def build_batch(plan: BatchPlan, cache: PagedKVCache, kv_bucket: int = 1, decode_layout: bool = False,
                row_buckets: tuple[int, ...] = (), decode_bucket: int | None = None) -> Batch:
    """Flatten a plan into host tensors. Cost: O(chunks) Python work + numpy copies over T and K.

    kv_bucket > 1 pads the key list to a multiple of kv_bucket with the cache's scratch cell, which no
    query may attend to (kv_seq = -1). On a GPU this keeps the attention kernel's shapes from changing
    every step: cuDNN attention builds a new plan for every new shape, which takes long.

    decode_layout: when every chunk is a single decode token, lay the keys out as a table of
    [rows, L] (row r = request r's context, padded with the scratch cell to L, a multiple of
    decode_bucket) and pad the rows to a size in `row_buckets` (padding rows read only the scratch
    cell). Attention then costs rows x L instead of rows x (sum of all contexts), and the shapes
    come from a small set, so each (rows, L) pair can be a CUDA graph (core/graphs.py). L is a multiple of
    `decode_bucket` (default: kv_bucket): a smaller bucket reads less padding per step but needs more
    graphs (model/model.py says which sizes we use and why).
    """
    n = len(plan.chunks)
    tables, ids, starts, ends, counts, sample, sampled, decode = _gather(plan.chunks, cache.allocator, decode_layout)
    temp = [r.params.temperature for r in sampled]
    samp = [[r.params.top_k for r in sampled], [r.params.top_p for r in sampled],
            [r.params.seed for r in sampled], [r.num_sampled - 1 for r in sampled]]
    rows = bucket(n, row_buckets) if decode else n
    if rows > n:  # decode padding rows: a dummy token at position 0 that writes and reads only the scratch cell
        starts, ends, counts, sample = _pad_rows(rows - n, cache.scratch_cell, tables, ids, temp, samp,
                                                 starts, ends, counts, sample)
    first = np.cumsum(counts) - counts  # index of each chunk's first token (padding rows come last)
    q_seq = np.repeat(np.arange(rows), counts)
    positions = np.arange(len(q_seq)) + np.repeat(starts - first, counts)
    source = None
    if decode:
        (kv_indices, kv_seq, kv_pos), source = decode_keys(cache, ends, tables, decode_bucket or kv_bucket)
        # a row's new token is the last key it reads: its cell is in the key table already
        cell_mapping = kv_indices.reshape(rows, -1)[np.arange(rows), starts]
    else:
        cell_mapping = np.concatenate([t[s:e] for t, s, e in zip(tables, starts.tolist(), ends.tolist())] or [_EMPTY])
        kv_indices, kv_seq, kv_pos = _flat_keys(ends, tables, cache.scratch_cell, kv_bucket)
    t = torch.from_numpy
    return Batch(
        input_ids=t(np.array(ids, np.int64)),
        positions=t(positions),
        q_seq=t(q_seq),
        cell_mapping=t(cell_mapping),
        kv_indices=t(kv_indices),
        kv_seq=t(kv_seq),
        kv_pos=t(kv_pos),
        logits_indices=t((first + counts - 1)[sample]),  # the last token of each sampling chunk
        **_offsets(counts, ends, decode),  # chunk_starts, key_starts
        temperature=t(np.array(temp, np.float32)),
        top_k=t(np.array(samp[0], np.int64)),
        top_p=t(np.array(samp[1], np.float32)),
        seed=t(np.array(samp[2], np.int64)),
        counter=t(np.array(samp[3], np.int64)),
        **_score_rows(plan.scoring, first), **_banned(sampled, rows - n),  # score_*, banned and bans
        **history(sampled, ends[sample][:len(sampled)].tolist(), rows - n),  # history_*, penalties, penalized
        decode_rows=rows if decode else 0,
        all_greedy=bool(temp) and not any(temp),
        unfiltered=not any(k > 0 for k in samp[0]) and all(p >= 1.0 for p in samp[1]),
        logprobs=bool(plan.scoring) or any(r.params.logprobs is not None for r in sampled),
        key_source=source,
    )



def _offsets(counts: np.ndarray, ends: np.ndarray, decode: bool) -> dict:
    """Batch.chunk_starts and key_starts: where each chunk's tokens and keys start, then where the last ends
    (the offsets a variable-length attention kernel takes, model/attention.py); empty in the decode layout."""
    if decode:
        return {"chunk_starts": _NONE, "key_starts": _NONE}
    return {"chunk_starts": torch.from_numpy(np.append(0, np.cumsum(counts))),
            "key_starts": torch.from_numpy(np.append(0, np.cumsum(ends)))}


def _banned(sampled: list[Request], pad: int) -> dict:
    """Batch.banned: [rows * MAX_BANNED] the end-of-sequence ids each sampled row holds back (min_tokens:
    while the token it samples, number num_sampled - 1, comes before min_tokens), -1 past them and in
    the `pad` padding rows; and Batch.bans, whether any row holds one back. A step where none does
    sends nothing (an empty tensor): no copy to the device for the steps that never use it."""
    held = [(i, r.params.eos_token_id) for i, r in enumerate(sampled)
            if r.params.min_tokens > r.num_sampled - 1 and r.params.eos_token_id is not None]
    if not held:
        return {"banned": _NONE, "bans": False}
    out = np.full((len(sampled) + pad) * MAX_BANNED, -1, np.int64)
    for i, eos in held:
        ends = [eos] if isinstance(eos, int) else sorted(eos)
        out[i * MAX_BANNED:i * MAX_BANNED + len(ends)] = ends
    return {"banned": torch.from_numpy(out), "bans": True}


def _score_rows(scoring: list, first: np.ndarray) -> dict:
    """Prompt logprobs: for each scoring chunk (i, chunk), the batch index of every position before
    the prompt's last (Batch.score_indices), and the prompt token after it, whose logprob that
    position's logits give (score_targets)."""
    if not scoring:
        return {"score_indices": _NONE, "score_targets": _NONE}
    idx, tgt = [], []
    for i, c in scoring:
        prompt = c.request.prompt
        hi = min(c.end, len(prompt) - 1)
        idx.append(first[i] + np.arange(hi - c.start))
        tgt.append(np.asarray(prompt[c.start + 1:hi + 1], np.int64))
    t = torch.from_numpy
    return {"score_indices": t(np.concatenate(idx)), "score_targets": t(np.concatenate(tgt))}


def _gather(chunks, allocator, decode_layout: bool):
    """One pass over the plan's chunks: block tables, input ids, start/end/count per chunk, which sample,
    the requests that sample, and whether the step has the decode layout."""
    n = len(chunks)
    if decode_layout and n and all(c.end - c.start == 1 and c.sample for c in chunks):
        # one token per row (the steady state of decoding): a few comprehensions instead of the general loop
        starts_l = [c.start for c in chunks]
        sampled = [c.request for c in chunks]
        ids = [input_token(r, s) for r, s in zip(sampled, starts_l)]
        starts = np.array(starts_l, np.int64)
        tables = _tables(sampled, allocator, [s + 1 for s in starts_l])
        return tables, ids, starts, starts + 1, np.ones(n, np.int64), np.ones(n, bool), sampled, True
    # one pass over the chunks; everything else is numpy over whole arrays
    ids: list[int] = []
    starts, ends, sample, sampled = [], [], [], []
    for r, start, end, samples in chunks:
        starts.append(start), ends.append(end), sample.append(samples)
        prompt = r.prompt
        if end <= len(prompt):  # (part of) the prompt: all known
            ids.extend(prompt[start:end])
        elif end - start == 1:  # a decode token: the last output, or a placeholder while it is in flight
            ids.append(input_token(r, start))
        else:
            ids.extend(input_token(r, p) for p in range(start, end))
        if samples:
            sampled.append(r)
    tables = _tables([c.request for c in chunks], allocator, ends)
    starts, ends, sample = np.array(starts, np.int64), np.array(ends, np.int64), np.array(sample, bool)
    counts = ends - starts
    decode = decode_layout and n > 0 and bool((counts == 1).all() and sample.all())
    return tables, ids, starts, ends, counts, sample, sampled, decode


def _pad_rows(pad: int, scratch: int, tables: list, ids: list, temp: list, samp: list, starts, ends, counts, sample):
    """Append `pad` dummy decode rows (lists in place; the arrays are returned anew)."""
    tables += [_scratch_table(scratch)] * pad
    starts, ends, counts = (np.concatenate([a, np.full(pad, v, np.int64)]) for a, v in
                            ((starts, 0), (ends, 1), (counts, 1)))
    sample = np.concatenate([sample, np.ones(pad, bool)])
    ids += [0] * pad
    temp += [0.0] * pad
    for column, v in zip(samp, (0, 1.0, 0, 0)):
        column += [v] * pad
    return starts, ends, counts, sample


_EMPTY = np.zeros(0, np.int64)
#: the empty field of a step that does not use it; one tensor for all (a host batch is read-only)
_NONE = torch.from_numpy(_EMPTY)


@functools.lru_cache(maxsize=8)
def _scratch_table(scratch: int) -> np.ndarray:
    """The cell table of a padding row: its one token lives in the scratch cell."""
    return np.full(1, scratch, np.int64)


_BLOCKS = operator.attrgetter("blocks")


def _tables(requests: list[Request], allocator, ends: list[int]) -> list[np.ndarray]:
    """The requests' cell tables (kept by the cache's allocator), checked to cover each one's tokens
    up to its end in `ends`."""
    tables = allocator.cell_tables(list(map(_BLOCKS, requests)))
    if any(map(operator.gt, ends, map(len, tables))):
        r, end, table = next((r, e, t) for r, e, t in zip(requests, ends, tables) if e > len(t))
        raise ValueError(f"request {r.rid}: tokens up to {end} but KV blocks for only {len(table)}")
    return tables


def _flat_keys(ends: np.ndarray, tables: list[np.ndarray], scratch: int, kv_bucket: int):
    """All chunks' keys end to end (chunk i reads its request's tokens 0..ends[i]-1), padded at the end
    to a multiple of kv_bucket with the scratch cell and kv_seq = -1, so no query attends to padding."""
    n = len(ends)
    total = int(ends.sum())
    pad = -total % kv_bucket
    ends_l = ends.tolist()
    kv_indices = np.concatenate([t[:e] for t, e in zip(tables, ends_l)] + [np.full(pad, scratch, np.int64)])
    kv_seq = np.concatenate([np.repeat(np.arange(n), ends), np.full(pad, -1, np.int64)])
    longest = np.arange(max(ends_l, default=0))
    kv_pos = np.concatenate([longest[:e] for e in ends_l] + [np.zeros(pad, np.int64)])
    return kv_indices, kv_seq, kv_pos
