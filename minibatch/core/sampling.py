"""Choosing the next token, on the device (notebook 01).

`sample(logits, temperature, top_k, top_p, seed, counter)` takes one row of logits per request that
samples this step and returns one token id per row, without leaving the device: no `.item()`, no
Python branch on tensor values, fixed shapes, so the same code can later be captured in a CUDA graph.

Greedy rows (temperature 0) take the argmax. Other rows use the Gumbel-max trick: add noise
-log(-log(u)) to the (temperature-scaled, top-k/top-p filtered) logits and take the argmax; this
draws exactly from the softmax distribution. The uniform numbers u come from a counter-based hash of
(request seed, index of the token within the request, vocabulary id) instead of a global generator,
so a request's random numbers do not depend on which other requests share its batch, or on the
order in which batches run. That is what lets the sync and async loops, whose batches differ, give
the same sampled tokens.

`logprobs` is the same step for a batch that asks for log-probabilities too: the tokens chosen as
above, and for every row the chosen token's log-probability and the MAX_LOGPROBS most likely tokens
with theirs, written into the slot's logprob buffers (copied back with the tokens, so the loop stays
free of host syncs). They come from the raw logits (log_softmax before temperature or filters), as
OpenAI's and vLLM's do; a greedy token is the top-1. Rows that score a prompt (prompt logprobs)
are logits of prompt positions added after the sampled rows, each scoring the prompt's next token.
"""

from __future__ import annotations

import dataclasses

import torch

from .penalties import penalize
from .requests import MAX_LOGPROBS

_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values < 2**32.

    Constants are below 2**31 so that every product stays below 2**63: no int64 overflow on any device.
    """
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _M32
    return h ^ (h >> 16)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 uniforms in (0, 1), a pure function of (seed[r], counter[r], v).

    Every bit of a seed counts: the high 32 bits are hashed on their own and folded into the low
    bits' hash. Both hashes map 0 to 0 and are one-to-one, so seeds below 2**32 keep the stream they
    have always had, and two seeds equal modulo 2**32 never share a stream (request i of a run samples
    with seed + i, which crosses 2**32 for a seed just below it).
    """
    low = _mix32(seed & _M32) ^ _mix32(((seed >> 32) * 0x61C88647) & _M32)  # (seeds are >= 0: SamplingParams)
    key = _mix32(low ^ ((counter * 0x2545F491) & _M32))  # [R]
    v = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    h = _mix32(key[:, None] ^ ((v[None, :] * 0x27D4EB2D) & _M32))  # [R, V]
    # 23 bits: (2**23 - 0.5) / 2**23 is the largest value and still below 1.0 in float32; with 24 bits the
    # top value rounds to exactly 1.0, whose Gumbel noise is +inf, and that token would always win
    return ((h >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """[R, V] logits -> [R] int64 token ids. Rows with temperature 0 are greedy.

    `filtered=False` promises that no row uses top-k or top-p (the host knows: `Batch.unfiltered`).
    Then nothing needs the vocabulary in sorted order, and the Gumbel-max is taken over it as it is:
    the same token, since the noise of a vocabulary id is the same in either order, without a sort
    over the vocabulary per row. (Only an exact float32 tie between two noisy scores could break
    differently: by id here, by logit in the sorted order.)
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    # sampled path, computed for every row (fixed shapes, no data-dependent branches)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    gumbel = -torch.log(-torch.log(uniform_noise(seed, counter, logits.shape[-1])))  # [R, V], by vocabulary id
    if not filtered:
        return torch.where(temperature > 0, (scaled + gumbel).argmax(dim=-1), greedy)
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # stable: ties break by id
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])  # top-k: keep the k largest
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # top-p: keep the smallest prefix whose mass reaches p
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # float sums reach 1.0 early
    choice = (sorted_logits + gumbel.gather(-1, order)).masked_fill(drop, float("-inf")).argmax(dim=-1)
    sampled = order.gather(-1, choice[:, None]).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def choose(logits: torch.Tensor, batch) -> torch.Tensor:
    """[R, V] logits of a batch's sampled rows -> [R] token ids, by the fastest path the batch allows;
    ids a row holds back (`batch.banned`, min_tokens) cannot come out; penalties change the logits first."""
    if batch.penalized:
        logits = penalize(logits, batch)
    if batch.bans:  # -inf at each held-back id ("amin": a -1 slot, clamped onto id 0, cannot undo a ban of id 0)
        held = batch.banned.view(logits.shape[0], -1)
        ban = torch.where(held >= 0, float("-inf"), 0.0)
        logits = logits.float() + torch.zeros_like(logits, dtype=torch.float32).scatter_reduce_(
            1, held.clamp(min=0), ban, reduce="amin")
    if batch.all_greedy:  # the host knows: skip the sampled path (a sort over the vocabulary per row)
        return logits.float().argmax(dim=-1)
    return sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed, batch.counter,
                  filtered=not batch.unfiltered)  # no top-k/top-p in the batch: no sort either


def logprobs(logits_of, batch, cache, values_out: torch.Tensor, ids_out: torch.Tensor) -> torch.Tensor:
    """Forward (`logits_of(batch, cache)`: the model's logits) + sample + logprobs -> [R] token ids.

    Writes, for the R sampled rows and then the S scored prompt tokens, values_out as [R + S, 1 + K]
    (the chosen or scored token's logprob, then the top K's) and ids_out as [R + S, K] (the top K's
    ids), K = MAX_LOGPROBS (columns past the vocabulary's size are left as they are).
    """
    rows = batch.num_sampled
    if batch.score_indices.shape[0]:  # the scored positions' logits come after the sampled rows'
        keep = torch.cat([batch.logits_indices, batch.score_indices])
        logits = logits_of(dataclasses.replace(batch, logits_indices=keep), cache)
    else:
        logits = logits_of(batch, cache)
    tokens = choose(logits[:rows], batch)
    scored = torch.cat([tokens, batch.score_targets])
    lp = torch.log_softmax(logits.float(), dim=-1)
    n, k = lp.shape[0], min(MAX_LOGPROBS, lp.shape[-1])
    top = lp.topk(k, dim=-1)
    values = values_out[: n * (1 + MAX_LOGPROBS)].view(n, 1 + MAX_LOGPROBS)
    values[:, 0].copy_(lp.gather(1, scored[:, None]).squeeze(1))
    values[:, 1:k + 1].copy_(top.values)
    ids_out[: n * MAX_LOGPROBS].view(n, MAX_LOGPROBS)[:, :k].copy_(top.indices)
    return tokens
