"""Mechanisms polyamp_torch does not use, kept so the benchmark can measure them against the one it does.

``FunctionModeFloat32Ops`` is polyamp's first implementation of CUDA's float32 op list on CPU: a
``TorchFunctionMode`` entered with the region that sees every torch call made inside it and casts the inputs
of the listed functions to float32. It costs a Python call per torch call in the region (listed or not),
and ``torch.utils.checkpoint`` cannot restore it on recomputation. polyamp_torch now registers kernels for
the listed ops at the ``AutocastCPU`` dispatch key instead (see polyamp_torch/_cpu_float32/).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NAMES = frozenset(
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


def _entry_points() -> frozenset[Any]:
    owners = (torch, torch.Tensor, torch.nn.functional, torch.linalg, torch.special)
    return frozenset(
        getattr(owner, name) for name in _NAMES for owner in owners if getattr(owner, name, None) is not None
    )


_TARGETS = _entry_points()


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(item) for item in value)
    return value


class FunctionModeFloat32Ops(TorchFunctionMode):
    """The previous mechanism: every torch call in the region goes through this Python method."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func in _TARGETS
            and kwargs.get("out") is None
            and kwargs.get("dtype") is None
            and torch.is_autocast_enabled("cpu")
        ):
            args = tuple(_upcast(arg) for arg in args)
            kwargs = {key: _upcast(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)
