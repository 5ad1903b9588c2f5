"""The Keras device form of polyamp's loss scaling and its building blocks: state in Keras variables, step
operations in ``keras.ops``.

Everything here runs on every Keras backend (TensorFlow, JAX, PyTorch), eagerly and in compiled steps
(``tf.function``, ``jax.jit`` inside Keras's ``StatelessScope``), with no Python branch on a tensor value. It
is the public surface other backends build their Keras-based device forms on (``polyamp_tensorflow``'s
device form is made of it) and what `polyamp_keras.LossScaleOptimizer` runs:

* `KerasDevice` - the tape-style device form (`polyamp.backend_api.TapeDevice` with records, the guard, the
  spike rule and provenance) that `polyamp.LossScaler` drives; `polyamp_keras.LossScaleOptimizer` binds its
  scaler to one over its own variables, and ``polyamp_tensorflow``'s device form extends it;
* `KerasFunctional` - its functional form (`polyamp.backend_api.FunctionalDevice` with records, the guard and
  the spike rule) over the values of a `KerasDevice`'s variables, for stateless steps;
* `ScaleState` - the scale, growth tracker, hysteresis and skip count as variables; `advance` /
  `advance_on_flag` apply `polyamp.LossScaleConfig`'s rule to them (products formed in float64 and rounded
  to float32, as the reference and torch do, so trajectories agree bit for bit across backends);
* `unscale`, `all_finite`, `all_replicas_finite` (the flag reduced across ``tf.distribute`` replicas),
  `gradient_counts` (each gradient's +inf/-inf/NaN counts, for `polyamp.NonFiniteGradient`), `is_sparse`
  (TensorFlow's ``IndexedSlices``), `refuse_loss_scale_factor` (Keras's own loss scaling on an optimizer that
  polyamp scales);
* `SpikeWindow` - `polyamp.SpikeRule`'s window and decision on variables; `loss_statistic` and `grad_norm`,
  the statistics it decides on.
"""

from __future__ import annotations

from polyamp_keras._device import KerasDevice, clipping_folded, folded_clip_norm
from polyamp_keras._functional import KerasFunctional
from polyamp_keras._gradients import (
    all_finite,
    all_replicas_finite,
    gradient_counts,
    is_sparse,
    non_finite_counts,
    refuse_loss_scale_factor,
    sparse_values,
    unscale,
)
from polyamp_keras._rule import ScaleState, advance, advance_on_flag, counter_dtype, device_cond, read_scalar
from polyamp_keras._spikes import SpikeWindow, grad_norm, loss_statistic, statistic_dtype

__all__ = [
    "KerasDevice",
    "KerasFunctional",
    "ScaleState",
    "SpikeWindow",
    "advance",
    "advance_on_flag",
    "all_finite",
    "all_replicas_finite",
    "clipping_folded",
    "counter_dtype",
    "device_cond",
    "folded_clip_norm",
    "grad_norm",
    "gradient_counts",
    "is_sparse",
    "loss_statistic",
    "non_finite_counts",
    "read_scalar",
    "refuse_loss_scale_factor",
    "sparse_values",
    "statistic_dtype",
    "unscale",
]
