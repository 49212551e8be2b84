"""Penalties against repeats: presence, frequency and repetition (SamplingParams; notebook 08).

A penalty needs to know which tokens a request has produced so far, and how often. The device keeps
no per-request state between steps, so a step that samples for a penalized request carries that
request's history in the batch, and the device counts it afresh:

    host   history_rows  0 0 0 0 1 1 1        every earlier token of each penalized row,
           history_ids   5 9 5 7 3 3 8        with 1 where it is an output token (presence and
           history_output 0 0 1 1 0 1 1       frequency count only those; repetition counts all)
    device + the newest token of every row, read from the step's own input ids after carry-over

The newest token is left to the device because in the async loop the host does not know it yet: it
is being sampled by the step in flight (notebook 05). Every token before it was sampled at least two
steps ago, so the host has it. From the two lists the device builds a [rows, vocabulary] count table
with one scatter-add, and changes the logits before temperature and filters:

    logit -= frequency_penalty * count + presence_penalty * (count > 0)            (output tokens)
    logit  = logit / r if logit > 0 else logit * r,  r = repetition_penalty       (prompt and output)

Cost: the history travels every step, so a step's copy grows with the penalized rows' lengths (the
keys the step reads bound it: slot extent K); steps without a penalized row send nothing. Steps that
carry a history have a shape of their own every step, so they run eagerly, never as a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch

_NONE = torch.zeros(0, dtype=torch.int64)
#: a step's fields when no row is penalized (one set for all: a host batch is read-only)
_UNUSED = {"history_rows": _NONE, "history_ids": _NONE, "history_output": _NONE,
           "penalties": torch.zeros(0), "penalized": False}
#: per-row values, as Batch.penalties holds them: (presence, frequency, repetition) of each sampled row
COLUMNS = 3
OFF = (0.0, 0.0, 1.0)


def history(sampled: list, ends: list[int], pad: int) -> dict:
    """Batch fields for the sampled rows (requests `sampled`, whose sampling chunks end at `ends`) and
    `pad` padding rows: history_rows/ids/output (every token before the newest, of the penalized
    rows only), penalties [rows * COLUMNS] (float32) and the layout flag `penalized`. A step with no
    penalized row sends empty tensors and penalized=False."""
    marked = [i for i, r in enumerate(sampled) if r.params.penalized]
    if not marked:
        return _UNUSED
    values = np.tile(np.array(OFF, np.float32), len(sampled) + pad)
    rows, ids, output = [], [], []
    for i in marked:
        r, known = sampled[i], ends[i] - 1  # the token at ends[i] - 1 is the newest: the device reads it
        p = r.params
        values[i * COLUMNS:(i + 1) * COLUMNS] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        prompt, out = r.prompt[:known], r.output[:max(known - len(r.prompt), 0)]
        if known - len(prompt) > len(out):
            raise RuntimeError(f"request {r.rid}: the penalties need its tokens up to {known}, but the host "
                               f"knows only {len(prompt) + len(out)}")
        if p.repetition_penalty == 1:  # presence and frequency count the output only
            prompt = []
        rows.append(np.full(len(prompt) + len(out), i, np.int64))
        ids += [np.asarray(prompt, np.int64), np.asarray(out, np.int64)]
        output += [np.zeros(len(prompt), np.int64), np.ones(len(out), np.int64)]
    t = torch.from_numpy
    return {"history_rows": t(np.concatenate(rows)), "history_ids": t(np.concatenate(ids)),
            "history_output": t(np.concatenate(output)), "penalties": t(values), "penalized": True}


def pad_rows(penalties: torch.Tensor, rows: int) -> torch.Tensor:
    """Batch.penalties with `rows` more padding rows (penalties off); empty stays empty."""
    if not penalties.shape[0] or not rows:
        return penalties
    return torch.cat([penalties, torch.tensor(OFF * rows, dtype=torch.float32)])


def penalize(logits: torch.Tensor, batch) -> torch.Tensor:
    """[R, V] logits of a batch's sampled rows -> the same, penalized (float32). On the device, no sync."""
    rows, vocab = logits.shape
    per_row = batch.penalties.view(rows, COLUMNS)
    presence, frequency, repetition = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]
    newest = batch.input_ids[batch.logits_indices]  # after carry-over: the true token, known or not
    index = (torch.cat([batch.history_rows, torch.arange(rows, device=logits.device)]),
             torch.cat([batch.history_ids, newest]))
    # the newest token is an output token unless the row samples its first (counter 0: the prompt's last)
    output = torch.cat([batch.history_output, (batch.counter > 0).long()]).float()
    counts = torch.zeros(rows, vocab, device=logits.device).index_put_(index, output, accumulate=True)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device).index_put_(
        index, torch.ones_like(index[1], dtype=torch.bool))
    logits = logits.float()
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0).float()
