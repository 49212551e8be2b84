"""The decode step through torch.compile: one compiled function per engine, static shapes (notebook 07).

`CompiledStep` is what `generate(compile=True)` runs for decode steps; the step runner
(runner/graphs.py) captures its calls as CUDA graphs like any other step. With `merge`, q/k/v and
gate/up run as one matrix product each (siblings.py).
"""

from __future__ import annotations

import sys

import torch

from ..compat import mark_dynamic, raise_recompile_limit


class CompiledStep:
    """The decode step (forward + sampling) through torch.compile, one per engine.

    Why: an eager step is a long chain of small elementwise kernels (RMSNorm, rotary embedding, MLP
    activations), each a separate read and write of a [rows, hidden] tensor; Inductor fuses them.
    What it costs: compilation, once per decode shape (rows, greedy or not, cache size, and keys per
    row unless the attention is Triton's). Static shapes, so a shape always gets the same kernels:
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
    """

    def __init__(self, model, mode: str | None = None, merge: bool = True) -> None:
        self.model = model
        self.mode = mode  # torch.compile's mode; without CUDA graphs of its own: the runner captures them
        # one matrix product for sibling projections (q/k/v, gate/up) whose weights Model stacked: siblings.py
        self.merge = merge
        self.attention = model.decode_attention
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
        return self.attention == "triton"

    def __call__(self, batch, cache) -> torch.Tensor:
        width = None if self.dynamic_keys else batch.kv_indices.shape[0] // batch.decode_rows
        shape = (batch.decode_rows, width, batch.all_greedy, cache.num_cells, batch.unfiltered)
        if shape not in self.shapes:  # a long silent pause otherwise: say what is happening
            self.shapes.add(shape)
            keys = "any number of" if width is None else str(width)
            print(f"torch.compile: decode step for {shape[0]} rows x {keys} keys"
                  f"{' (greedy)' if shape[2] else ''}: compiling, once per shape", file=sys.stderr, flush=True)
        if self.dynamic_keys:
            for t in (batch.kv_indices, batch.kv_seq, batch.kv_pos):
                mark_dynamic(t, 0)
        if self._fn is None:
            raise_recompile_limit(64)  # one compile per shape: room for a few dozen
            if self.merge:
                from .siblings import backend

                self._fn = torch.compile(self.model.forward_sample, dynamic=False, backend=backend(self.mode))
            else:
                self._fn = torch.compile(self.model.forward_sample, dynamic=False, mode=self.mode)
        with torch.inference_mode():
            return self._fn(batch, cache, self.attention)
