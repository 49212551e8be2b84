"""The straightforward batch builder, kept as the reference the fast one (minibatch.core.batch) must match.

Per-token Python lists and a padded block-table tensor: easy to read, slow at large batches.
"""

from __future__ import annotations

import itertools

import torch

from minibatch.core.batch import Batch, input_token, needs_placeholder
from minibatch.core.requests import MAX_BANNED
from minibatch.core.buckets import bucket
from minibatch.core.kv_cache import PagedKVCache
from minibatch.core.scheduler import BatchPlan


def request_cells(cache: PagedKVCache, block_table: list[int], start: int, end: int) -> list[int]:
    bs = cache.block_size
    return [block_table[t // bs] * bs + t % bs for t in range(start, end)]


def reference_build_batch(plan: BatchPlan, cache: PagedKVCache, kv_bucket: int = 1, decode_layout: bool = False,
                row_buckets: tuple[int, ...] = (), decode_bucket: int | None = None) -> Batch:
    """The batch minibatch.core.batch.build_batch must build (same arguments, same meaning)."""
    ids, pos, qseq, cells, logits_idx = [], [], [], [], []
    samp: list[tuple] = []
    banned: list[int] = []
    history: list[tuple[int, int, int]] = []  # penalties: (row, token, 1 if an output token) of every token but the newest
    penalties: list[float] = []
    scored, targets = [], []  # prompt logprobs: every prompt position but the last scores the next token
    for i, c in enumerate(plan.chunks):
        r = c.request
        if r.params.prompt_logprobs is not None:
            for p in range(c.start, c.end):
                if p + 1 < len(r.prompt):
                    scored.append(len(ids) + p - c.start), targets.append(r.prompt[p + 1])
        ids.extend(input_token(r, p) for p in range(c.start, c.end))
        pos.extend(range(c.start, c.end))
        qseq.extend([i] * c.num_tokens)
        cells.extend(request_cells(cache, r.blocks, c.start, c.end))
        if c.sample:
            logits_idx.append(len(ids) - 1)
            s = r.params
            samp.append((s.temperature, s.top_k, s.top_p, s.seed, r.num_sampled - 1))
            held = []  # min_tokens: the end ids, while the token sampled comes before min_tokens
            if s.eos_token_id is not None and r.num_sampled - 1 < s.min_tokens:
                held = [s.eos_token_id] if isinstance(s.eos_token_id, int) else sorted(s.eos_token_id)
            banned.extend(held + [-1] * (MAX_BANNED - len(held)))
            row = len(logits_idx) - 1
            penalties.extend((s.presence_penalty, s.frequency_penalty, s.repetition_penalty))
            for p in range(c.end - 1) if s.penalized else ():
                if p < len(r.prompt) and s.repetition_penalty == 1:
                    continue  # presence and frequency count only output tokens
                assert not needs_placeholder(r, p)
                history.append((row, input_token(r, p), int(p >= len(r.prompt))))

    ends = [c.end for c in plan.chunks]
    tables = [c.request.blocks for c in plan.chunks]
    decode = decode_layout and all(c.num_tokens == 1 and c.sample for c in plan.chunks)
    if decode:  # pad rows: a dummy token at position 0 that writes and reads only the scratch cell
        for i in range(len(plan.chunks), bucket(len(plan.chunks), row_buckets)):
            ids.append(0), pos.append(0), qseq.append(i), cells.append(cache.scratch_cell)
            logits_idx.append(i), samp.append((0.0, 0, 1.0, 0, 0)), banned.extend([-1] * MAX_BANNED)
            penalties.extend((0.0, 0.0, 1.0))
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
        # flat layout: where each chunk's tokens and keys start, then where they end
        chunk_starts=torch.tensor([] if decode else [0] + list(itertools.accumulate(c.num_tokens for c in plan.chunks)),
                                  dtype=i64),
        key_starts=torch.tensor([] if decode else [0] + list(itertools.accumulate(c.end for c in plan.chunks)),
                                dtype=i64),
        temperature=torch.tensor(temp, dtype=torch.float32),
        top_k=torch.tensor(topk, dtype=i64),
        top_p=torch.tensor(topp, dtype=torch.float32),
        seed=torch.tensor(seed, dtype=i64),
        counter=torch.tensor(counter, dtype=i64),
        score_indices=torch.tensor(scored, dtype=i64), score_targets=torch.tensor(targets, dtype=i64),
        # (a step in which no row holds an id back sends none: an empty tensor)
        banned=torch.tensor(banned if any(b >= 0 for b in banned) else [], dtype=i64),
        bans=any(b >= 0 for b in banned),
        **_penalty_fields(history, penalties, any(c.sample and c.request.params.penalized for c in plan.chunks)),
        decode_rows=len(ends) if decode else 0,
        all_greedy=bool(temp) and all(t == 0 for t in temp),
        unfiltered=all(k <= 0 for k in topk) and all(p >= 1.0 for p in topp),
        logprobs=bool(scored) or any(c.request.params.logprobs is not None for c in plan.chunks if c.sample),
    )


def _penalty_fields(history: list[tuple[int, int, int]], penalties: list[float], penalized: bool) -> dict:
    i64 = torch.int64
    rows, ids, output = zip(*history) if history else ((), (), ())
    return {"history_rows": torch.tensor(rows, dtype=i64), "history_ids": torch.tensor(ids, dtype=i64),
            "history_output": torch.tensor(output, dtype=i64),
            "penalties": torch.tensor(penalties if penalized else [], dtype=torch.float32), "penalized": penalized}


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
