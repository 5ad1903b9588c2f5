"""polyamp's JAX package: polyamp's policies and loss scaling for JAX programs (optax, hand-written steps).

* `autocast` - a function computing by op class under the policy, as torch's autocast and polyamp's Keras
  models do: matrix products and convolutions in the compute dtype, softmax, log-softmax, losses, sums,
  means, variances, norms' statistics, exp and log in float32 (by interpreting its jaxpr while it is traced:
  nothing per step under ``jax.jit``).
* `cast_to_compute`, `cast_to_param`, `cast_to_output` - a pytree's floating leaves in the policy's dtypes
  (the policy in effect, `polyamp.get_policy`, or one given), jmp-style: integer, boolean and non-array
  leaves are left alone.
* `loss_scaled` - polyamp's loss scaling as an optax transformation: the scale, the skip of non-finite (or
  spiking) steps, the guard, step records and the spike window in its state, in-graph; `scale_loss` scales a
  loss with it, `records` / `state_dict` / `load_state_dict` read and restore it.
* ``polyamp.LossScaler(...).functional(backend="jax")`` - the functional scaler over JAX arrays for
  hand-written steps (`JaxFunctional` is its device form).

It imports JAX and optax only. The state dicts are interchangeable with polyamp's torch, TensorFlow and Keras
scalers'.
"""

from __future__ import annotations

import jax
import optax

from polyamp.backend_api import warn_if_untested
from polyamp_jax._autocast import COMPUTE_PRIMITIVES, FLOAT32_PRIMITIVES, PRIMITIVE_OPS, autocast
from polyamp_jax._casting import cast_to_compute, cast_to_output, cast_to_param, cast_tree
from polyamp_jax._functional import JaxFunctional, all_finite
from polyamp_jax._optax import (
    LossScaledState,
    load_state_dict,
    loss_scaled,
    records,
    scale_loss,
    scaler_of,
    state_dict,
)

warn_if_untested("polyamp_jax", {"jax": jax.__version__, "optax": optax.__version__})

__all__ = [
    "COMPUTE_PRIMITIVES",
    "FLOAT32_PRIMITIVES",
    "PRIMITIVE_OPS",
    "JaxFunctional",
    "LossScaledState",
    "all_finite",
    "autocast",
    "cast_to_compute",
    "cast_to_output",
    "cast_to_param",
    "cast_tree",
    "load_state_dict",
    "loss_scaled",
    "records",
    "scale_loss",
    "scaler_of",
    "state_dict",
]
