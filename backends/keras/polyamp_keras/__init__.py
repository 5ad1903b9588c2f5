"""polyamp's Keras 3 package: polyamp policies and loss scaling for Keras on any backend (TensorFlow, JAX,
PyTorch).

* Keras's default dtype policy follows ``polyamp.set_policy`` in every thread, and ``polyamp.policy_scope``
  in the thread that entered it, in either import order. polyamp loads this package by itself when keras
  is imported, so saved models with polyamp's classes load with ``keras.models.load_model`` once
  ``polyamp`` is imported. With Keras's own ``keras.config.set_dtype_policy``, the later of the two
  settings wins in each thread (the rule is in `follow_polyamp_policy`).
* `LossScaleOptimizer` - Keras 3's loss-scale optimizer with polyamp's rule and safeguards, on every Keras
  backend, stateful (``apply``) and stateless (``stateless_apply``, what ``model.fit`` uses on JAX): an
  adapter over the `polyamp.LossScaler` it runs (``optimizer.scaler``).
* `KerasDevice` - the tape-style device form over ``keras.ops`` and Keras variables that the optimizer's
  scaler runs on (`polyamp_keras.device` holds it and its building blocks, for other backends to build on);
  `KerasFunctional` - its functional form, over the variables' values.
* `LossScaleCallback` - loss scale and skipped steps in the training logs.
* `cast_outputs` - model outputs in the policy's output dtype.
* `to_keras_policy` - the Keras dtype policy for a ``polyamp.Policy``; `PolyampDTypePolicy` for the pairs
  Keras has no name for (e.g. bfloat16 variables, float16 compute).
* `apply_policy` - a model computing as torch's autocast classifies ops (softmax, log-softmax and layer,
  group, RMS and unit norms in float32; matmuls and convolutions in the compute dtype), with float32 layers
  (``keep_float32``), per-layer policies (``overrides``) and outputs in the policy's output dtype.
* `PolicyOverridesMap` - per-layer overrides (``polyamp.set_policy(..., overrides=...)``) as a Keras
  ``DTypePolicyMap``; it survives ``model.save`` / ``keras.models.load_model``.
* `Float8Dense`, `Float8EinsumDense` - what `apply_policy` makes of ``Dense`` and ``EinsumDense`` layers under
  a policy with an FP8 recipe (``"mixed_bfloat16+float8_delayed"``): their matmuls in FP8;
  `float8_state_dict` / `load_float8_state_dict` - delayed scaling's state in the form every polyamp backend
  reads; `record_float8` - what their casts lose (saturated and flushed values), counted on the device.
* `watch_forward` - which layer first produced an inf or NaN in an eager forward pass.
* `PrecisionOptimizer` - the training state a policy plans (a float32 master copy, the optimizer state's
  dtype, stochastic or Kahan-compensated writes into bfloat16 weights) around any Keras optimizer;
  `measure_state_bytes` - the bytes per parameter of an optimizer's training state, counted from its variables.
  Any Keras optimizer built over bfloat16/float16 variables without such a plan warns once
  (`polyamp.TrainingStateWarning`).

It imports Keras and nothing else: no TensorFlow, JAX or PyTorch beyond what Keras itself loads for its
backend. Importing it registers its classes for Keras serialization (``polyamp>LossScaleOptimizer``,
``polyamp>OutputCast``, ``polyamp>DTypePolicy``, ``polyamp>Float8Dense``, ``polyamp>Float8EinsumDense``, ``polyamp>PolicyOverridesMap``, ``polyamp>PrecisionOptimizer``). ``polyamp_tensorflow``
re-exports these names and adds the TensorFlow ``LossScaler``. Importing it also lets models with their own
``compile`` (keras_hub tasks) load a saved compile that holds polyamp's `LossScaleOptimizer`, which Keras
alone skips for them (see ``polyamp_keras._compile``).
"""

from __future__ import annotations

from polyamp_keras._callbacks import LossScaleCallback
from polyamp_keras._compile import restore_polyamp_compiles
from polyamp_keras._device import KerasDevice
from polyamp_keras._float8 import Float8Dense, Float8EinsumDense
from polyamp_keras._float8_records import Float8Recorder, record_float8
from polyamp_keras._float8_state import float8_state_dict, load_float8_state_dict
from polyamp_keras._follow import follow_polyamp_policy
from polyamp_keras._functional import KerasFunctional
from polyamp_keras._models import FLOAT32_LAYERS, LAYER_OPS, apply_policy, op_output_dtype
from polyamp_keras._optimizer import LossScaleOptimizer
from polyamp_keras._outputs import OutputCast, cast_outputs
from polyamp_keras._policies import PolicyOverridesMap, PolyampDTypePolicy, to_keras_policy
from polyamp_keras._precision import PrecisionOptimizer
from polyamp_keras._state import measure_state_bytes, warn_unplanned_updates
from polyamp_keras._watch import ForwardWatch, watch_forward

restore_polyamp_compiles()
warn_unplanned_updates()

__all__ = [
    "FLOAT32_LAYERS",
    "LAYER_OPS",
    "Float8Dense",
    "Float8EinsumDense",
    "Float8Recorder",
    "ForwardWatch",
    "KerasDevice",
    "KerasFunctional",
    "LossScaleCallback",
    "LossScaleOptimizer",
    "OutputCast",
    "PolicyOverridesMap",
    "PolyampDTypePolicy",
    "PrecisionOptimizer",
    "apply_policy",
    "cast_outputs",
    "float8_state_dict",
    "follow_polyamp_policy",
    "load_float8_state_dict",
    "measure_state_bytes",
    "op_output_dtype",
    "record_float8",
    "to_keras_policy",
    "watch_forward",
]
