"""minibatch: learn asynchronous continuous batching for LLM inference by building it.

    import minibatch
    model = minibatch.load_model("tiny")
    outs = minibatch.generate(model, ["The for statement"], max_new_tokens=64)

    with minibatch.Engine(model) as engine:       # keeps its KV cache, IO slots and CUDA graphs
        outs = engine.generate(["The for statement"], max_new_tokens=64, mode="async")

    params = minibatch.SamplingParams(max_new_tokens=64, temperature=0.7)   # per request
    config = minibatch.EngineConfig(mode="async", max_batch_size=8)         # per run
    outs = minibatch.generate(model, ["The for statement"], params, config=config)

The teaching core is minibatch/core (its docstring is the map: module -> notebook); devices/, model/,
speed/, serving/ and tools/ plug into it. See README.md for the notebook map.
"""

from . import devices  # noqa: F401  (the backends install their opener: core.device.open_device)
from .core import VERSION as __version__
from .core.config import EngineConfig
from .core.engine import Engine, generate
from .core.requests import SamplingParams
from .core.timeline import Timeline
from .model.model import Model, load_model

__all__ = ["Engine", "EngineConfig", "generate", "load_model", "Model", "SamplingParams", "Timeline", "__version__"]
