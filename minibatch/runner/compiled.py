"""The decode step through torch.compile: one compiled function per engine (notebook 07).

`CompiledStep` is what `generate(compile=True)` runs for decode steps; the step runner
(runner/graphs.py) captures its calls as CUDA graphs like any other step. With `merge`, q/k/v and
gate/up run as one matrix product each (siblings.py). `compile="dynamic"` (what a server uses) compiles
one step for every row count instead of one per row count.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from ..batching.batch import DYNAMIC_ROWS
from ..compat import mark_dynamic, raise_recompile_limit

# a decode batch's tensors with one entry per row (in the decode layout a row is one token)
ROW_FIELDS = ("input_ids", "positions", "q_seq", "cell_mapping", "logits_indices", "temperature", "top_k",
              "top_p", "seed", "counter")


class CompiledStep:
    """The decode step (forward + sampling) through torch.compile, one per engine.

    Why: an eager step is a long chain of small elementwise kernels (RMSNorm, rotary embedding, MLP
    activations), each a separate read and write of a [rows, hidden] tensor; Inductor fuses them.
    What it costs: compilation, once per decode shape (rows, greedy or not, cache size, and keys per
    row unless the attention is Triton's). Static shapes (unless `dynamic_rows`, below), so a shape
    always gets the same kernels:
    with PyTorch's "automatic dynamic" shapes the kernels that serve a shape depend on the order
    shapes come up in, and sync and async runs (which see shapes in different orders) would give
    different bf16 tokens. The one exception is made where it cannot change a kernel: the Triton decode
    attention is a custom operator (triton_decode.paged_decode) that Inductor calls as it is, and the
    key tensors go nowhere else, so their length is marked dynamic: one compile serves every context
    length, and compiled steps pad keys as finely as eager ones (decode_kv_bucket). With the other
    attentions, the keys' length shapes the compiled kernels, and compiled runs pad decode rows to
    the coarser kv_bucket keys to keep compiles few (StepRunner.build). bf16 tokens may differ from
    the eager step's (other kernels round differently): compare compiled runs with compiled runs.
    With `merge` (the default) q/k/v and gate/up run as one matrix product each (siblings.py); its
    bf16 tokens may differ from an unmerged compiled step's for the same reason.

    `dynamic_rows`: the row count (and the keys' length) symbolic from the first compile, so one
    compile serves every decode batch of two rows or more, and one more serves a single row
    (torch.compile specializes sizes 0 and 1). Why: a server's batch size follows its traffic, and
    with static shapes each new row bucket compiles while every request waits (tens of seconds for an
    8B model: BENCHMARKS.md, Serving). Still deterministic: which kernels serve a shape does not depend
    on the order shapes come up in, since no shape is ever compiled statically; the kernels are general
    ones, so bf16 tokens may differ from a static compile's. The row count reaches the model through
    `Batch.rows()` (batch.py), read from a tensor's length instead of the Python int `decode_rows`.
    """

    def __init__(self, model, mode: str | None = None, merge: bool = True, dynamic_rows: bool = False) -> None:
        self.model = model
        self.mode = mode  # torch.compile's mode; without CUDA graphs of its own: the runner captures them
        # one matrix product for sibling projections (q/k/v, gate/up) whose weights Model stacked: siblings.py
        self.merge = merge
        self.attention = model.decode_attention
        self.dynamic_rows = dynamic_rows
        self.shapes: set[tuple] = set()
        self._fn = None

    @property
    def merged(self) -> list[int]:
        """Per compile (of any CompiledStep of this mode): linear calls merged into a sibling's."""
        from .siblings import backend

        return backend(self.mode).merged if self.merge else []

    @property
    def dynamic_keys(self) -> bool:
        """Whether one compile serves every number of keys per row (see the class doc)."""
        return self.attention == "triton" or self.dynamic_rows

    def __call__(self, batch, cache) -> torch.Tensor:
        rows = batch.decode_rows
        width = None if self.dynamic_keys else batch.kv_indices.shape[0] // rows
        symbolic = self.dynamic_rows and rows > 1
        # (a greedy step never reads `unfiltered`: forward_sample returns the argmax first)
        shape = (None if symbolic else rows, width, batch.all_greedy, cache.num_cells,
                 batch.unfiltered or batch.all_greedy)
        if shape not in self.shapes:  # a long silent pause otherwise: say what is happening
            self.shapes.add(shape)
            keys = "any number of" if width is None else str(width)
            print(f"torch.compile: decode step for {'any number of' if symbolic else rows} rows x {keys} keys"
                  f"{' (greedy)' if shape[2] else ''}: compiling, once per shape", file=sys.stderr, flush=True)
        if self.dynamic_keys:
            for t in (batch.kv_indices, batch.kv_seq, batch.kv_pos):
                mark_dynamic(t, 0)
        if symbolic:
            for name in ROW_FIELDS:
                mark_dynamic(getattr(batch, name), 0)
            batch = dataclasses.replace(batch, decode_rows=DYNAMIC_ROWS)
        if self._fn is None:
            raise_recompile_limit(64)  # one compile per shape: room for a few dozen
            if self.merge:
                from .siblings import backend

                self._fn = torch.compile(self.model.forward_sample, dynamic=False, backend=backend(self.mode))
            else:
                self._fn = torch.compile(self.model.forward_sample, dynamic=False, mode=self.mode)
        with torch.inference_mode():
            return self._fn(batch, cache, self.attention)
