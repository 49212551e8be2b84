"""A transformers causal LM, plugged into the paged KV cache.

A plug-in: the core engine runs it (core/engine.py MODEL_NEEDS); it reads the core's batch, KV cache and sampling.

    model.py          load_model and Model: one model on one device, set up for minibatch          00
    checks.py         load_model's checks: arguments, decoder-only LM, config sizes                00
    attention.py      the paged attention function registered with transformers; the choices    00, 07
    triton_decode.py  the Triton decode kernel that reads the KV cache in place                    07
    fresh.py          q/k/v straight from their projections into that kernel (small models)      07
    triton_fresh.py   that kernel's pieces for them: norm, rotary embedding, the new key          07
    tokenizer.py      the tiny model's byte-level tokenizer                                        00
"""

from .model import Model, load_model
from . import fresh  # (importing it adds its rule to compiled decode steps: speed/compiled.py's AROUND)

__all__ = ["Model", "load_model", "fresh"]
