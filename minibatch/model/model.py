"""Loading a transformers causal LM and plugging the paged KV cache into it (notebook 00).

We do not touch the model's architecture or kernels: importing this module registers our attention
function with transformers under the name "minibatch_paged" (attention.py), and `load_model` sets
every loaded model to use it. The batch's metadata reaches that function as an extra keyword
argument of the model's forward (`minibatch=...`, see `Model._forward`).
On a GPU one more thing happens at set-up: the weights of sibling projections (q/k/v, gate/up) are
moved into one tensor each, values unchanged, so that compiled steps can run them as one matrix
product (siblings.py).

Built-in names for `load_model`:
  "tiny"                 a small byte-level Llama trained on Python's own help text (ships in the repo)
  "random-llama" / "random-qwen2" / "random-qwen3" / "random-mistral"   tiny random-weight configs
  "llama3-8b-shape", "llama3-1b-shape", "qwen3-0.6b-shape"             random weights, real shapes (GPU)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from .attention import ATTN_NAME, PagedMeta, varlen_available
from ..core.batch import Batch
from .checks import check_causal_lm, check_config_size, check_finite, check_load
from ..core.kv_cache import PagedKVCache
from ..core.sampling import choose
from ..speed.compat import tensor_version
from ..core.device import platform, resident

TINY_DIR = Path(__file__).parents[1] / "assets" / "tiny"

_TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
RANDOM_CONFIGS: dict[str, tuple[str, dict]] = {
    "random-llama": ("LlamaConfig", _TINY_SHAPE),
    "random-qwen2": ("Qwen2Config", _TINY_SHAPE),
    "random-qwen3": ("Qwen3Config", {**_TINY_SHAPE, "head_dim": 16}),
    "random-mistral": ("MistralConfig", {**_TINY_SHAPE, "sliding_window": 4096}),
    # real shapes with random weights, for timing on a GPU (weights are never downloaded)
    "llama3-8b-shape": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                            max_position_embeddings=8192, rope_theta=500000.0)),
    "llama3-1b-shape": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                            max_position_embeddings=8192, tie_word_embeddings=True)),
    "qwen3-0.6b-shape": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                             head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True)),
}



@dataclass
@resident
class Model:
    """A transformers causal LM set up for minibatch: paged attention, eval mode, one device."""

    hf: PreTrainedModel
    device: torch.device
    tokenizer: Any = None
    name: str = ""

    def __post_init__(self) -> None:
        cfg = self.hf.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.dtype = next(self.hf.parameters()).dtype
        can = platform(self.device)
        # the key list padded to a multiple of kv_bucket keys, decode steps in the [rows, L] key layout
        # (flat + mask otherwise), decode rows padded to a multiple of decode_kv_bucket keys (batch.py):
        # the hardware's defaults (core/device.py, Platform), which a caller may change per model
        self.kv_bucket, self.decode_layout, self.decode_kv_bucket = can.kv_bucket, can.decode_layout, can.decode_kv_bucket
        # decode-layout attention: "triton" (reads the paged cache in place: triton_decode.py), "sdpa"
        # (gathers each row's keys, then one fused kernel) or "einsum" (the readable version). On a GPU
        # the Triton kernel is the default where Triton is installed: it reads the keys in place instead
        # of gathering a copy first, and is the faster of the two at every batch and context in
        # BENCHMARKS.md and its history (notes/benchmarks_history_2026-11-29_to_2026-12-02.md)
        self.decode_attention = "einsum"
        if self.device.type == "cuda":  # the Triton kernel and SDPA's fused decode are CUDA kernels
            from . import triton_decode
            fits = self.head_dim & (self.head_dim - 1) == 0  # the kernel tiles head_dim by powers of two
            self.decode_attention = "triton" if triton_decode.available() and fits else "sdpa"
        # flat steps (prefills, mixed): FlashAttention's varlen kernel where it runs (CUDA, half precision,
        # head_dim a multiple of 8 up to 256), else SDPA with a mask (attention.py says why)
        self.flat_attention = "sdpa"
        if (self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16) and self.head_dim <= 256
                and self.head_dim % 8 == 0 and varlen_available()):
            self.flat_attention = "varlen"
        # transformers builds an attention mask before the layers run; for our attention name it would
        # look for packed sequences in position_ids (a `.all()` in a Python `if`: a host sync on a GPU)
        # and build a [T, T] mask that paged_attention never reads. A mask that is already 4-D is
        # passed through as it is, so this one-element tensor stands in for it.
        self._mask_stand_in = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # packing now, before any CUDA graph is captured, keeps every graph pointing at weights that
        # stay where they are
        if self.pack_weights():
            torch.cuda.empty_cache()  # (the weights' old blocks, free now)

    def pack_weights(self) -> int:
        """On a GPU, sibling projections' weights in one tensor each, for compiled steps (siblings.py):
        the values do not change. Again before each run (the engine), in case they moved since. ->
        the groups stacked now (0 elsewhere)."""
        if not platform(self.device).compiles:
            return 0
        from ..speed import siblings

        return siblings.pack(self.hf)

    def compiled_step(self, dynamic_rows: bool = False):
        """This model's decode step through torch.compile (speed/compiled.py), for an engine's runs with
        compile=True (`dynamic_rows`: compile="dynamic")."""
        from ..speed.compiled import CompiledStep

        return CompiledStep(self, dynamic_rows=dynamic_rows)

    def weights_seen(self) -> tuple:
        """Where every weight is and its version (bumped by any in-place write): a change means weights
        were loaded into the model, or moved by `.to()` and back, since this was last read."""
        return tuple((p.data_ptr(), tensor_version(p)) for p in self.hf.parameters())

    def make_cache(self, num_blocks: int, block_size: int, device=None) -> PagedKVCache:
        """A paged KV cache for this model, on `device` (a minibatch Device allocates it: an engine
        passes its own; default: the model's torch device)."""
        return PagedKVCache(self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, block_size,
                            device=self.device if device is None else device, dtype=self.dtype)

    def _forward(self, batch: Batch, cache: PagedKVCache, decode_attention: str | None = None) -> torch.Tensor:
        """One forward pass over a device batch -> [R, vocab] logits of the sampling positions."""
        out = self.hf(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            attention_mask=self._mask_stand_in,
            logits_to_keep=batch.logits_indices,
            use_cache=False,
            minibatch=PagedMeta(cache, batch, decode_attention or self.decode_attention, self.flat_attention),
        )
        return out.logits[0]

    def forward_sample(self, batch: Batch, cache: PagedKVCache, decode_attention: str | None = None) -> torch.Tensor:
        """Forward + sample -> [R] int64 next tokens (what `next_tokens` runs; what a compiled step compiles).
        `decode_attention` overrides the model's for this call."""
        return choose(self._forward(batch, cache, decode_attention), batch)

    @torch.inference_mode()
    def logits(self, batch: Batch, cache: PagedKVCache) -> torch.Tensor:
        return self._forward(batch, cache)

    @torch.inference_mode()
    def next_tokens(self, batch: Batch, cache: PagedKVCache) -> torch.Tensor:
        """Forward + sample, all on the device -> [R] int64 next tokens. No host sync. (A *step* is one
        turn of the loop: schedule, build, launch this, update; `forward_sample` is the same work
        outside inference mode, for torch.compile.)"""
        return self.forward_sample(batch, cache)


def _random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    cls_name, kwargs = RANDOM_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    with device:  # build directly on the device: an 8B model never passes through host memory
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_model(
    name_or_model: str | os.PathLike | PreTrainedModel,
    device: str | torch.device | None = "auto",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Model:
    """Load a causal LM for minibatch.

    name_or_model: "tiny" (built in, no download), a name from RANDOM_CONFIGS, a local folder or hub
    id for `from_pretrained`, or an already-built transformers model. For names and folders, dtype
    defaults to float32 on the CPU and bfloat16 on a GPU (float16 where the GPU has no bfloat16), and
    device "auto" means a GPU if there is one; "float32", "bfloat16" and "float16" work as strings too.
    Code shipped in a model folder or hub repo is never run (`trust_remote_code=False`), and every
    loading failure is a ValueError naming the path.

    A model you pass in keeps its dtype and device unless you ask for others ("auto" means its own
    device); if you do, it is moved or cast in place, with a warning, since `Module.to` changes the
    object itself. Either way it is put in eval mode and its attention implementation is set to
    minibatch's paged attention (which falls back to SDPA when called without minibatch's batch
    metadata, so the model's own `generate` still works). On a GPU its q/k/v and gate/up weights are
    also moved, values unchanged, into one tensor per layer and group (siblings.py).
    """
    dev, dtype, seed = check_load(name_or_model, device, dtype, seed, builtin=("tiny", *RANDOM_CONFIGS))
    tokenizer = None
    if isinstance(name_or_model, PreTrainedModel):
        hf, name = name_or_model, type(name_or_model).__name__
        own = next(hf.parameters())
        changes = [f"{what} {a} -> {b}" for what, a, b in (("device", own.device, dev), ("dtype", own.dtype, dtype))
                   if a != b]
        if changes:
            warnings.warn(f"load_model changes the model you passed in place: {', '.join(changes)}", stacklevel=2)
            hf.to(device=dev, dtype=dtype)
    else:
        name = os.fspath(name_or_model)
        if name in RANDOM_CONFIGS:
            hf = _random_model(name, dev, dtype, seed)
        elif name == "tiny":
            from .tokenizer import ByteTokenizer
            hf, tokenizer = _from_pretrained(TINY_DIR, dev, dtype), ByteTokenizer()
        else:  # a local folder or a hub id
            hf, tokenizer = _from_pretrained(name, dev, dtype), _try_tokenizer(name)
    if not (isinstance(name_or_model, (str, os.PathLike)) and name in RANDOM_CONFIGS):
        check_finite(hf, name)
    hf.eval()
    hf.set_attn_implementation(ATTN_NAME)
    return Model(hf, dev, tokenizer, name)


def _from_pretrained(path, dev: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # keep notebook output deterministic
    try:
        # trust_remote_code=False: never run a folder's own Python, and never ask on stdin whether to
        try:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - OSError, JSON, custom code: one error naming the path
            raise _load_error(path, e) from e
        check_config_size(config, dtype, dev, str(path))  # before a single weight is allocated
        try:
            hf, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, trust_remote_code=False, output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - OSError, SafetensorError, custom code: one error naming the path
            raise _load_error(path, e) from e
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    check_causal_lm(hf, str(path))
    if info["missing_keys"]:  # transformers fills them with random numbers: the model would emit noise
        missing = sorted(info["missing_keys"])
        raise ValueError(f"could not load model {str(path)!r}: the folder has no weights for {', '.join(missing[:3])}"
                         f"{' and more' if len(missing) > 3 else ''} of {type(hf).__name__} (a model saved without "
                         "its causal LM head?)")
    return hf.to(dev)


def _load_error(path, e: Exception) -> ValueError:
    cause = " ".join(str(e).split())  # transformers' messages span lines
    return ValueError(f"could not load model {str(path)!r}: {type(e).__name__}: {cause}")


def _try_tokenizer(path):
    try:
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - no usable tokenizer (missing, custom code, broken): token ids still work
        return None
