"""polyamp's TensorFlow / Keras 3 backend.

* Keras's default dtype policy follows ``polyamp.set_policy`` (in either import order, in every thread), with
  per-layer overrides (`PolicyOverridesMap`); that part is the Keras-only package ``polyamp_keras``, whose
  names this package re-exports.
* `LossScaleOptimizer` - Keras 3's loss-scale optimizer with polyamp's rule and safeguards, for
  ``model.compile``/``fit`` and custom loops (Keras 3 and tf.keras 2 APIs); from ``polyamp_keras``.
* `TensorFlowLossScaler` - ``polyamp.LossScaler`` bound to TensorFlow from construction: ``scale`` /
  ``unscale`` / ``apply_gradients``, usable inside ``tf.function``. A ``polyamp.LossScaler()`` that binds to
  TensorFlow on first use keeps its class and has the same methods and semantics.
* `LossScaleCallback` - loss scale and skipped steps in the training logs.
* `cast_outputs` - model outputs in the policy's output dtype; `apply_policy` - a built model's layers under a
  policy, its ``Dense`` and ``EinsumDense`` layers turned into `Float8Dense` / `Float8EinsumDense` under an FP8
  recipe (``"mixed_bfloat16+float8_delayed"``), which train in ``tf.GradientTape`` loops, in ``tf.function`` or
  eagerly; `float8_state_dict` / `load_float8_state_dict` - delayed scaling's state in the form every polyamp
  backend reads; `record_float8` - what the FP8 casts lose, counted on the device.

With TensorFlow installed, importing this package imports TensorFlow and Keras and registers polyamp's
Keras classes for ``keras.models.load_model``. Keras 3 also runs without TensorFlow (on JAX or PyTorch):
then the policy parts (`to_keras_policy`, `PolicyOverridesMap`, and ``polyamp.set_policy`` driving Keras)
still work, and the TensorFlow parts raise ``polyamp.BackendNotInstalledError`` saying
``pip install 'polyamp[tensorflow]'`` when used. Code for Keras on any backend can use ``polyamp_keras``
directly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polyamp import BackendNotInstalledError

_EXPORTS = {
    "TensorFlowBackend": "polyamp_tensorflow._backend",
    "TensorFlowLossScaler": "polyamp_tensorflow._scaler",
    # Keras only: these work on any Keras 3 backend (re-exported from polyamp_keras).
    "Float8Dense": "polyamp_keras",
    "Float8EinsumDense": "polyamp_keras",
    "LossScaleCallback": "polyamp_keras",
    "LossScaleOptimizer": "polyamp_keras",
    "OutputCast": "polyamp_keras",
    "cast_outputs": "polyamp_keras",
    "PolicyOverridesMap": "polyamp_keras",
    "PolyampDTypePolicy": "polyamp_keras",
    "PrecisionOptimizer": "polyamp_keras",
    "apply_policy": "polyamp_keras",
    "float8_state_dict": "polyamp_keras",
    "load_float8_state_dict": "polyamp_keras",
    "measure_state_bytes": "polyamp_keras",
    "record_float8": "polyamp_keras",
    "to_keras_policy": "polyamp_keras",
}
_KERAS_ONLY = "polyamp_keras"

__all__ = [
    "Float8Dense",
    "Float8EinsumDense",
    "LossScaleCallback",
    "LossScaleOptimizer",
    "OutputCast",
    "PolicyOverridesMap",
    "PolyampDTypePolicy",
    "PrecisionOptimizer",
    "TensorFlowBackend",
    "TensorFlowLossScaler",
    "apply_policy",
    "cast_outputs",
    "float8_state_dict",
    "load_float8_state_dict",
    "measure_state_bytes",
    "record_float8",
    "to_keras_policy",
]
assert sorted(__all__) == sorted(_EXPORTS)

_missing: BackendNotInstalledError | None = None
try:
    importlib.import_module("polyamp_tensorflow._framework")
except BackendNotInstalledError as exc:
    _missing = exc

for _name, _module in _EXPORTS.items():
    if _missing is None or _module == _KERAS_ONLY:
        try:
            globals()[_name] = getattr(importlib.import_module(_module), _name)
        except ImportError:  # no Keras either: every name reports the missing install
            break


def __getattr__(name: str) -> Any:
    if name in _EXPORTS and _missing is not None:
        raise BackendNotInstalledError(f"polyamp_tensorflow.{name}: {_missing}") from _missing
    raise AttributeError(f"module 'polyamp_tensorflow' has no attribute {name!r}")


if TYPE_CHECKING:
    from polyamp_keras import (
        Float8Dense,
        Float8EinsumDense,
        LossScaleCallback,
        LossScaleOptimizer,
        OutputCast,
        PolicyOverridesMap,
        PolyampDTypePolicy,
        PrecisionOptimizer,
        apply_policy,
        cast_outputs,
        float8_state_dict,
        load_float8_state_dict,
        measure_state_bytes,
        record_float8,
        to_keras_policy,
    )
    from polyamp_tensorflow._backend import TensorFlowBackend
    from polyamp_tensorflow._scaler import TensorFlowLossScaler
