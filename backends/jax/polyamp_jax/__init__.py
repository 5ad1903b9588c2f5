"""polyamp's JAX package: polyamp's policies and loss scaling for JAX programs (optax, hand-written steps).

* `autocast` - a function computing by op class under the policy, as torch's autocast and polyamp's Keras
  models do: matrix products and convolutions in the compute dtype, softmax, log-softmax, losses, sums,
  means, variances, norms' statistics, exp and log in float32 (by interpreting its jaxpr while it is traced:
  nothing per step under ``jax.jit``). It takes models too: an Equinox module (``autocast(model)``), a Flax
  Linen module's ``apply`` (``autocast(model.apply)``: parameters in the compute dtype, batch statistics and
  other collections as stored).
* `cast_to_compute`, `cast_to_param`, `cast_to_output` - a pytree's floating leaves in the policy's dtypes
  (the policy in effect, `polyamp.get_policy`, or one given), jmp-style: integer, boolean and non-array
  leaves are left alone. `module_dtypes` gives Flax layers the policy (``dtype``, ``param_dtype``).
* `loss_scaled` - polyamp's loss scaling as an optax transformation: the scale, the skip of non-finite (or
  spiking) steps, the guard, step records and the spike window in its state, in-graph; `scale_loss` scales a
  loss with it, `records` / `state_dict` / `load_state_dict` read and restore it, `summary` gives the run in one
  line and `log_summary` shows it every N steps (printed, or as a tqdm bar's postfix).
* `precision` - any optax optimizer following the policy's training-state plan (a float32 master copy,
  moments in bfloat16, stochastic or Kahan-compensated writes of bfloat16 weights); `convert_precision_state`
  carries a state saved under one plan into another, `measure_state_bytes` counts what a state costs.
* `DynamicScale` - a drop-in for Flax's ``flax.training.dynamic_scale.DynamicScale`` (a ``TrainState`` field)
  whose scale follows polyamp's rule, with records and state dicts.
* ``polyamp.LossScaler(...).functional(backend="jax")`` - the functional scaler over JAX arrays for
  hand-written steps (`JaxFunctional` is its device form).
* `float8_dot_general` - ``jax.lax.dot_general`` in FP8 by a `polyamp.Float8Recipe` (a Flax layer's
  ``dot_general=``; with ``counts=`` (`float8_counts`) it counts what its casts lost); `Float8DotGeneral` -
  the Flax Linen module for ``dot_general_cls=``, and `Float8Einsum` - for Flax's ``nn.Fp8Einsum``'s place, with
  delayed scaling's state where Flax keeps it (`float8_state_dict` / `load_float8_state_dict` move it to and
  from the form every polyamp backend reads; `float8_records` reads what their casts lost, with
  ``record=True``); `autocast` runs a function's matrix products in FP8 under a policy with an FP8 recipe.
* `jmp_compat` - jmp's public API (``Policy``, ``get_policy``, ``DynamicLossScale``, ``all_finite``,
  ``select_tree``, ...) over polyamp's policy and loss scaler: ``from polyamp_jax import jmp_compat as jmp``.

It imports JAX and optax only (Flax when `Float8DotGeneral` or `Float8Einsum` is first named): Flax and Equinox objects are
recognised when a program passes them, never imported. The state dicts are interchangeable with polyamp's torch, TensorFlow and Keras scalers'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import optax

from polyamp.backend_api.versions import warn_if_untested
from polyamp_jax import jmp_compat
from polyamp_jax._autocast import COMPUTE_PRIMITIVES, FLOAT32_PRIMITIVES, PRIMITIVE_OPS, autocast
from polyamp_jax._casting import cast_to_compute, cast_to_output, cast_to_param, cast_tree, module_dtypes
from polyamp_jax._dynamic_scale import DynamicScale, DynamicScaleResult
from polyamp_jax._float8 import float8_counts, float8_dot_general
from polyamp_jax._float8_records import float8_records
from polyamp_jax._float8_state import float8_state_dict, load_float8_state_dict
from polyamp_jax._functional import JaxFunctional, all_finite
from polyamp_jax._optax import (
    LossScaledState,
    load_state_dict,
    log_summary,
    loss_scaled,
    records,
    scale_loss,
    scaler_of,
    state_dict,
    summary,
)
from polyamp_jax._precision import PrecisionState, precision
from polyamp_jax._training_state import convert_precision_state, measure_state_bytes

warn_if_untested("polyamp_jax", {"jax": jax.__version__, "optax": optax.__version__})

__all__ = [
    "COMPUTE_PRIMITIVES",
    "FLOAT32_PRIMITIVES",
    "PRIMITIVE_OPS",
    "DynamicScale",
    "DynamicScaleResult",
    "Float8DotGeneral",
    "Float8Einsum",
    "JaxFunctional",
    "LossScaledState",
    "PrecisionState",
    "all_finite",
    "autocast",
    "cast_to_compute",
    "cast_to_output",
    "cast_to_param",
    "cast_tree",
    "convert_precision_state",
    "float8_counts",
    "float8_dot_general",
    "float8_records",
    "float8_state_dict",
    "jmp_compat",
    "load_float8_state_dict",
    "load_state_dict",
    "log_summary",
    "loss_scaled",
    "measure_state_bytes",
    "module_dtypes",
    "precision",
    "records",
    "scale_loss",
    "scaler_of",
    "state_dict",
    "summary",
]


def __getattr__(name: str) -> Any:
    """`Float8DotGeneral` and `Float8Einsum`, Flax Linen modules, imported (with Flax) when first named."""
    if name in ("Float8DotGeneral", "Float8Einsum"):
        from polyamp_jax import _float8_linen

        return getattr(_float8_linen, name)
    raise AttributeError(f"module 'polyamp_jax' has no attribute {name!r}")


if TYPE_CHECKING:
    from polyamp_jax._float8_linen import Float8DotGeneral, Float8Einsum
