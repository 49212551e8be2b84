"""The checks of `load_model`: its arguments, and whether a transformers model is one minibatch can run
(notebook 00). One pass before anything is loaded or moved."""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import numpy as np
import torch

from ..core.args import DTYPES, INT64_MAX, _int, resolve_device
from ..devices.limits import host_bytes_free

MEMORY_FRACTION = 0.9  # of the free memory a model's weights may take
_SERIAL = 16384  # elements: below torch's grain size for parallel CPU ops (32768)


def check_load(name_or_model: Any, device: Any, dtype: Any, seed: Any,
               builtin: tuple[str, ...]) -> tuple[torch.device, torch.dtype, int]:
    """Check `load_model`'s arguments; return its device (normalized), dtype (default: a given model's own;
    else float32 on the CPU, bfloat16 on a GPU) and seed. A folder's own files are checked as far as can be without loading it."""
    from transformers import PreTrainedModel

    if isinstance(name_or_model, PreTrainedModel):
        check_causal_lm(name_or_model, type(name_or_model).__name__)
    elif not isinstance(name_or_model, (str, os.PathLike)):
        raise TypeError("load_model takes a name, a path or a transformers PreTrainedModel, "
                        f"not {type(name_or_model).__name__}")
    elif (path := os.fspath(name_or_model)) not in builtin:
        if os.path.isfile(path):
            raise ValueError(f"could not load model {path!r}: it is a file; give the folder that holds config.json "
                             "and the weights")
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"could not load model {path!r}: the folder has no config.json")
        if not os.path.isdir(path) and os.path.lexists(path):
            raise ValueError(f"could not load model {path!r}: no such folder (a symlink that leads nowhere, or "
                             "loops)")
        if not os.path.isdir(path) and (path.count("/") != 1 or path.startswith(("/", ".", "~"))):
            if "/" in path or os.sep in path:
                raise ValueError(f"could not load model {path!r}: no such folder (and not a hub id of the form "
                                 "'org/name')")
            raise ValueError(f"unknown model {path!r}: not a built-in name ({', '.join(builtin)}), a local folder "
                             "or a hub id of the form 'org/name'")
        if os.path.isdir(path):
            check_shard_paths(path)
    given = next(name_or_model.parameters()) if isinstance(name_or_model, PreTrainedModel) else None
    if given is not None and (device is None or device == "auto"):
        dev = given.device  # a model passed in keeps its device unless another is asked for
    else:
        dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" means the current GPU: compare like with like
        dev = torch.device("cuda", torch.cuda.current_device())
    if dtype is None and given is not None:
        dtype = given.dtype  # ... and its dtype
    elif dtype is None:
        dtype = torch.float32
        if dev.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    elif isinstance(dtype, str) and dtype in DTYPES:
        dtype = DTYPES[dtype]
    elif dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16 (or their names as "
                         f"strings) or None, got {dtype!r}")
    return dev, dtype, _int("seed", seed, low=0, high=INT64_MAX)


def check_causal_lm(hf, name: str) -> None:
    """minibatch needs a decoder-only model with a language-modelling head (it samples from the logits)."""
    cfg = getattr(hf, "config", None)
    if not hf.can_generate() or getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"model {name!r} is a {type(hf).__name__}, which is not a decoder-only causal LM with a "
                         "language-modelling head: load it with transformers.AutoModelForCausalLM")
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
               if not isinstance(getattr(cfg, a, None), int)]
    if missing:
        raise ValueError(f"model {name!r}: its config has no {', '.join(missing)}, which minibatch sizes the KV "
                         "cache from")


def check_shard_paths(folder: str) -> None:
    """A weights index (model.safetensors.index.json) may name only files inside its folder."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        shards = set(weight_map.values())
    except (OSError, ValueError, AttributeError, TypeError):
        return  # transformers reports a broken index itself, naming the path
    root = os.path.normpath(os.path.abspath(folder))
    for shard in sorted(map(str, shards)):
        # lexical, not resolved: a hub cache's snapshot folder holds symlinks into its blobs folder
        where = os.path.normpath(os.path.join(root, shard))
        if os.path.isabs(shard) or os.path.commonpath([root, where]) != root:
            raise ValueError(f"could not load model {folder!r}: its model.safetensors.index.json names the shard "
                             f"{shard!r}, outside the folder")


def check_config_size(config, dtype: torch.dtype, device: torch.device, path: str) -> None:
    """Refuse a config whose weights could not fit in free memory, before anything is allocated: a count
    of its parameters (embeddings, attention, MLP per layer, times its experts) times the dtype's bytes."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {a: getattr(cfg, a, None) for a in ("num_hidden_layers", "hidden_size", "vocab_size",
                                                "num_attention_heads")}
    bad = [f"{a}={v!r}" for a, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ValueError(f"could not load model {path!r}: its config has {', '.join(bad)} (each must be an "
                         "integer >= 1)")
    layers, h, vocab, heads = sizes.values()
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 1
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter * max(1, int(experts))
    params = layers * per_layer + vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    need = params * dtype.itemsize
    free = host_bytes_free()
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    if need > MEMORY_FRACTION * free:
        raise ValueError(f"could not load model {path!r}: its config asks for about {params / 1e9:.3g} billion "
                         f"parameters ({layers} layers, hidden_size={h}, intermediate_size={inter}, vocab_size="
                         f"{vocab}), {need / 1e9:.3g} GB in {dtype}, but {free / 1e9:.1f} GB are free on {device}")


# a float's bits -> NaN or inf where every exponent bit is set: (integer view, exponent mask)
_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                  torch.float16: (torch.int16, 0x7C00), torch.float64: (torch.int64, 0x7FF0000000000000)}
_HOST_CHUNK = 1 << 20  # elements per numpy pass: bounded temporaries


def _host_finite(p: torch.Tensor) -> bool:
    """Every element of a CPU weight finite, checked by numpy on this thread.

    Not torch: a torch op above its grain size opens a parallel region (GNU OpenMP's thread team) in
    this process, which would break torch in any later fork of it (a multiprocessing worker hangs or
    fails at its own first parallel op). A same-size dtype view and `.numpy()` copy nothing, whatever
    the strides; numpy's bitwise ops are single-threaded. A weight of another dtype is checked on its
    first elements only (an op that small runs on this thread too)."""
    bits = _EXPONENT_BITS.get(p.dtype)
    if bits is None:
        return p.numel() == 0 or bool(torch.isfinite(p.reshape(-1)[:_SERIAL]).all())
    int_dtype, mask = bits
    a = np.atleast_1d(p.detach().view(int_dtype).numpy())
    rows = max(1, _HOST_CHUNK // max(1, math.prod(a.shape[1:])))  # bounded temporaries, along the first axis
    return not any(((a[i:i + rows] & mask) == mask).any() for i in range(0, a.shape[0], rows))


def check_finite(hf, name: str) -> None:
    """Warn about weights that hold NaN or inf: the logits would be NaN, and every sampled token 0."""
    with torch.no_grad():
        gpu = [torch.isfinite(p).all() for p in hf.parameters() if p.is_cuda]
        gpu_ok = iter(torch.stack(gpu).tolist() if gpu else [])  # one transfer, not one per parameter
        ok = [next(gpu_ok) if p.is_cuda else _host_finite(p) for p in hf.parameters()]
    bad = [n for (n, _), good in zip(hf.named_parameters(), ok) if not good]
    if bad:
        warnings.warn(f"model {name!r} has NaN or infinite weights in {', '.join(bad[:3])}"
                      f"{' and more' if len(bad) > 3 else ''}: its logits will be NaN, and its tokens meaningless",
                      stacklevel=3)
