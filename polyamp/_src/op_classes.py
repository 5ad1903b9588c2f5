"""Op classes: which operations of a mixed-precision region run in the compute dtype, which in float32.

One table for every backend, by framework-neutral op names. It is CUDA autocast's (torch's
``autocast_mode.h`` lists, the behaviour users of mixed precision know), because on CUDA torch's own C++
lists decide and no library can change them; every other place polyamp classifies ops follows the same
table:

* torch on CPU registers CUDA's float32 kernels at ``AutocastCPU`` for the `FLOAT32` ops;
* Keras models run the layers standing for `FLOAT32` ops (``Softmax``, the normalization layers) in float32;
* ``polyamp_jax.autocast`` maps each JAX primitive to an op name here and takes its class.

Operations the table does not name take the widest floating dtype among their operands (class `PROMOTE`,
as autocast's "promote" list and as ops outside every list do): a float32 value stays float32 until the
next `COMPUTE` op.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping
from types import MappingProxyType

from polyamp._src.errors import PolyampTypeError, PolyampValueError, describe

__all__ = ["COMPUTE_OPS", "FLOAT32_OPS", "OP_CLASSES", "OpClass", "op_class"]


class OpClass(str, enum.Enum):  # noqa: UP042 - str() stays 'OpClass.COMPUTE', as before StrEnum
    """How a region computes an operation under a float16 or bfloat16 policy."""

    #: In the policy's compute dtype: matrix products, convolutions, attention (autocast's lower-precision list).
    COMPUTE = "compute"
    #: In float32 whatever the compute dtype: exponentials and logarithms, reductions that accumulate, softmax,
    #: norms and their statistics, losses (autocast's float32 lists).
    FLOAT32 = "float32"
    #: In the widest floating dtype among the operands (autocast's promote list, and every op not named).
    PROMOTE = "promote"


#: Ops that run in the compute dtype (CUDA autocast's lower-precision list, by neutral name).
COMPUTE_OPS = frozenset(
    {
        "matmul", "dense", "conv", "conv_transpose", "bmm", "baddbmm", "addmm", "addmv", "addr", "addbmm",
        "mm", "mv", "chain_matmul", "multi_dot", "attention", "rnn_cell", "prelu", "matrix_power",
    }
)  # fmt: skip

#: Ops that run in float32 (CUDA autocast's float32 lists, by the names of their Python entry points).
FLOAT32_OPS = frozenset(
    {
        # elementwise
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "sinh", "tan", "pow", "float_power", "softplus",
        # normalizations and norms
        "layer_norm", "group_norm", "rms_norm", "norm", "vector_norm", "matrix_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "renorm", "dist", "pdist", "cdist",
        # reductions that accumulate, softmax
        "sum", "prod", "cumsum", "cumprod", "logsumexp", "softmax", "log_softmax",
        # losses
        "cross_entropy", "nll_loss", "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
        "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        # resampling and matrix functions
        "interpolate", "upsample", "matrix_sqrth",
    }
)  # fmt: skip

#: Every op the table names, with its class (an op it does not name is `OpClass.PROMOTE`).
OP_CLASSES: Mapping[str, OpClass] = MappingProxyType(
    {
        **dict.fromkeys(sorted(COMPUTE_OPS), OpClass.COMPUTE),
        **dict.fromkeys(sorted(FLOAT32_OPS), OpClass.FLOAT32),
    }
)


def op_class(name: str, *, strict: bool = False) -> OpClass:
    """The class of op ``name`` (a neutral name such as ``"softmax"``, ``"matmul"``, ``"layer_norm"``).

    An op the table does not name is `OpClass.PROMOTE`; with ``strict=True`` it is an error instead (for
    backends mapping their own op names here, where a typo must not pass as "promote").
    """
    if not isinstance(name, str):
        raise PolyampTypeError(f"op_class() takes an op name (str). Received: {describe(name)}.")
    found = OP_CLASSES.get(name)
    if found is not None:
        return found
    if strict:
        close = difflib.get_close_matches(name, OP_CLASSES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PolyampValueError(
            f"{name!r} is not an op polyamp's op-class table names.{hint} The table names "
            f"{len(OP_CLASSES)} ops; an op it does not name computes in the widest dtype of its operands (pass "
            "strict=False to get OpClass.PROMOTE for it)."
        )
    return OpClass.PROMOTE
