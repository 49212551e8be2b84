"""Prefix caching: requests that start alike share the KV blocks of their common start (notebook 08).

Many requests begin with the same tokens: a chat's system prompt, a few-shot preamble, an
evaluation's question asked with each of its answers. Their keys and values over those tokens are
the same, since a token's K/V depend only on the tokens up to it. So a full block of a prompt, once
computed, is kept under a key made of its tokens and of the key of the block before it (the whole
prefix up to it, not the block alone), and a later request whose prompt starts with the same blocks
takes them instead of computing them again:

    request A   [sys0 sys1 sys2 | q0 q1]     blocks  b4 b7 | b2       A computes all, keys b4 and b7
    request B   [sys0 sys1 sys2 | r0 r1 r2]  blocks  b4 b7 | b9 b3    B starts at token 8: shares b4, b7

Only full blocks of the prompt are shared, and a request always computes at least its prompt's last
token (the step that samples its first token needs that token's logits). Blocks are counted: a block
a running request holds is never handed to another one. When its last holder finishes, a kept block
stays in the cache, idle, until a request needs a block and the free list is empty; then the idle
block used least recently is evicted (its key forgotten) and handed out.

When a block is kept: as soon as a step is planned that writes its last token. A request admitted in
that same step may already share it: within a layer the attention writes every token's K/V into the
cache before it reads any (model/attention.py), and in the async loop a later step runs after it on
the same compute stream. Requests that want their prompt's logprobs compute their whole prompt (a
shared block has no logits) but still keep their blocks for others.

Keys are exact: each entry holds its block's tokens and its parent's key, and a lookup compares both,
so a hash collision can only miss, never share the wrong block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from .kv_cache import BlockAllocator


class _Entry(NamedTuple):
    block: int
    parent: int | None  # the key of the block before it (None: the prompt's first block)
    tokens: tuple[int, ...]


class PrefixCache:
    """The blocks an allocator hands out, with full prompt blocks kept by content and shared.

    The scheduler asks it instead of the allocator: `admit` (blocks for a new request, the shared ones
    first), `kept` (blocks a planned step fills), `free` (a request's blocks back), `num_free` (blocks
    it could hand out now: free or idle), `clear` (everything back to the allocator, at a run's end).
    With `enabled` False it keeps nothing: every request gets fresh blocks, as from the allocator.
    """

    def __init__(self, allocator: BlockAllocator, enabled: bool = True) -> None:
        self.allocator, self.block_size, self.enabled = allocator, allocator.block_size, enabled
        self._entries: dict[int, _Entry] = {}  # key -> entry
        self._key_of: dict[int, int] = {}  # kept block -> its key
        self._holders: dict[int, int] = {}  # kept block -> running requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept blocks no request holds, least recent first
        self._chains: dict[object, list[int]] = {}  # request -> keys of its prompt's blocks kept so far
        self.hit_tokens = 0  # prompt tokens taken from the cache instead of computed
        self.prompt_tokens = 0  # prompt tokens of every admitted request

    @property
    def num_free(self) -> int:
        return self.allocator.num_free + len(self._idle)

    @property
    def num_kept(self) -> int:
        return len(self._key_of)

    def _key(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def match(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """(blocks, keys) of the longest kept prefix of `prompt`, leaving at least its last token out."""
        bs, blocks, keys, parent = self.block_size, [], [], None
        for i in range((len(prompt) - 1) // bs):
            tokens = tuple(prompt[i * bs:(i + 1) * bs])
            key = self._key(parent, tokens)
            entry = self._entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            blocks.append(entry.block)
            keys.append(key)
            parent = key
        return blocks, keys

    def admit(self, request, need: int) -> tuple[list[int], int] | None:
        """`need` blocks for `request`: its kept prefix's, then fresh ones; and how many of its prompt's
        tokens they already hold. None if they cannot all be had now (nothing changes then)."""
        shareable = self.enabled and request.params.prompt_logprobs is None  # (a shared block has no logits)
        shared, keys = self.match(request.prompt) if shareable else ([], [])
        idle_left = len(self._idle) - sum(b in self._idle for b in shared)
        if need - len(shared) > self.allocator.num_free + idle_left:
            return None
        for b in shared:
            self._holders[b] += 1
            self._idle.pop(b, None)
        blocks = shared + self._fresh(need - len(shared))
        if self.enabled:
            self._chains[request] = keys
        self.hit_tokens += len(shared) * self.block_size
        self.prompt_tokens += len(request.prompt)
        return blocks, len(shared) * self.block_size

    def _fresh(self, n: int) -> list[int]:
        """n blocks nobody holds: from the free list, then by evicting idle kept blocks, oldest first."""
        blocks = self.allocator.allocate(min(n, self.allocator.num_free))
        while len(blocks) < n:
            b, _ = self._idle.popitem(last=False)
            del self._entries[self._key_of.pop(b)], self._holders[b]
            blocks.append(b)  # (still the allocator's "owned": it passes from the cache to the request)
        return blocks

    def kept(self, request, computed: int) -> None:
        """`request`'s tokens before `computed` are written by a planned step: keep its full prompt blocks
        among them. A block whose content is kept already (another request's) stays the request's own."""
        chain = self._chains.get(request)
        if chain is None:
            return
        bs, prompt = self.block_size, request.prompt
        for i in range(len(chain), min(computed, len(prompt)) // bs):
            tokens = tuple(prompt[i * bs:(i + 1) * bs])
            parent = chain[-1] if chain else None
            key = self._key(parent, tokens)
            chain.append(key)
            if key not in self._entries:  # (its blocks past the shared ones are fresh: none is kept yet)
                block = request.blocks[i]
                self._entries[key] = _Entry(block, parent, tokens)
                self._key_of[block], self._holders[block] = key, 1

    def free(self, request) -> None:
        """`request`'s blocks back: kept ones lose a holder (idle when none is left), the rest are freed."""
        self._chains.pop(request, None)
        blocks = request.blocks
        for b in blocks:
            if b in self._key_of:
                self._holders[b] -= 1
                if not self._holders[b]:
                    self._idle[b] = None  # the most recently used end
        self.allocator.free(blocks, keep=self._key_of)

    def clear(self) -> None:
        """Every idle kept block back to the allocator, every key forgotten (a run ends: none is held)."""
        held = [b for b in self._key_of if b not in self._idle]
        assert not held, f"KV blocks {held[:5]} still held as a run ends"
        self.allocator.free(list(self._idle))
        self._entries.clear(), self._key_of.clear(), self._holders.clear(), self._idle.clear(), self._chains.clear()
