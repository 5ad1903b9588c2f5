"""polyamp policies as Keras 3 dtype policies, and overrides as a Keras dtype-policy map.

Both classes are registered for Keras serialization as ``polyamp>DTypePolicy`` and
``polyamp>PolicyOverridesMap``; those names are in saved models and must not change.
"""

from __future__ import annotations

import re
from typing import Any

from keras.dtype_policies import DTypePolicy, DTypePolicyMap

from polyamp import Policy, PolyampValueError
from polyamp.backend_api.policies import PolicyOverrides
from polyamp_keras._keras import keras

__all__ = ["PolicyOverridesMap", "PolyampDTypePolicy", "to_keras_policy"]

_KERAS_NAMES = frozenset({"float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16"})


@keras.saving.register_keras_serializable(package="polyamp", name="DTypePolicy")
class PolyampDTypePolicy(DTypePolicy):  # type: ignore[misc]
    """A Keras dtype policy for a variable/compute pair Keras has no name for (e.g. bfloat16 variables,
    float16 compute). Its name is the polyamp spec."""

    def __init__(self, name: str | None = None) -> None:
        self._polyamp_policy = Policy(name or "float32")
        super().__init__(name=self._polyamp_policy.name)

    def _parse_name(self, name: str) -> tuple[str, str]:
        policy = Policy(name)
        return policy.compute_dtype, policy.param_dtype


def to_keras_policy(policy: Policy) -> DTypePolicy:
    """The Keras dtype policy with the same variable and compute dtypes (Keras has no output dtype)."""
    param, compute = policy.param_dtype, policy.compute_dtype
    if policy.name in _KERAS_NAMES:
        return DTypePolicy(policy.name)
    if param == "float32" and compute != "float32":
        return DTypePolicy(f"mixed_{compute}")
    if param == compute:
        return DTypePolicy(param)
    return PolyampDTypePolicy(f"params={param},compute={compute}")


@keras.saving.register_keras_serializable(package="polyamp", name="PolicyOverridesMap")
class PolicyOverridesMap(DTypePolicyMap):  # type: ignore[misc]
    """Keras's ``DTypePolicyMap`` resolved with polyamp's rule (see `polyamp.backend_api.policies.PolicyOverrides`).

    Keras looks a layer's policy up by its path ("model/block/dense"). Entries set on the map directly come
    first, with Keras's own semantics (an exact key, else the one key matching as a regular expression, such
    as ``"model/decoder/.*"``; a path matching several raises ``ValueError``), then polyamp's override for the
    path or its nearest ancestor, then the default policy.

    Keras gives a layer a path when its ``build`` runs. Layers without weights that keep the default
    ``build`` (``Activation``, ``Softmax``, ``Dropout``, ...) never get one, so they always take the default
    policy; give those an explicit ``dtype=`` (this is a limit of Keras's path-based maps, its own
    ``DTypePolicyMap`` included).
    """

    def __init__(
        self,
        default_policy: Any = None,
        policy_map: dict[str, Any] | None = None,
        overrides: dict[str, str] | None = None,
    ) -> None:
        super().__init__(default_policy=default_policy, policy_map=policy_map)
        self._overrides = PolicyOverrides(overrides or {})

    @property
    def overrides(self) -> PolicyOverrides:
        return self._overrides

    def __getitem__(self, key: str) -> DTypePolicy:
        # Keras's own semantics for the entries set on the map: an exact key, else the one key that matches
        # as a regular expression (more than one is an error); only then polyamp's overrides, then the default.
        if key in self._policy_map:
            return self._policy_map[key]
        matching = [pattern for pattern in self._policy_map if re.fullmatch(pattern, key)]
        if len(matching) > 1:
            raise PolyampValueError(
                f"Path '{key}' matches multiple dtype policy specification keys: {matching}. Please make sure "
                "each path only matches at most one dtype policy specification key in the DTypePolicyMap."
            )
        if matching:
            return self._policy_map[matching[0]]
        policy = self._overrides.resolve(key, separators="/")
        return self.default_policy if policy is None else to_keras_policy(policy)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["overrides"] = {key: policy.name for key, policy in self._overrides.items()}
        return config


def to_keras_default(policy: Policy, overrides: PolicyOverrides) -> DTypePolicy:
    """Keras's default dtype policy for a polyamp setting: the policy, or a map when there are overrides."""
    default = to_keras_policy(policy)
    if not len(overrides):
        return default
    return PolicyOverridesMap(default, overrides={key: value.name for key, value in overrides.items()})
