"""Speed extras plugged into the core: they change how fast a step runs, never what it computes.

    compiled.py   CompiledStep: the decode step through torch.compile (Model.compiled_step)        07
    siblings.py   q/k/v and gate/up as one matrix product inside compiled steps                     07
    fx_edits.py   the graph edits that siblings.py's passes (and the ones below) share              07
    skinny.py     a Triton kernel for products of a few rows by a narrow weight (small models)      07
    gated.py      silu(gate) * up inside that kernel's gate/up product (small models, 1-8 rows)    07
    early.py      kernels launched before the one before them ends (Hopper; compiled steps)         07
    wide_argmax.py  the argmax over a vocabulary in two steps, inside compiled steps                07
    compat.py     the private PyTorch hooks they (and the model) use, one function each               07
    startup_graphs.py  CUDA graphs captured before a server's first request (capture_up_to)  08
"""
