"""CUDA's float32 op list on CPU, inside polyamp regions.

``torch.autocast`` classifies ops per device. On CUDA, softmax, log_softmax, layer/group/RMS norm, reductions
(sum, prod, cumsum, logsumexp, norms), upsampling and precision-sensitive pointwise ops (exp, log, pow, ...)
run in float32; CPU autocast runs most of them in the low dtype. So the same model, under the same policy,
would compute differently on the two devices. polyamp promises one semantics, so inside a polyamp autocast
region on CPU those ops follow CUDA autocast's rules.

How: for each op of CUDA's float32 lists that CPU autocast passes through, a kernel is registered for the
``AutocastCPU`` dispatch key, the key torch's own CPU autocast kernels live at. It is reached only while CPU
autocast is enabled and only by those ops, so every other op pays nothing. While a polyamp region is active
on the current thread it applies CUDA's policy for that op (torch's ``fp32``, ``fp32_set_opt_dtype`` and
``fp32_append_dtype`` wrappers in ``aten/src/ATen/autocast_mode.h``: cast floating CPU inputs other than
float64 to float32 / pass ``dtype=float32`` unless a dtype was given / call the dtype-taking overload) and
runs the op with autocast excluded, as CUDA's wrapper does; otherwise it hands the call to the next dispatch
key, which is exactly what torch's fallthrough does. So native ``torch.autocast("cpu")`` regions keep
torch's CPU behaviour. Ops torch's CPU list already runs in float32 (the losses, ``cdist``, ``prod``) keep
torch's kernel: their dtypes are CUDA's already. ``out=`` overloads have no autocast kernel on either device,
so they are left alone, as on CUDA.

The kernels are registered the first time a polyamp CPU region with these ops is entered, so importing
polyamp_torch changes nothing for programs that never use one. From then on, a listed op called in a CPU
autocast region that is not a polyamp float32 region (native ``torch.autocast``, ``cpu_float32_ops=False``)
computes exactly as before at the cost of a Python call and a boxed redispatch (an exact fallthrough must let
the op's own nested calls see autocast, which only the boxed ``redispatch`` offers from Python). Inside
polyamp regions a listed op costs the float32 work CUDA autocast does (the casts) plus the Python kernel's
boundary; the performance page gives the measured cost.

Under ``torch.compile`` a polyamp CPU region is ``torch.autocast`` plus two ops of polyamp's own
(`compiled_region`): dynamo records them in the graph, and while the graph is traced (dynamo's fake
propagation, AOTAutograd) they switch the kernels on for the ops between them, so the float32 casts are
traced into the graph; with the ``eager`` backend they run and switch them on at run time. The tracing
state is kept per tracing context, so a trace that is abandoned half-way (a graph break inside the
region restarts dynamo's analysis) cannot leave it switched on.

``torch.utils.checkpoint`` re-runs the checkpointed function restoring torch's autocast state, not
polyamp's region flag. So that recomputation computes what the forward computed, the checkpoint entry
points are wrapped (`_patch_checkpoint`): a function checkpointed under CPU autocast is recomputed with the
setting of its forward (inside a polyamp region or not), wherever ``backward()`` runs. Where CPU autocast
is off the wrapper passes the function through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from polyamp import OpClass, op_class
from polyamp.backend_api.policies import FLOAT32_OPS
from polyamp_torch._framework import run_uncompiled, torch

__all__ = [
    "FLOAT32_OP_NAMES",
    "REGION_STATE",
    "compiled_region",
    "cpu_float32_ops_active",
    "enter_region",
    "exit_region",
    "registered_ops",
]

FLOAT32_OP_NAMES = FLOAT32_OPS | {"__pow__", "__rpow__", "upsample_nearest", "upsample_bilinear"}
"""The ops polyamp runs in float32 (the op-class table's `polyamp.OpClass.FLOAT32` ops, which are CUDA autocast's
float32 lists), with the other names torch's Python API reaches them by."""

# CUDA autocast's float32 policies, by aten overload (torch's autocast_mode.h, and ops autocast_mode.cpp
# registers one by one: linalg_matrix_sqrth, torch >= 2.14). Overloads a torch version lacks, or that its
# CUDA autocast does not register, are skipped at registration.
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "linalg_matrix_sqrth",
)  # fmt: skip
_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)  # fmt: skip
# fp32_append_dtype: the overload without a dtype redispatches to the one with it.
_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

_FLOAT32 = torch.float32
_FLOAT64 = torch.float64
_Key = torch._C.DispatchKey
# Everything below AutocastCPU: what a fallthrough at AutocastCPU dispatches to.
_BELOW_AUTOCAST_CPU = torch._C._dispatch_keyset_full_after(_Key.AutocastCPU)


class _RegionState(threading.local):
    # A class attribute, so every thread starts outside polyamp regions without initialising anything.
    active: bool = False

    def __init__(self) -> None:
        self.compiled: list[bool] = []  # settings to restore, pushed by the compiled-region op at run time


