"""polyamp's Keras 3 package: polyamp policies for Keras on any backend (TensorFlow, JAX, PyTorch).

* Keras's default dtype policy follows ``polyamp.set_policy`` in every thread, and ``polyamp.policy_scope``
  in the thread that entered it, in either import order. polyamp loads this package by itself when it
  needs it; import it yourself only for the names below. With Keras's own
  ``keras.config.set_dtype_policy``, the later of the two settings wins in each thread (the rule is in
  `follow_polyamp_policy`).
* `to_keras_policy` - the Keras dtype policy for a ``polyamp.Policy``; `PolyampDTypePolicy` for the pairs
  Keras has no name for (e.g. bfloat16 variables, float16 compute).
* `apply_policy` - a model computing as torch's autocast classifies ops (softmax, log-softmax and layer,
  group, RMS and unit norms in float32; matmuls and convolutions in the compute dtype), with float32 layers
  (``keep_float32``), per-layer policies (``overrides``) and outputs in the policy's output dtype.
* `PolicyOverridesMap` - per-layer overrides (``polyamp.set_policy(..., overrides=...)``) as a Keras
  ``DTypePolicyMap``; it survives ``model.save`` / ``keras.models.load_model``.

It imports Keras and nothing else: no TensorFlow, JAX or PyTorch beyond what Keras itself loads for its
backend. Importing it registers ``polyamp>DTypePolicy``, ``polyamp>PolicyOverridesMap`` and
``polyamp>OutputCast`` (the output cast of `apply_policy`) for Keras serialization. The TensorFlow parts
(loss-scale optimizer, scaler, output casting) are in ``polyamp_tensorflow``, which re-exports these names.
"""

from __future__ import annotations

from polyamp_keras._follow import follow_polyamp_policy
from polyamp_keras._models import FLOAT32_LAYERS, PolicyOutputCast, apply_policy, op_output_dtype
from polyamp_keras._policies import PolicyOverridesMap, PolyampDTypePolicy, to_keras_policy

__all__ = [
    "FLOAT32_LAYERS",
    "PolicyOutputCast",
    "PolicyOverridesMap",
    "PolyampDTypePolicy",
    "apply_policy",
    "follow_polyamp_policy",
    "op_output_dtype",
    "to_keras_policy",
]
