"""IO slots: the host and device buffers of one batch, and its three events (notebook 04).

A slot holds, at fixed addresses, everything one step moves between host and device:

    host (pinned)                        device
    ┌────────────────────────┐  H2D     ┌────────────────────────┐
    │ input_ids, positions,  │ ───────▶ │ the same fields        │──▶ carry-over ─▶ forward ─▶ sample
    │ slots, keys to read,   │          │                        │                              │
    │ sampling params, mask  │          │ sampled ids            │◀─────────────────────────────┘
    │ sampled ids            │ ◀─────── │                        │
    └────────────────────────┘  D2H     └────────────────────────┘
    events: h2d_done, compute_done, d2h_done

Buffers are allocated once, at the largest size a step can need, and each step uses a prefix.
Fixed addresses are what CUDA graphs need (notebook 04), and allocating once keeps the loop free of
allocator traffic.

Why two slots: while the device runs batch N from slot A, the host writes batch N+1 into slot B.
With a single slot the host would overwrite batch N's inputs while the device may still be reading
them (the race of notebook 04). The host reuses slot A only after it has waited for batch N's
d2h_done, which comes after batch N's H2D and compute: then nothing reads slot A any more.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from .batch import TENSOR_FIELDS, Batch
from .decode_keys import FIELDS as KEY_FIELDS
from .device import Device, resident
from .penalties import COLUMNS
from .requests import MAX_BANNED, MAX_LOGPROBS

FLOAT_FIELDS = ("temperature", "top_p", "penalties")
#: which capacity each field's length is bounded by: T tokens, K keys, R sampled rows
EXTENT = {"input_ids": "T", "positions": "T", "q_seq": "T", "cell_mapping": "T",
          "kv_indices": "K", "kv_seq": "K", "kv_pos": "K", "score_indices": "T", "score_targets": "T",
          "chunk_starts": "C", "key_starts": "C", "banned": "B",
          "history_rows": "K", "history_ids": "K", "history_output": "K", "penalties": "P"}
# C: a chunk per row, and one more offset; B: MAX_BANNED and P: penalties.COLUMNS per sampled row; a
# penalized row's history is at most the keys its step reads (K)
#: logprobs, row by row (sampled rows, then scored prompt tokens): the chosen token's and the top K's
LOGPROB_COLUMNS = 1 + MAX_LOGPROBS


def capacities(max_tokens: int, max_keys: int, max_rows: int) -> dict[str, int]:
    """Entries each EXTENT holds in a slot's buffers."""
    return {"T": max_tokens, "K": max_keys, "R": max_rows, "C": max_rows + 1, "B": max_rows * MAX_BANNED,
            "P": max_rows * COLUMNS}