_STATE = _RegionState()
#: This thread's setting (``.active``), read where a region that would set it off finds it off already: that
#: entry changes nothing, so it makes no call and leaves nothing to restore.
REGION_STATE = _STATE

# While torch.compile traces, the setting is kept per tracing context (dynamo makes a new one for each
# attempt at a frame, and AOTAutograd traces in dynamo's): a stack of region settings per context.
_TRACED: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()
_tracing_context: Callable[[], Any] = getattr(
    getattr(getattr(torch, "_guards", None), "TracingContext", None), "try_get", lambda: None
)


_fake_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _applies() -> bool:
    """Whether CUDA's rules apply to the op being dispatched: a polyamp CPU region is active here."""
    # torch.compile traces with fake tensors; the fake-mode lookup is what keeps the eager path cheap.
    if _fake_mode(_FAKE) is not None:
        context = _tracing_context()
        if context is not None:
            # Tracing for torch.compile: regions inside the traced code count, not eager ones around it (the
            # compiled graph is reused wherever its guards pass, and they do not see polyamp's region flag).
            stack = _TRACED.get(context)
            if stack:
                return stack[-1]
            if _STATE.active:
                _warn_region_around_compiled_code()
            return False
    return _STATE.active


#: Whether `_warn_region_around_compiled_code` has warned in this process.
_warned_around = [False]


def _warn_region_around_compiled_code() -> None:
    """Once per process: a listed op traced for torch.compile inside an eager polyamp CPU region around the
    compiled code, which compiles it with torch's CPU list, not CUDA's float32 one."""
    if _warned_around[0]:
        return
    _warned_around[0] = True
    warnings.warn(
        "torch.compile is compiling code called inside a polyamp CPU autocast region entered outside it (a "
        "`with polyamp_torch.autocast():` around the compiled call, a function decorated with one, or a region "
        "object made outside the compiled function and entered in it, which dynamo cannot trace). The "
        "compiled graph follows torch's CPU autocast lists: ops CUDA autocast runs in float32 (softmax, "
        "layer_norm, sum, exp, ...) compute in the low dtype there, unlike in the eager region. Enter the "
        "region inside the compiled function (`with polyamp_torch.autocast():` in its body) for CUDA's float32 "
        "list in the graph too; on CUDA devices both are the same.",
        UserWarning,
        stacklevel=2,
    )


def cpu_float32_ops_active() -> bool:
    """Whether CPU autocast on this thread follows CUDA's float32 op list (inside a polyamp CPU region)."""
    return _applies()


def enter_region(active: bool) -> bool:
    """Sets whether this thread's CPU autocast follows CUDA's float32 list; returns the previous setting.

    Called on entry of a polyamp CPU region (``active`` is whether that region runs the float32 list);
    `exit_region` with the returned value restores the enclosing setting.
    """
    if active and not _installed:
        # Outside the compiler: a first region entered in code torch.compile runs untraced would otherwise have
        # the compiler take each kernel's making as a frame of its own (once per op, to its recompile limit).
        run_uncompiled(_install)
    if active and not _kernels_skipped_by_dynamo[0] and "torch._dynamo" in sys.modules:
        run_uncompiled(_skip_kernels_in_dynamo)
    previous = _STATE.active
    _STATE.active = active
    return previous


def exit_region(previous: bool) -> None:
    """Restores the setting `enter_region` returned."""
    _STATE.active = previous


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


# -- registration ----------------------------------------------------------------------------------------

_installed = False
_install_lock = threading.Lock()
_library: Any = None  # the torch.library.Library holding the kernels; registrations live as long as it does
_registered: tuple[str, ...] = ()


def _overload(qualified: str) -> torch._ops.OpOverload | None:
    name, _, overload = qualified.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


#: aten op names whose name in the op-class table differs (beyond a leading underscore and the overload).
_TABLE_NAMES = {
    "native_layer_norm": "layer_norm",
    "nll_loss2d": "nll_loss",
    "linalg_vector_norm": "vector_norm",
    "linalg_matrix_norm": "matrix_norm",
    "linalg_matrix_sqrth": "matrix_sqrth",
}


def table_name(overload: str) -> str:
    """The op-class table's name (`polyamp.backend_api.policies.OP_CLASSES`) for an aten overload such as
    ``"softmax.int"``."""
    base = overload.partition(".")[0].lstrip("_")
    if base.startswith("upsample_"):
        return "upsample"
    return _TABLE_NAMES.get(base, base)


