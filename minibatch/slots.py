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

from dataclasses import fields

import torch

from .batch import Batch
from .device import Device

INT_FIELDS = ("input_ids", "positions", "q_seq", "slot_mapping", "kv_indices", "kv_seq", "kv_pos",
              "logits_indices", "top_k", "seed", "counter")
FLOAT_FIELDS = ("temperature", "top_p")
#: which capacity each field's length is bounded by: T tokens, K keys, R sampled rows
EXTENT = {"input_ids": "T", "positions": "T", "q_seq": "T", "slot_mapping": "T",
          "kv_indices": "K", "kv_seq": "K", "kv_pos": "K"}


class IOSlot:
    """Host + device buffers for one batch. `load` fills the host side; the streams move the rest."""

    def __init__(self, dev: Device, index: int, max_tokens: int, max_keys: int, max_rows: int,
                 device: torch.device) -> None:
        self.index = index
        caps = {"T": max_tokens, "K": max_keys, "R": max_rows}
        self.caps = caps
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for f in fields(Batch):
            dtype = torch.float32 if f.name in FLOAT_FIELDS else torch.int64
            n = caps[EXTENT.get(f.name, "R")]
            self.host[f.name] = dev.pin(torch.zeros(n, dtype=dtype))
            self.dev[f.name] = torch.zeros(n, dtype=dtype, device=device)
        # carry-over mask: for each row of the *previous* batch's output, where it goes in ours
        self.host["carry"] = dev.pin(torch.full((max_rows,), -1, dtype=torch.int64))
        self.dev["carry"] = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.out_host = dev.pin(torch.zeros(max_rows, dtype=torch.int64))
        self.out_dev = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.h2d_done, self.compute_done, self.d2h_done = dev.event(), dev.event(), dev.event()
        self.sizes: dict[str, int] = {}

    def load(self, batch: Batch, carry: list[int]) -> None:
        """Write a host batch into this slot's host buffers (the host must own the slot: see module doc)."""
        for f in fields(Batch):
            t = getattr(batch, f.name)
            buf = self.host[f.name]
            if t.shape[0] > buf.shape[0]:
                cap = EXTENT.get(f.name, "R")
                raise ValueError(f"batch field {f.name} needs {t.shape[0]} entries, slot capacity {cap}={buf.shape[0]}")
            buf[: t.shape[0]].copy_(t)
            self.sizes[f.name] = t.shape[0]
        self.host["carry"][: len(carry)] = torch.tensor(carry, dtype=torch.int64)
        self.sizes["carry"] = len(carry)

    def copy_in(self) -> None:
        """H2D: copy the used prefix of every host buffer to the device (call on the H2D stream)."""
        for name, n in self.sizes.items():
            if n:
                self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)

    def copy_out(self) -> None:
        """D2H: sampled ids back to the host buffer (call on the D2H stream)."""
        n = self.sizes["logits_indices"]
        self.out_host[:n].copy_(self.out_dev[:n], non_blocking=True)

    def device_batch(self) -> Batch:
        """Views of the device buffers, trimmed to this batch's sizes."""
        return Batch(**{f.name: self.dev[f.name][: self.sizes[f.name]] for f in fields(Batch)})

    def sampled(self) -> list[int]:
        """The sampled ids on the host (only after d2h_done)."""
        return self.out_host[: self.sizes["logits_indices"]].tolist()


def _forward(model, cache, slot: IOSlot, prev: IOSlot | None) -> None:
    """Device work of one step: patch in carried-over tokens, forward, sample into the slot's output."""
    from .carry_over import apply_carry_over

    batch = slot.device_batch()
    n_carry = slot.sizes["carry"]
    if n_carry and prev is not None:
        apply_carry_over(batch.input_ids, prev.out_dev, slot.dev["carry"][:n_carry])
    tokens = model.step(batch, cache)
    slot.out_dev[: tokens.shape[0]].copy_(tokens)


def launch_step(model, cache, streams, slot: IOSlot, prev: IOSlot | None, step: int) -> None:
    """Enqueue one step's H2D, compute and D2H on three streams, chained by the slot's events.

    Returns at once; the host learns the step is done from `slot.d2h_done`.
    """
    h2d, compute, d2h = streams
    tag = dict(step=step, slot=slot.index)
    h2d.launch(slot.copy_in, name="H2D", lane="H2D", **tag)
    h2d.record(slot.h2d_done)
    compute.wait(slot.h2d_done)  # inputs must have landed
    compute.launch(_forward, model, cache, slot, prev, name="compute", lane="compute", **tag)
    compute.record(slot.compute_done)
    d2h.wait(slot.compute_done)  # outputs must exist
    d2h.launch(slot.copy_out, name="D2H", lane="D2H", **tag)
    d2h.record(slot.d2h_done)
