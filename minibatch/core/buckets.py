"""The sizes steps are padded to, so that a few shapes serve every step (notebook 04).

A CUDA graph (core/graphs.py) and a compiled step (speed/compiled.py) serve one shape each, so a
step's sizes are rounded up to the next bucket: decode steps to a row count from ROW_BUCKETS,
prefill and mixed steps to a token count from TOKEN_BUCKETS and a key count from KEY_BUCKETS
(graphs.pad_flat). The run's memory estimate (core/memory.py) sizes the IO slots for the padded
step. A finer bucket pads less but needs more graphs.
"""

from __future__ import annotations

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Prefill and mixed steps (graphs.pad_flat). Tokens: a step is usually exactly the token budget (prefill
# chunks are cut to fill it), so the buckets only need to be fine enough that the other steps waste
# little: at most 1/8 of the tokens above 256 (a large model's prefill is compute-bound: padding costs
# what it adds). Keys: the flat layout's attention costs tokens x keys, so half-octave buckets
# (at most 1.5x the keys); above KEY_BUCKETS' largest a step stays eager (its [T, K] mask alone would
# be hundreds of MB, and such steps are long enough to keep the GPU busy without a graph).
TOKEN_BUCKETS = (*range(32, 257, 32), *range(320, 1025, 64), *range(1152, 4097, 128), *range(4352, 8193, 256))
KEY_BUCKETS = tuple(sorted(b << i for b in (256, 384) for i in range(8)))  # 256 ... 49152


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size in `sizes` that holds n (n itself if none does)."""
    return next((b for b in sorted(sizes) if b >= n), n)
