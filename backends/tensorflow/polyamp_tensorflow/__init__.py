"""polyamp's TensorFlow / Keras 3 backend.

* Keras's global dtype policy follows ``polyamp.set_policy`` (in either import order), with per-layer
  overrides (`PolicyOverridesMap`).
* `LossScaleOptimizer` - Keras 3's loss-scale optimizer with polyamp's rule and safeguards, for
  ``model.compile``/``fit`` and custom loops (Keras 3 and tf.keras 2 APIs).
* `TensorFlowLossScaler` - ``polyamp.LossScaler`` bound to TensorFlow: ``scale`` / ``unscale`` /
  ``apply_gradients``, usable inside ``tf.function``; what ``polyamp.LossScaler()`` becomes on first use.
* `LossScaleCallback` - loss scale and skipped steps in the training logs.
* `cast_outputs` - model outputs in the policy's output dtype.

Importing this module imports TensorFlow and Keras; without them it raises
``polyamp.BackendNotInstalledError`` saying ``pip install 'polyamp[tensorflow]'``.
"""

# First: without TensorFlow/Keras this raises BackendNotInstalledError saying what to install.
from polyamp_tensorflow._framework import keras  # isort: split

from polyamp_tensorflow._backend import TensorFlowBackend
from polyamp_tensorflow._callbacks import LossScaleCallback
from polyamp_tensorflow._keras_policy import PolicyOverridesMap, PolyampDTypePolicy, to_keras_policy
from polyamp_tensorflow._optimizer import LossScaleOptimizer
from polyamp_tensorflow._outputs import OutputCast, cast_outputs
from polyamp_tensorflow._scaler import TensorFlowLossScaler

__all__ = [
    "LossScaleCallback",
    "LossScaleOptimizer",
    "OutputCast",
    "PolicyOverridesMap",
    "PolyampDTypePolicy",
    "TensorFlowBackend",
    "TensorFlowLossScaler",
    "cast_outputs",
    "keras",
    "to_keras_policy",
]
