"""The private PyTorch hooks of the speed extras and the model, one function each (tests/test_compat.py).

Why each hook is a function of its own here, and how tests/test_compat.py checks it: minibatch/core/compat.py.

    tensor_version     a tensor's in-place write counter (Tensor._version)          model/model.py
    rebind_data        point a parameter at other storage (Tensor.data = ...)       speed/siblings.py
    LINEAR(_TARGETS)   the function an FX graph's linear nodes call                speed/siblings.py
    inductor_compile   Inductor, as torch.compile's backend would run it            speed/siblings.py
    persistent_rows    Inductor's rule for persistent reductions, widened           speed/siblings.py
    raise_recompile_limit / mark_dynamic   torch._dynamo's limit and shape hints    speed/compiled.py

It imports only torch.
"""

from __future__ import annotations

import torch

__all__ = ["tensor_version", "rebind_data", "LINEAR", "LINEAR_TARGETS", "inductor_compile", "persistent_rows",
           "raise_recompile_limit", "mark_dynamic"]


def tensor_version(t: torch.Tensor) -> int:
    """How many in-place writes `t`'s storage has seen (-1 where torch keeps no count).

    Why: an engine keeps CUDA graphs and a forked device process that read the model's weights where
    they were; it must notice weights written in place (`load_state_dict`, `copy_`), which leave the
    address unchanged. Autograd's version counter is the only record of such writes; torch has no
    public name for it. On 2.11 and 2.13 `Tensor._version` is an int bumped by every in-place op;
    reading it on a tensor made under `torch.inference_mode` raises RuntimeError (such tensors keep no
    counter), hence -1.
    """
    try:
        return t._version
    except RuntimeError:
        return -1


def rebind_data(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make `t` (a Parameter, typically) use `new`'s storage, keeping the Python object `t` itself.

    Why: stacking a layer's q/k/v weights into one tensor (speed/siblings.py) must leave every module
    holding the same Parameter object (hooks, optimizers, `named_parameters` and transformers' tied
    weights refer to it), now a view of the stacked block. `Tensor.data = ...` is the only way to swap
    the storage under an existing Parameter; `torch.utils.swap_tensors` swaps whole objects instead.
    On 2.11 and 2.13 it replaces the tensor's storage, shape, strides and offset without autograd
    seeing it; shape and dtype must match what `t` was (checked here, so a mistake is not silent).
    """
    if new.shape != t.shape or new.dtype != t.dtype:
        raise ValueError(f"rebind_data: {tuple(new.shape)} {new.dtype} cannot stand in for {tuple(t.shape)} {t.dtype}")
    t.data = new


#: What a `torch.nn.functional.linear` call is in an FX graph that torch.compile hands its backend
#: (dynamo records the C++ binding `torch._C._nn.linear`), and what a graph rewrite inserts for a new
#: linear call. On 2.11 and 2.13 `F.linear` *is* that binding (one object); LINEAR_TARGETS holds both
#: names, so a node still matches should a version wrap the binding in a Python function.
LINEAR = torch._C._nn.linear
LINEAR_TARGETS: tuple = tuple({id(f): f for f in (LINEAR, torch.nn.functional.linear)}.values())


def inductor_compile(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, patches: tuple = ()):
    """Compile an FX graph with Inductor as `torch.compile(mode=mode)` would, and return the callable.
    `patches`: (name, value) pairs of Inductor config on top of the mode's (e.g. ("triton.enable_pdl", True)).

    Why: a custom torch.compile backend (speed/siblings.py rewrites the graph first) must then hand it
    to Inductor with the options that `mode` stands for. torch exports no function for either step:
    `torch._inductor.compile_fx.compile_fx` is what the "inductor" backend calls, and
    `torch._inductor.list_mode_options` maps a mode name to its config patches. Both exist with these
    signatures on 2.11 and 2.13 ("max-autotune-no-cudagraphs" -> max_autotune and coordinate descent).
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = {**(list_mode_options(mode, dynamic=False) if mode else {}), **dict(patches)}
    return compile_fx(gm, example_inputs, config_patches=options or None)


def persistent_rows(rows: int):
    """A context in which Inductor also makes a reduction of at most `rows` rows (statically known) over at most
    1024 elements one persistent kernel, whatever its reduction hint; `rows` 0: Inductor's own rule.

    Why: Inductor keeps a reduction in registers (a persistent kernel, one pass) up to 1024 elements only where
    it knows the reduced dimension is contiguous in memory (`ReductionHint.INNER`); else up to 64, and past
    that it loops over blocks whose sizes it picks by timing configs while compiling. The compiled step's
    first RMSNorm reads the token embedding through a gather, so it has no such hint: a looped kernel of a
    few rows of 1024 that took 2 us in some compiles and 8-10 in others. The rule is
    `InductorChoices.should_use_persistent_reduction`; Inductor documents subclassing InductorChoices and
    installing it with `V.set_choices_handler` (a context manager, per thread) as its way to change such
    heuristics. On 2.11 and 2.13 the method is a staticmethod taking (features, cooperative_reduction),
    features carrying the kernel's `numel` (rows) and `reduction_numel` as sympy expressions. The key of
    Inductor's cache of compiled graphs does not hold the handler: timing the rule against Inductor's own in one
    process needs that cache off for one of them (floor_matrix.py's `persistent=` variants turn it off).
    """
    import contextlib

    if not rows:
        return contextlib.nullcontext()
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class FewRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if cooperative_reduction or not config.triton.persistent_reductions:
                return False
            sizes = V.graph.sizevars
            return sizes.statically_known_leq(features.numel, rows) and \
                sizes.statically_known_leq(features.reduction_numel, 1024)

    return V.set_choices_handler(FewRows())


def raise_recompile_limit(at_least: int = 64) -> None:
    """Let torch.compile keep at least `at_least` compiled versions of one function.

    Why: a compiled decode step is compiled once per shape (rows x keys bucket); past dynamo's limit
    (8 by default) it silently runs uncompiled. The limit is a global config value of the private
    `torch._dynamo` module, so this changes it for the whole process (only ever upwards). Its name is
    `recompile_limit` on 2.11 and 2.13; older versions called it `cache_size_limit` (2.13 keeps that
    name as an alias), so both are raised where present.
    """
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(at_least, getattr(dynamo.config, name)))


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that `t`'s size along `dim` varies between calls: one compile serves all.

    Why: the Triton decode attention reads any number of keys per row, so the key tensors' length need
    not cost a compile each. `torch._dynamo.mark_dynamic` is the documented way, under a private
    module name; on 2.11 and 2.13 it tags the tensor object, and a later compile of a graph reading
    it makes that size symbolic.
    """
    import torch._dynamo as dynamo

    dynamo.mark_dynamic(t, dim)
