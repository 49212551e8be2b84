"""The decode step through torch.compile: one compiled function per engine (notebook 07).

`CompiledStep` is what `generate(compile=True)` runs for decode steps; the step runner
(core/graphs.py) captures its calls as CUDA graphs like any other step. With `merge`, q/k/v and
gate/up run as one matrix product each (siblings.py); with `skinny`, products of a few rows by a
narrow weight run on a kernel of our own (skinny.py). `compile="dynamic"` (what a server uses) compiles
one step for every row count instead of one per row count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch

from ..core.batch import DYNAMIC_ROWS
from ..core.sampling import sample
from . import early
from .compat import mark_dynamic, raise_recompile_limit
from ..core.device import resident

#: Inductor config of a compiled step with static rows on a GPU: combo kernels put independent small kernels
#: of a graph (q's and k's norm and rotary embedding, for one) into one launch, and benchmark_combo_kernel
#: keeps a combination only where it times faster than its parts (without that, a combined reduction took
#: 14-17 us at 4-8 rows of the 0.6B shape, against 4 us for its parts). Compiles take longer (the timing).
#: Not with dynamic rows: never timed there. BENCHMARKS.md, small models.
COMBO = {"combo_kernels": True, "benchmark_combo_kernel": True}

#: Hooks of the layers above (model/fresh.py's): each `hook(step)`, called as a CompiledStep is made, returns a
#: context manager factory that each of the step's calls holds open, or None. (This layer cannot import them.)
AROUND: list = []

#: An experiment, off until timed on a GPU: each step's carry-over (core/carry_over.py) as one Inductor kernel
#: (`carry_over_sum`) instead of the seven eager kernels its four ops make inside a step's graph (two fills, a
#: compare, a where, a clamp, an index_add, an add: 0.9-1.8 us each in a 0.95 ms step of the 0.6B shape at
#: batch 1, figures/data/runs/gpu_small_models_combo_2026-12-04/). Same ids, bit for bit (integers).
CARRY_OVER = False


def carry_over_sum(out_ids: torch.Tensor, input_ids: torch.Tensor, prev_output: torch.Tensor,
                   mask: torch.Tensor) -> None:
    """core.carry_over.apply_carry_over written as one reduction, which Inductor makes one kernel:
    out_ids[t] = input_ids[t] + the sum of the carried tokens whose mask entry is t (one token or none)."""
    tokens = prev_output[: mask.shape[0]]
    hits = mask[None, :] == torch.arange(input_ids.shape[0], device=mask.device)[:, None]  # [T, R]
    out_ids.copy_(input_ids + torch.where(hits, tokens[None, :], torch.zeros_like(tokens)[None, :]).sum(1))


# a decode batch's tensors with one entry per row (in the decode layout a row is one token)
ROW_FIELDS = ("input_ids", "positions", "q_seq", "cell_mapping", "logits_indices", "temperature", "top_k",
              "top_p", "seed", "counter")


@resident
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
    bf16 tokens may differ from an unmerged compiled step's for the same reason. With `skinny` (the
    default on CUDA with Triton, when merged) the products of 1-4 rows by a narrow weight (a small model's attention
    output and MLP down projections) run on skinny.py's kernel instead of cuBLAS's, which leaves most of
    the GPU idle on them (BENCHMARKS.md, small models); the same caveat on bf16 bits holds. On Hopper and
    later, the step's kernels launch early (early.py: Inductor's, and ours inside its calls; `inductor`
    adds or overrides Inductor config): the arithmetic is the same, so are the bits. With static rows on
    a GPU, Inductor also launches independent small kernels together where that times faster (COMBO), and
    in every static-row compiled step the argmax over the vocabulary runs in two steps (wide_argmax.py,
    same token). Small models' static-row steps on a GPU hand q/k/v straight to the Triton decode kernel
    (model/fresh.py's rule, through AROUND).

    `dynamic_rows`: the row count (and the keys' length) symbolic from the first compile, so one
    compile serves every decode batch of two rows or more, and one more serves a single row
    (torch.compile specializes sizes 0 and 1). Why: a server's batch size follows its traffic, and
    with static shapes each new row bucket compiles while every request waits (tens of seconds for an
    8B model: BENCHMARKS.md's history, "Serving over HTTP, third run"). Still deterministic: which kernels serve a shape does not depend
    on the order shapes come up in, since no shape is ever compiled statically; the kernels are general
    ones, so bf16 tokens may differ from a static compile's. The row count reaches the model through
    `Batch.rows()` (batch.py), read from a tensor's length instead of the Python int `decode_rows`.
    With `dynamic_rows` the forward (to the logits) is one compile for every sampling variant, and
    the sampler is compiled apart (`pick`, a small graph: greedy and unfiltered sampling) or, for a
    batch with top-k or top-p, runs eagerly. Why: torch 2.11's Inductor fails to generate the Triton
    kernel for that sampler's cumulative sum over a 128256-entry vocabulary once the row count is
    symbolic (a split scan; BENCHMARKS.md's history, "Serving over HTTP, sixth run"), and a server that compiles its forward once
    instead of once per variant is ready sooner. The eager filtered sampler costs a few more kernels
    per step than a compiled one, only in steps whose batch holds a filtered request.
    """

    def __init__(self, model, mode: str | None = None, merge: bool = True, dynamic_rows: bool = False,
                 skinny: bool | None = None, inductor: dict | None = None) -> None:
        self.model = model
        self.mode = mode  # torch.compile's mode; without CUDA graphs of its own: the runner captures them
        # one matrix product for sibling projections (q/k/v, gate/up) whose weights Model stacked: siblings.py
        self.merge = merge
        self.attention = model.decode_attention
        self.dynamic_rows = dynamic_rows
        # products of a few rows by a narrow weight through skinny.py's kernel (default: on CUDA with Triton,
        # in merged steps: its rule was measured on their products; unmerged, an 8B's k and v would qualify)
        if skinny is None:
            from . import skinny as kernel

            skinny = merge and model.device.type == "cuda" and kernel.available()
        self.skinny = skinny
        # Inductor config on top of the mode's: by default its kernels launch early where the GPU allows (early.py),
        # and, with static rows on a GPU, small independent kernels share launches (COMBO)
        combo = COMBO if model.device.type == "cuda" and not dynamic_rows else {}
        self.inductor = {**early.inductor_options(model.device), **combo, **(inductor or {})}
        self._around = [f for f in (hook(self) for hook in AROUND) if f is not None]
        self.shapes: set[tuple] = set()
        self._fn = None
        self._pick = None  # with dynamic_rows: the sampler, compiled apart (see the class doc)
        self._carry = None

    @property
    def merged(self) -> list[int]:
        """Per compile (of any CompiledStep of this mode): linear calls merged into a sibling's."""
        return self._backend().merged if self.merge else []

    @property
    def routed(self) -> list[int]:
        """Per compile (of any CompiledStep with these options): linear calls handed to skinny.py's operator,
        which runs the kernel or F.linear per call (`skinny.settings`)."""
        return self._backend().routed

    @property
    def argmaxes(self) -> list[int]:
        """Per compile (of any CompiledStep with these options): argmax calls over a vocabulary computed in
        two steps (wide_argmax.py)."""
        return self._backend().argmaxes

    @property
    def carry_over(self):
        """The step's carry-over as one compiled kernel (CARRY_OVER, on CUDA; one compile for every size), which
        forward_step then runs instead of the eager ops; else None."""
        if not (CARRY_OVER and self.model.device.type == "cuda"):
            return None
        if self._carry is None:
            self._carry = torch.compile(carry_over_sum, dynamic=True, options=dict(self.inductor))
        return self._carry

    def _backend(self):
        from .siblings import backend

        return backend(self.mode, self.merge, self.skinny, self.inductor)

    @property
    def dynamic_keys(self) -> bool:
        """Whether one compile serves every number of keys per row (see the class doc)."""
        return self.attention == "triton" or self.dynamic_rows

    def _compile(self, fn):
        if self.merge or self.skinny or self.inductor:  # (a graph without sibling projections or products,
            return torch.compile(fn, dynamic=False, backend=self._backend())  # such as the sampler's, passes unchanged)
        return torch.compile(fn, dynamic=False, mode=self.mode)

    def __call__(self, batch, cache) -> torch.Tensor:
        rows = batch.decode_rows
        width = None if self.dynamic_keys else batch.kv_indices.shape[0] // rows
        symbolic = self.dynamic_rows and rows > 1
        # top-k or top-p in the batch (a greedy step never reads `unfiltered`: forward_sample returns the argmax first)
        filtered = not (batch.unfiltered or batch.all_greedy)
        shape = (None if symbolic else rows, width, batch.all_greedy, cache.num_cells, not filtered)
        if shape not in self.shapes:  # a long silent pause otherwise: say what is happening
            self.shapes.add(shape)
            keys = "any number of" if width is None else str(width)
            if not self.dynamic_rows:
                print(f"torch.compile: decode step for {rows} rows x {keys} keys{' (greedy)' if shape[2] else ''}: "
                      "compiling, once per shape", file=sys.stderr, flush=True)
            else:
                seen = self.shapes - {shape}  # (the cache's size is static: a new one compiles the forward)
                said = [] if any(s[3] == shape[3] for s in seen) else [
                    "the forward for any number of rows and keys: compiling, once for every sampling variant"]
                if shape[4] and not any(s[2] == shape[2] and s[4] for s in seen):
                    said.append(f"the {'greedy' if shape[2] else 'sampled'} token choice: compiling, once")
                elif not shape[4]:
                    said.append("top-k/top-p: sampled eagerly (speed/compiled.py)")
                if said:
                    print(f"torch.compile: decode step: {'; '.join(said)}", file=sys.stderr, flush=True)
        if self.dynamic_keys:
            for t in (batch.kv_indices, batch.kv_seq, batch.kv_pos):
                mark_dynamic(t, 0)
        if symbolic:
            for name in ROW_FIELDS:
                mark_dynamic(getattr(batch, name), 0)
            batch = dataclasses.replace(batch, decode_rows=DYNAMIC_ROWS)
        if self._fn is None:
            raise_recompile_limit(64)  # one compile per shape: room for a few dozen
            # dynamic rows: the forward alone (to the logits), the sampler apart (see the class doc)
            fn = self.model._forward if self.dynamic_rows else self.model.forward_sample
            self._fn = self._compile(fn)
        with torch.inference_mode(), early.inside(), contextlib.ExitStack() as around:
            for f in self._around:
                around.enter_context(f())
            if not self.dynamic_rows:
                return self._fn(batch, cache, self.attention)
            logits = self._fn(batch, cache, self.attention)
            if filtered:  # top-k or top-p: eagerly
                return sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seed, batch.counter)
            if symbolic:
                mark_dynamic(logits, 0)
            if self._pick is None:
                self._pick = self._compile(pick)
            return self._pick(logits, batch.temperature, batch.seed, batch.counter, batch.all_greedy)


def pick(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor,
         greedy: bool) -> torch.Tensor:
    """The next tokens of a batch without top-k or top-p (what Model.forward_sample does after the
    forward), as a function of its own for a compiled step with dynamic rows: `greedy` is a Python
    bool, so greedy and sampled batches compile apart."""
    if greedy:
        return logits.float().argmax(dim=-1)
    return sample(logits, temperature, None, None, seed, counter, filtered=False)  # (no top-k/top-p read)