class IOSlot:
    """Host + device buffers for one batch. `load` fills the host side; the streams move the rest.

    Device buffers come from `dev.empty`, host buffers from `dev.pin`: each backend decides where its
    device memory is (a GPU's memory; for the cpu device, memory the device side can reach).
    """

    def __init__(self, dev: Device, index: int, max_tokens: int, max_keys: int, max_rows: int) -> None:
        self.index = index
        caps = capacities(max_tokens, max_keys, max_rows)
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}

        def device_buffer(n: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return dev.empty((n,), dtype).fill_(fill)

        for name in TENSOR_FIELDS:
            dtype = torch.float32 if name in FLOAT_FIELDS else torch.int64
            n = caps[EXTENT.get(name, "R")]
            self.host[name] = dev.pin(torch.zeros(n, dtype=dtype))
            self.dev[name] = device_buffer(n, dtype)
        self.dev["patched_ids"] = device_buffer(max_tokens, torch.int64)  # ids + carry-over
        # carry-over mask: for each row of the *previous* batch's output, where it goes in ours
        self.host["carry"] = dev.pin(torch.full((max_rows,), -1, dtype=torch.int64))
        self.dev["carry"] = device_buffer(max_rows, torch.int64, -1)
        self.out_host = dev.pin(torch.zeros(max_rows, dtype=torch.int64))
        self.out_dev = device_buffer(max_rows, torch.int64)
        lp_rows = max_rows + max_tokens  # a step's sampled rows, and at most one scored prompt token per token
        for name, dtype, width in (("lp_values", torch.float32, LOGPROB_COLUMNS), ("lp_ids", torch.int64, MAX_LOGPROBS)):
            self.host[name] = dev.pin(torch.zeros(lp_rows * width, dtype=dtype))
            self.dev[name] = device_buffer(lp_rows * width, dtype)
        self.buffers = SlotBuffers(index, self.host, self.dev, self.out_host, self.out_dev)
        self._np = {name: t.numpy() for name, t in self.host.items()}  # the same host memory, for load
        self.h2d_done, self.compute_done, self.d2h_done = dev.event(), dev.event(), dev.event()
        self.sizes: dict[str, int] = {}
        self.keys_held = None  # the decode_keys.KeySource whose keys the host buffers hold, if any
        self.layout: dict = {}  # the loaded batch's Batch.layout()

    def load(self, batch: Batch, carry: list[int]) -> None:
        """Write a host batch into this slot's host buffers (the host must own the slot: see module doc)."""
        source = batch.key_source  # decode layout: the keys are copied by what changed (decode_keys.py)
        held, self.keys_held = self.keys_held, None  # (None while the buffers are half written)
        for name in TENSOR_FIELDS:
            t = getattr(batch, name)
            n, buf = t.shape[0], self.host[name]
            if n > buf.shape[0]:
                cap = EXTENT.get(name, "R")
                raise ValueError(f"batch field {name} needs {n} entries, slot capacity {cap}={buf.shape[0]}")
            if n and (source is None or name not in KEY_FIELDS):  # (empty: the fields a step does not use)
                self._np[name][:n] = t.numpy()  # (numpy: a few µs less per field than Tensor.copy_)
            self.sizes[name] = n
        self.keys_held = source.load_into(self.host, held, batch) if source is not None else None
        # the whole mask travels, -1 past the previous batch's rows: fixed size, as a CUDA graph needs
        self._np["carry"].fill(-1)
        self._np["carry"][: len(carry)] = carry
        self.sizes["carry"] = self.host["carry"].shape[0]
        self.layout = batch.layout()

    def used(self) -> tuple:
        """((field, entries used), ...) of the loaded batch: with `buffers`, what a launch needs."""
        return tuple(self.sizes.items())

    def bind(self, prev: "IOSlot | None") -> "StepArgs":
        """The compute work's arguments, fixed at launch time, as a kernel's arguments are.

        (On the cpu backend the work runs later, on the device side; binding now keeps a later `load`
        of the host side from changing which shapes that work uses, so a race corrupts data, not shapes.)
        """
        return bound_args(self.buffers, prev and prev.buffers, self.used(), tuple(self.layout.items()))

    def key(self, prev: "IOSlot | None") -> tuple:
        """The loaded step's CUDA graph key (StepArgs.key), without binding its arguments."""
        return graph_key(self.index, None if prev is None else prev.index, self.sizes, tuple(self.layout.items()))

    def sampled(self, rows: int) -> list[int]:
        """The first `rows` sampled ids on the host (only after d2h_done)."""
        return self.out_host[:rows].tolist()

    def logprobs(self, rows: int):
        """None if the loaded step computed no logprobs; else ((values, ids) of the first `rows` sampled
        rows, (values, ids) of its scored prompt tokens): numpy copies, values [n, 1 + K] (the token's
        logprob, then the top K's), ids [n, K] (only after d2h_done)."""
        if not self.layout.get("logprobs"):
            return None
        sampled, scored = self.sizes["logits_indices"], self.sizes["score_indices"]
        values = self._np["lp_values"].reshape(-1, LOGPROB_COLUMNS)
        ids = self._np["lp_ids"].reshape(-1, MAX_LOGPROBS)
        return ((values[:rows].copy(), ids[:rows].copy()),
                (values[sampled:sampled + scored].copy(), ids[sampled:sampled + scored].copy()))


@dataclass
class StepArgs:
    """Everything one step's compute work touches: device buffers (views) and the shape key."""

    patched_ids: torch.Tensor
    input_ids: torch.Tensor
    source: torch.Tensor  # the previous batch's sampled ids (carry-over source)
    carry: torch.Tensor
    out: torch.Tensor
    lp_values: torch.Tensor  # (flat) logprobs out: sampling.logprobs writes them when batch.logprobs
    lp_ids: torch.Tensor
    batch: Batch
    key: tuple  # (slot, previous slot, tokens, keys, sampled rows, layout): one CUDA graph per key


@resident
class SlotBuffers:
    """One slot's buffers by field name, host side and device side: all that its copies and its
    compute work read or write.

    Why it exists apart from IOSlot: launch_step sends this object with the entries used, instead of
    the ~30 views that a step's copies and compute read. On the cpu device it travels once and is
    named afterwards (it is `@resident`), and the device side cuts the views itself, which
    is cheaper than rebuilding them from a message while the forward pass needs the same core.
    """

    def __init__(self, index: int, host: dict, dev: dict, out_host: torch.Tensor, out_dev: torch.Tensor) -> None:
        self.index, self.host, self.dev, self.out_host, self.out_dev = index, host, dev, out_host, out_dev


def copy_in(buffers: SlotBuffers, used: tuple) -> None:
    """H2D of the used prefix of every field; non-blocking, so from pinned host memory a GPU copy
    returns at once."""
    for name, n in used:
        if n:
            buffers.dev[name][:n].copy_(buffers.host[name][:n], non_blocking=True)


def copy_out(buffers: SlotBuffers, rows: int, logprob_rows: int = 0) -> None:
    """D2H of the first `rows` sampled ids, and of `logprob_rows` rows of logprobs."""
    buffers.out_host[:rows].copy_(buffers.out_dev[:rows], non_blocking=True)
    for name, width in (("lp_values", LOGPROB_COLUMNS), ("lp_ids", MAX_LOGPROBS)):
        n = logprob_rows * width
        if n:
            buffers.host[name][:n].copy_(buffers.dev[name][:n], non_blocking=True)


def bound_args(buffers: SlotBuffers, prev: SlotBuffers | None, used: tuple, layout: tuple) -> StepArgs:
    """A step's StepArgs: views of `buffers` at the sizes in `used`, carry-over from `prev`'s output."""
    sizes = dict(used)
    dev = buffers.dev
    n = sizes["input_ids"]
    views = {name: dev[name][: sizes[name]] for name in TENSOR_FIELDS}
    views["input_ids"] = dev["patched_ids"][:n]
    return StepArgs(
        patched_ids=dev["patched_ids"][:n], input_ids=dev["input_ids"][:n],
        source=(prev or buffers).out_dev,  # sync loop: no previous slot, and the mask is all -1
        carry=dev["carry"], out=buffers.out_dev, lp_values=dev["lp_values"], lp_ids=dev["lp_ids"],
        batch=Batch(**views, **dict(layout)),
        key=graph_key(buffers.index, None if prev is None else prev.index, sizes, layout),
    )


def graph_key(index: int, prev: int | None, sizes: dict, layout: tuple) -> tuple:
    """(slot, previous slot, tokens, keys, sampled rows, layout values): one CUDA graph per key."""
    return (index, prev, sizes["input_ids"], sizes["kv_indices"], sizes["logits_indices"], *(v for _, v in layout))
