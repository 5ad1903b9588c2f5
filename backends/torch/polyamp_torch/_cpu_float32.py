"""CUDA's float32 op list on CPU, inside polyamp regions.

``torch.autocast`` classifies ops per device. On CUDA, softmax, log_softmax, layer/group norm, reductions
(sum, prod, cumsum, logsumexp, norms) and precision-sensitive pointwise ops (exp, log, pow, ...) run in
float32; CPU autocast runs most of them in the low dtype. So the same model, under the same policy, would
compute differently on the two devices. polyamp promises one semantics, so inside a polyamp autocast
region on CPU this mode casts the float16/bfloat16 inputs of those ops to float32, as CUDA autocast does.

It is a ``TorchFunctionMode`` entered and exited with the region: nothing changes outside polyamp regions,
for native ``torch.autocast`` users, or on CUDA (where torch already does this). Ops given an explicit
``dtype=`` or ``out=`` are left alone, and nothing is cast while CPU autocast is disabled (a nested
``enabled=False`` region). Its cost is one Python call per torch function in the region
(see benchmarks/).
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

from polyamp_torch._framework import torch

__all__ = ["FLOAT32_OP_NAMES", "CudaFloat32Ops"]

#: CUDA autocast's float32 ops (torch's ``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE`` lists),
#: by the names of their Python entry points.
FLOAT32_OP_NAMES = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus",
        "layer_norm", "group_norm", "norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
        "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits", "cross_entropy", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "vector_norm", "matrix_norm", "sum",
    }
)  # fmt: skip

_LOW = (torch.float16, torch.bfloat16)


def _cpu_autocast_enabled() -> bool:
    try:
        return bool(torch.is_autocast_enabled("cpu"))
    except TypeError:  # torch < 2.4 has no device argument
        return bool(torch.is_autocast_cpu_enabled())


def _entry_points() -> frozenset[Any]:
    owners = (torch, torch.Tensor, torch.nn.functional, torch.linalg, torch.special)
    found = set()
    for name in FLOAT32_OP_NAMES:
        for owner in owners:
            function = getattr(owner, name, None)
            if function is not None:
                found.add(function)
    return frozenset(found)


_TARGETS = _entry_points()


def _upcast(value: Any) -> Any:
    # Arguments are flat or hold tensors in lists/tuples (torch.cat-style); a direct walk costs ~1 us where
    # a general pytree flatten costs tens.
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(item) for item in value)
    return value


class CudaFloat32Ops(TorchFunctionMode):
    """Runs CUDA autocast's float32 ops in float32 while CPU autocast is enabled (see the module doc)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _TARGETS and kwargs.get("out") is None and kwargs.get("dtype") is None and _cpu_autocast_enabled():
            args = tuple(_upcast(arg) for arg in args)
            kwargs = {key: _upcast(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)
