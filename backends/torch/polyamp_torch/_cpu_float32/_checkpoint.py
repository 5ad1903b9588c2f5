"""Activation checkpointing under polyamp's CPU regions: ``torch.utils.checkpoint`` recomputes under the
float32-op setting of the forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from polyamp_torch._cpu_float32._kernels import _AUTOCAST_CPU, _is_excluded
from polyamp_torch._cpu_float32._region import _STATE

# -- activation checkpointing ----------------------------------------------------------------------------


def _in_region(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with the float32-op setting it was checkpointed under, as torch restores autocast.

    torch's checkpoint recomputes under the CPU autocast state of the forward; this adds polyamp's setting
    to it. Where CPU autocast is off the setting changes nothing (torch turns it off for the recomputation
    too), so the function is returned as it is; where it is on, the recomputation runs with exactly the
    forward's setting, also when ``backward()`` runs inside a region with another one.
    """
    if _is_excluded(_AUTOCAST_CPU) or getattr(function, "_polyamp_recompute", False):
        return function
    active = _STATE.active

    @functools.wraps(function, updated=())
    def recompute(*args: Any, **kwargs: Any) -> Any:
        previous = _STATE.active
        _STATE.active = active
        try:
            return function(*args, **kwargs)
        finally:
            _STATE.active = previous

    recompute._polyamp_recompute = True  # type: ignore[attr-defined]
    return recompute


#: Prefix of the non-reentrant implementation's generators: ``_checkpoint_without_reentrant_generator``
#: (every torch) and ``_checkpoint_without_reentrant_generator_impl`` (torch >= 2.14, which ``checkpoint``
#: calls; the first one is left as a shim calling it). Each takes the function to recompute first.
_GENERATOR_PREFIX = "_checkpoint_without_reentrant_generator"
#: Modules that import a generator by name: torch's composable ``checkpoint(module)``.
_GENERATOR_IMPORTERS = ("torch.distributed._composable.checkpoint_activation",)


def _wrap_generator(generator: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(generator, "_polyamp", False):
        return generator

    def non_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return generator(_in_region(fn), *args, **kwargs)

    non_reentrant._polyamp = True  # type: ignore[attr-defined]
    return functools.wraps(generator)(non_reentrant)


def _patch_checkpoint() -> None:
    """Makes ``torch.utils.checkpoint`` recompute under the float32-op setting of the forward.

    Both implementations receive the function to recompute as their first argument: the reentrant one in
    ``CheckpointFunction.forward(ctx, run_function, ...)``, the non-reentrant one in its generators (every
    module-level function named ``_checkpoint_without_reentrant_generator*``). They are looked up when
    ``checkpoint`` runs, so wrapping them covers every way of calling ``checkpoint``; a module that imported
    a generator by name before (torch's composable ``checkpoint(module)``) gets the wrapped one too. A torch
    without them is left as it is.
    """
    import sys

    import torch.utils.checkpoint as checkpoint

    function_class = getattr(checkpoint, "CheckpointFunction", None)
    if function_class is not None and not getattr(function_class.forward, "_polyamp", False):
        forward = function_class.forward

        def reentrant_forward(ctx: Any, run_function: Callable[..., Any], *args: Any) -> Any:
            return forward(ctx, _in_region(run_function), *args)

        reentrant_forward._polyamp = True  # type: ignore[attr-defined]
        function_class.forward = staticmethod(functools.wraps(forward)(reentrant_forward))
    wrapped: dict[int, Callable[..., Any]] = {}
    for name in dir(checkpoint):
        generator = getattr(checkpoint, name)
        if name.startswith(_GENERATOR_PREFIX) and callable(generator):
            wrapped[id(generator)] = _wrap_generator(generator)
            setattr(checkpoint, name, wrapped[id(generator)])
    for module_name in _GENERATOR_IMPORTERS:
        module = sys.modules.get(module_name)
        for name in dir(module) if module is not None else ():
            if name.startswith(_GENERATOR_PREFIX) and id(getattr(module, name)) in wrapped:
                setattr(module, name, wrapped[id(getattr(module, name))])