def _planned() -> Iterator[tuple[str, Callable[..., Any]]]:
    """(overload, kernel) for each op the op-class table runs in float32 that this torch's CUDA autocast
    registers and its CPU autocast does not run in float32 already. The lists above give each overload's cast
    policy (torch's mechanics); the table decides which ops are float32."""
    policies: list[tuple[str, str | None]] = [(name, None) for name in (*_FP32, *_FP32_SET_OPT_DTYPE)]
    policies += list(_FP32_APPEND_DTYPE.items())
    set_opt_dtype = set(_FP32_SET_OPT_DTYPE)
    for name, target_name in policies:
        if op_class(table_name(name)) is not OpClass.FLOAT32:
            continue
        qualified = "aten::" + name
        op = _overload(name)
        if op is None or not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCUDA"):
            continue  # not an op of this torch, or not on this torch's CUDA list
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU"):
            continue  # torch's CPU list already runs it in float32: keep torch's kernel
        if target_name is not None:
            target = _overload(target_name)
            if target is None:
                continue
            yield name, _append_dtype_kernel(op, target)
        elif name in set_opt_dtype:
            yield name, _set_opt_dtype_kernel(op)
        else:
            yield name, _fp32_kernel(op)


#: Whether dynamo was told to leave the kernels' frames alone (`_skip_kernels_in_dynamo`).
_kernels_skipped_by_dynamo = [False]
#: The code objects of the kernels and of what they call, once installed.
_kernel_codes: set[Any] = set()


def _skip_kernels_in_dynamo() -> None:
    """Tells dynamo never to compile the kernels' frames. The dispatcher calls them, eagerly, also while a
    compiled function runs the part after a graph break, and dynamo would otherwise try to compile them as
    frames of their own: a graph break per kernel, and on some torch releases an error (their dynamo cannot
    trace the dispatch-key calls in them). Done once dynamo is imported (checked on region entry), so a
    program that never compiles never imports it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is None:
        return
    with _install_lock:
        for code in _kernel_codes:
            skip_code(code)
        _kernels_skipped_by_dynamo[0] = True


def _install() -> None:
    global _installed, _library, _registered
    with _install_lock:
        if _installed:
            return
        library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        names = []
        for name, kernel in _planned():
            library.impl(name, kernel, "AutocastCPU", with_keyset=True)  # type: ignore[no-untyped-call]
            names.append(name)
            _kernel_codes.add(kernel.__code__)
        _kernel_codes.update(f.__code__ for f in (_applies, _run_without_autocast, _to_float32, _eligible))
        _patch_checkpoint()
        _library, _registered, _installed = library, tuple(names), True


def _uninstall() -> None:
    """Removes the kernels again (the next polyamp CPU region installs them anew).

    For measurements: a native CPU autocast region in a process that never entered a polyamp region
    has no polyamp kernel to pass through, and a benchmark interleaving both must reproduce that.
    """
    global _installed, _library, _registered
    with _install_lock:
        if _library is not None:
            _library._destroy()
        _library, _registered, _installed = None, (), False


def registered_ops() -> tuple[str, ...]:
    """The aten overloads given a float32 kernel at ``AutocastCPU`` (installing them if not done yet)."""
    _install()
    return _registered


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


# -- compiled regions ------------------------------------------------------------------------------------


def _define_compile_ops() -> bool:
    """Defines ``polyamp::cpu_float32_ops_enter(bool)`` / ``polyamp::cpu_float32_ops_exit()``; False if torch
    is too old for ``torch.library.custom_op`` (torch < 2.4: compiled CPU regions then use torch's lists)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:  # pragma: no cover - torch < 2.4
        return False

    @custom_op("polyamp::cpu_float32_ops_enter", mutates_args=())  # type: ignore[untyped-decorator]
    def enter(active: bool) -> None:
        # Run time (the eager backend runs the graph op by op): the thread's setting, as eager regions do.
        _STATE.compiled.append(enter_region(active))

    @enter.register_fake  # type: ignore[untyped-decorator]
    def _(active: bool) -> None:
        # Trace time: this context's stack.
        if active and not _installed:
            _install()
        if active and not _kernels_skipped_by_dynamo[0]:
            _skip_kernels_in_dynamo()
        context = _tracing_context()
        if context is not None:
            _TRACED.setdefault(context, []).append(active)

    @custom_op("polyamp::cpu_float32_ops_exit", mutates_args=())  # type: ignore[untyped-decorator]
    def exit_() -> None:
        exit_region(_STATE.compiled.pop() if _STATE.compiled else False)

    @exit_.register_fake  # type: ignore[untyped-decorator]
    def _() -> None:
        context = _tracing_context()
        stack = None if context is None else _TRACED.get(context)
        if stack:
            stack.pop()

    return True


_COMPILE_OPS = _define_compile_ops()


@contextlib.contextmanager
def compiled_region(region: Any, active: bool) -> Iterator[None]:
    """``region`` (a ``torch.autocast``) with CUDA's float32 list on or off inside, in code torch.compile traces.

    A generator context manager of torch ops only, which dynamo traces without a graph break.
    """
    with region:
        if not _COMPILE_OPS:  # pragma: no cover - torch < 2.4
            yield
            return
        torch.ops.polyamp.cpu_float32_ops_enter(active)
        try:
            yield
        finally:
            torch.ops.polyamp.cpu_float32_ops_exit()
