"""Running one step on the device: launch on three streams, CUDA graphs, torch.compile.

Above: the model and the engine call it. Below: batching (what a step holds) and the devices.

    launch.py     launch_step: H2D, compute, D2H on three streams chained by events; forward_step  03-06
    graphs.py     StepRunner: builds a step's batch, runs it eagerly or as a CUDA graph replay       04
    compiled.py   CompiledStep: the decode step through torch.compile                                07
    siblings.py   q/k/v and gate/up as one matrix product inside compiled steps                      07
"""

from .compiled import CompiledStep
from .graphs import StepRunner
from .launch import forward_step, launch_step

__all__ = ["CompiledStep", "StepRunner", "forward_step", "launch_step"]
