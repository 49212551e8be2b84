"""The checks of `load_model`: its arguments, and whether a transformers model is one minibatch can run
(notebook 00). One pass before anything is loaded or moved."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..args import DTYPES, INT64_MAX, _int, resolve_device


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
        if not os.path.isdir(path) and "/" not in path:
            raise ValueError(f"unknown model {path!r}: not a built-in name ({', '.join(builtin)}), a local folder "
                             "or a hub id of the form 'org/name'")
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
