"""The policy hook: Keras's global dtype policy follows polyamp's."""

from __future__ import annotations

from polyamp import Policy, PolicyOverrides
from polyamp_keras._keras import keras
from polyamp_keras._policies import to_keras_default

__all__ = ["follow_polyamp_policy"]


def follow_polyamp_policy(policy: Policy, overrides: PolicyOverrides) -> None:
    """Make ``policy`` (with per-layer ``overrides``) Keras's global dtype policy.

    polyamp calls it on every policy change, at once if keras is imported, else right after keras gets
    imported.
    """
    keras.config.set_dtype_policy(to_keras_default(policy, overrides))
