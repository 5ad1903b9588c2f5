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
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from polyamp import OpClass, op_class
from polyamp.backend_api.policies import FLOAT32_OPS
from polyamp_torch._cpu_float32._checkpoint import _GENERATOR_PREFIX as _GENERATOR_PREFIX
from polyamp_torch._cpu_float32._checkpoint import _in_region as _in_region
from polyamp_torch._cpu_float32._checkpoint import _patch_checkpoint
from polyamp_torch._cpu_float32._kernels import (
    _append_dtype_kernel,
    _eligible,
    _fp32_kernel,
    _run_without_autocast,
    _set_opt_dtype_kernel,
    _to_float32,
)
from polyamp_torch._cpu_float32._region import _STATE, _TRACED, REGION_STATE, _applies, _tracing_context
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
