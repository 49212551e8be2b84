"""The decode layout's key table, updated by what changed since the last step (batch.py).

A decode step lays each row's keys out as one row of a [rows, L] table (batch.py, decode_layout):
row r lists the cache cells of request r's tokens 0..end-1, then padding. From one decode step to
the next the same requests stay in the same rows and each row grows by one token, so the table
changes in one cell per row:

    step N      row 0: c0 c1 c2 c3 ·  ·  ·  ·        (· = padding: the scratch cell, kv_seq -1)
                row 1: d0 d1 ·  ·  ·  ·  ·  ·
    step N+1    row 0: c0 c1 c2 c3 c4 ·  ·  ·        one new cell per row
                row 1: d0 d1 d2 ·  ·  ·  ·  ·

So the host keeps the table (on the KV cache: `PagedKVCache.key_table`) and writes those cells instead of rebuilding rows x L
entries every step; and an IO slot, whose host buffers still hold the table as it was when the slot
was last loaded (one or two steps ago), copies only the cells that changed since then. Host work
per decode step is then O(rows), not O(rows x L). Anything else (a request joins or leaves, rows
move, the bucket or the padded width changes) rebuilds the table, or copies it whole into the slot.

The batch's key tensors are views of the table. While one is alive (a caller kept the batch), the
next update writes to a copy of the table first, so a batch never changes after it is built.
"""

from __future__ import annotations

import numpy as np

from .compat import referenced_elsewhere

#: the three key fields of a batch, in the order the table keeps them
FIELDS = ("kv_indices", "kv_seq", "kv_pos")


class DecodeKeys:
    """The [rows, L] key table of the last decode step built for one cache."""

    def __init__(self) -> None:
        self.key: tuple = ()  # (ids of the rows' cell tables, bucket size, scratch cell): what the table is for
        self.tables: list = []  # the rows' cell tables, held so that no other array can take their ids
        self.ends = np.zeros(0, np.int64)
        self.arrays = [np.zeros((0, 0), np.int64)] * 3  # cells, row index (-1: padding), positions
        self.all_cells = np.zeros((0, 0), np.int64)  # every row's cells up to the width, read or not yet

    def build(self, ends: np.ndarray, tables: list[np.ndarray], scratch: int, bucket_size: int):
        """The table for rows with these ends and cell tables: (flat views of the 3 arrays, a KeySource)."""
        width = -(-int(ends.max()) // bucket_size) * bucket_size
        key = (tuple(map(id, tables)), bucket_size, scratch)
        if key != self.key or (ends < self.ends).any() or (ends > self.ends + 1).any():
            self._fresh(ends, tables, scratch, width)
        else:
            # a batch still viewing an array holds a reference to it (beyond this list's)
            if any(referenced_elsewhere(self.arrays[i]) for i in range(3)):
                self.arrays = [a.copy() for a in self.arrays]  # copy on write: an earlier batch is alive
            if width > self.arrays[0].shape[1]:
                self._widen(width, scratch)
            cells, seq, pos = self.arrays
            grew = np.flatnonzero(ends > self.ends)
            at = ends[grew] - 1
            cells[grew, at] = self.all_cells[grew, at]
            seq[grew, at] = grew
            pos[grew, at] = at
        self.key, self.ends, self.tables = key, ends, tables
        return [a.reshape(-1) for a in self.arrays], KeySource(self, key, tables, ends, width)

    def _fresh(self, ends, tables, scratch, width):
        n = len(ends)
        valid = np.arange(width) < ends[:, None]
        self.all_cells = _all_cells(tables, width, scratch)
        cells = np.where(valid, self.all_cells, scratch)
        self.arrays = [cells, np.where(valid, np.arange(n)[:, None], -1), np.where(valid, np.arange(width), 0)]

    def _widen(self, width, scratch):
        n, old = self.arrays[0].shape
        self.arrays = [np.concatenate([a, np.full((n, width - old), fill, np.int64)], 1)
                       for a, fill in zip(self.arrays, (scratch, -1, 0))]
        self.all_cells = _all_cells(self.tables, width, scratch)


def _all_cells(tables, width: int, scratch: int) -> np.ndarray:
    """[rows, width]: each row's cell table up to `width`, the scratch cell past its end. Built when
    the rows or the width change; a step then reads its new cells from it in one gather."""
    out = np.full((len(tables), width), scratch, np.int64)
    for i, t in enumerate(tables):
        k = min(len(t), width)
        out[i, :k] = t[:k]
    return out


class KeySource:
    """What one batch's keys are: the table at given ends. Lets an IO slot copy only what changed."""

    def __init__(self, table: DecodeKeys, key: tuple, tables: list, ends: np.ndarray, width: int) -> None:
        self.table, self.key, self.tables, self.ends, self.width = table, key, tables, ends, width

    def load_into(self, host: dict, held: "KeySource | None", batch) -> "KeySource":
        """Write this batch's keys into an IO slot's host buffers `host`, which hold `held`'s keys (or
        anything, if None); returns what they hold afterwards. Copies only the changed cells when
        `held` is the same rows at smaller ends in the same width, else the batch's keys whole."""
        n = len(self.ends) * self.width
        bufs = [host[f].numpy()[:n] for f in FIELDS]
        same = held is not None and held.table is self.table and held.key == self.key and held.width == self.width
        step = self.ends - held.ends if same else None
        if step is None or (step < 0).any() or step.max() > 4:
            for buf, f in zip(bufs, FIELDS):
                buf[:] = getattr(batch, f).numpy()
            return self
        bufs = [b.reshape(len(self.ends), self.width) for b in bufs]
        src = [getattr(batch, f).numpy().reshape(len(self.ends), self.width) for f in FIELDS]
        for d in range(int(step.max())):  # the cells each row gained since the slot's last load
            rows = np.flatnonzero(step > d)
            cols = held.ends[rows] + d
            for buf, a in zip(bufs, src):
                buf[rows, cols] = a[rows, cols]
        return self


def decode_keys(cache, ends: np.ndarray, tables: list[np.ndarray], bucket_size: int):
    """The decode-layout keys of rows with these ends and cell tables, from `cache`'s key table
    (`cache.key_table`: the table belongs to the cache whose cells it lists)."""
    return cache.key_table.build(ends, tables, cache.scratch_cell, bucket_size)
