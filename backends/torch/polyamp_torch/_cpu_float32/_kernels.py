"""The ``AutocastCPU`` kernels of the float32 list: CUDA autocast's ``fp32``, ``fp32_set_opt_dtype`` and
``fp32_append_dtype`` policies, applied inside polyamp CPU regions and a fallthrough outside them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyamp_torch._cpu_float32._region import (
    _BELOW_AUTOCAST_CPU,
    _FAKE,
    _FLOAT32,
    _FLOAT64,
    _STATE,
    _applies,
    _fake_mode,
    _Key,
)
from polyamp_torch._framework import torch

# -- kernels ---------------------------------------------------------------------------------------------
#
# The kernels are on the hot path of every listed op in a region, so they keep Python work down: the op is
# called through its generated Python binding (not the OpOverload call, which parses its arguments again)
# and autocast is excluded by two TLS calls rather than a guard object.

_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_AUTOCAST_CPU = _Key.AutocastCPU
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_torch_function_mode = torch._C._is_torch_function_mode_enabled


def _eligible(value: Any) -> bool:
    # at::autocast::is_eligible for CPU: a defined floating CPU (or mkldnn) tensor other than float64.
    return (
        isinstance(value, _Tensor)
        and value.is_floating_point()
        and value.dtype is not _FLOAT64
        and (value.is_cpu or value.is_mkldnn)
    )


def _to_float32(value: Any) -> Any:
    # at::autocast::cached_cast(kFloat, ...): eligible tensors, also inside tensor lists, become float32.
    if isinstance(value, _Tensor):
        return value.float() if value.dtype is not _FLOAT32 and _eligible(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(item) for item in value)
    return value


def _binding(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The generated Python binding that reaches ``op`` for ``op``'s own arguments, if there is one."""
    name = op._schema.name.partition("::")[2]
    for namespace in ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft"):
        binding = getattr(getattr(torch._C, namespace, None), name, None)
        if binding is not None:
            return binding  # type: ignore[no-any-return]
    return None


def _caller(op: torch._ops.OpOverload) -> Callable[[bool], Callable[..., Any]]:
    """``call(plain)``: the fastest exact way to call ``op``: its binding for plain tensors when no torch
    function mode is active (nothing could see the call twice), else the OpOverload itself."""
    exact = op._op
    binding = _binding(op)
    if binding is None:
        return lambda plain: exact

    def call(plain: bool) -> Callable[..., Any]:
        return binding if plain and not _torch_function_mode() else exact

    return call


def _run_without_autocast(call: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
    # CUDA's wrappers run the op under ExcludeDispatchKeyGuard(autocast): nested ops see no autocast.
    previous = _is_excluded(_AUTOCAST_CPU)
    _set_excluded(_AUTOCAST_CPU, True)
    try:
        return call(*args, **kwargs)
    finally:
        _set_excluded(_AUTOCAST_CPU, previous)


def _tensor_positions(op: torch._ops.OpOverload) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions of positional and names of keyword-only arguments that hold tensors, from the schema."""
    positional: list[int] = []
    keyword: list[str] = []
    index = 0
    for argument in op._schema.arguments:
        holds_tensor = "Tensor" in str(argument.type)
        if argument.kwarg_only:
            if holds_tensor:
                keyword.append(argument.name)
        else:
            if holds_tensor:
                positional.append(index)
            index += 1
    return tuple(positional), tuple(keyword)


def _fp32_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """CastPolicy::fp32: every eligible tensor argument is cast to float32."""
    redispatch = op._handle.redispatch_boxed
    exact = op._op
    binding = _binding(op) or exact
    positions, keywords = _tensor_positions(op)
    state = _STATE

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        # _applies() and _run_without_autocast(), inlined: the most common listed ops (layer_norm, exp,
        # pow) take this path, once per op call.
        if _fake_mode(_FAKE) is not None or not state.active:
            if not _applies():
                return redispatch(keyset & _BELOW_AUTOCAST_CPU, *args, **kwargs)
        cast = list(args)
        plain = True
        count = len(cast)
        for index in positions:
            if index < count:
                value = cast[index]
                if type(value) in _PLAIN:
                    dtype = value.dtype  # _eligible, inlined
                    if (
                        dtype is not _FLOAT32
                        and dtype.is_floating_point
                        and dtype is not _FLOAT64
                        and (value.is_cpu or value.is_mkldnn)
                    ):
                        cast[index] = value.float()
                elif value is not None:
                    plain = plain and isinstance(value, (list, tuple))
                    cast[index] = _to_float32(value)
        for name in keywords:
            if name in kwargs:
                plain = False
                kwargs[name] = _to_float32(kwargs[name])
        call = binding if plain and not _torch_function_mode() else exact
        previous = _is_excluded(_AUTOCAST_CPU)
        _set_excluded(_AUTOCAST_CPU, True)
        try:
            return call(*cast, **kwargs)
        finally:
            _set_excluded(_AUTOCAST_CPU, previous)

    return kernel


def _set_opt_dtype_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """CastPolicy::fp32_set_opt_dtype: ``dtype=float32`` unless a dtype was given or the input is ineligible."""
    redispatch = op._handle.redispatch_boxed
    caller = _caller(op)
    dtype_index = None  # where a positional ``dtype`` sits (softmax, log_softmax); None if keyword-only
    index = 0
    for argument in op._schema.arguments:
        if argument.name == "dtype" and not argument.kwarg_only:
            dtype_index = index
        index += not argument.kwarg_only

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if not _applies():
            return redispatch(keyset & _BELOW_AUTOCAST_CPU, *args, **kwargs)
        first = args[0]
        if _eligible(first):
            if dtype_index is not None and dtype_index < len(args):
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], _FLOAT32, *args[dtype_index + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs["dtype"] = _FLOAT32
        return _run_without_autocast(caller(type(first) in _PLAIN), args, kwargs)

    return kernel


def _append_dtype_kernel(op: torch._ops.OpOverload, target: torch._ops.OpOverload) -> Callable[..., Any]:
    """CastPolicy::fp32_append_dtype: call the dtype-taking overload with float32 (or the input's dtype)."""
    redispatch = op._handle.redispatch_boxed
    call = target._op  # rare ops (Python's norm goes to linalg_vector_norm): no binding lookup needed
    defaults = [argument.default_value for argument in op._schema.arguments]

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if not _applies():
            return redispatch(keyset & _BELOW_AUTOCAST_CPU, *args, **kwargs)
        full = (*args, *defaults[len(args) :])
        dtype = _FLOAT32 if _eligible(args[0]) else args[0].dtype
        return _run_without_autocast(call, full, {"dtype": dtype})

    return kernel
