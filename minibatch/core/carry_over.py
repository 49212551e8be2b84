"""Carry-over: feeding batch N's sampled tokens into batch N+1 without waiting for them (notebook 05).

In the asynchronous loop the host builds batch N+1 while the device still runs batch N, so a
decoding request's next input token, the one batch N is sampling right now, is not known yet. The
host writes a **placeholder 0** in its place, and a **carry-over mask** that says, for each row of
batch N's output, where that token goes in batch N+1's input ids (or -1 if it goes nowhere: the
request finished, or was not scheduled in N+1).

    batch N output (sampled)      [ 17,  42,  99 ]        rows = requests that sampled in N
    carry-over mask               [  3,  -1,   0 ]        destination in N+1's input ids
    batch N+1 input ids (host)    [  0,   5,   6,   0 ]   0 = placeholder

On the device, before the forward pass of N+1 (and inside its CUDA graph on a GPU), four ops:

    1. gather   take batch N's output tokens                  [ 17,  42,  99 ]
    2. zero     zero the rows whose mask is -1                [ 17,   0,  99 ]
    3. place    scatter them into a vector of N+1's length    [ 99,   0,   0,  17 ]
    4. add      add it to N+1's input ids                     [ 99,   5,   6,  17 ]

Adding works because the placeholders are 0 and every other position receives 0. No host sync,
no `.item()`, fixed shapes: the device does the whole patch in stream order, right after batch N's
sampling has written its output.
"""

from __future__ import annotations

import torch

from .batch import needs_placeholder
from .scheduler import BatchPlan


def carry_over_mask(prev: BatchPlan | None, plan: BatchPlan) -> list[int]:
    """For each sampling row of `prev`, the index in `plan`'s input ids its token goes to, or -1.

    A request that samples in `prev` and has its next token (position = its prompt + outputs known to
    the host) as an input of `plan` receives it there. Rows are in `prev.sampling_chunks` order, the
    order of the device's output buffer.
    """
    if prev is None:
        return []
    where: dict[int, int] = {}  # id(request) -> index of its placeholder in plan's input ids
    offset = 0
    for r, start, end, _ in plan.chunks:
        if needs_placeholder(r, start):
            where[id(r)] = offset  # a decode chunk whose input is the token still in flight
        offset += end - start
    return [where.get(id(c.request), -1) for c in prev.sampling_chunks]


def apply_carry_over(out_ids: torch.Tensor, input_ids: torch.Tensor, prev_output: torch.Tensor,
                     mask: torch.Tensor) -> None:
    """On the device: out_ids = input_ids, plus prev_output[i] at position mask[i] for every mask[i] >= 0.

    input_ids: [T] batch N+1's ids with placeholders 0; prev_output: [R] batch N's sampled tokens;
    mask: [R] int64, -1 where a row goes nowhere. Written out of place (into `out_ids`) so that
    running it twice gives the same result, which a CUDA graph's warm-up run and replay need.
    """
    tokens = prev_output[: mask.shape[0]]  # 1. gather
    tokens = torch.where(mask >= 0, tokens, torch.zeros_like(tokens))  # 2. zero
    placed = torch.zeros_like(input_ids).index_add_(0, mask.clamp(min=0, max=input_ids.shape[0] - 1), tokens)  # 3. place
    torch.add(input_ids, placed, out=out_ids)  # 4. add
