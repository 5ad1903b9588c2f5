"""``Dense`` and ``EinsumDense`` layers built under a polyamp policy with an FP8 recipe run FP8.

Keras wraps every layer's ``build`` so that, right after it, the layer's ``_post_build`` runs (the hook its
backends use for their own bookkeeping), with the layer's path known and its variables made. Once a polyamp
policy with an FP8 recipe has been set in the process (`install`, called by the policy hook), polyamp wraps
``_post_build`` of ``keras.layers.Dense`` and ``keras.layers.EinsumDense``, once: after Keras's own step, a
layer of exactly those classes that took its dtype policy from polyamp (built without ``dtype=``) while a
policy with a recipe is in effect is converted as `polyamp_keras.apply_policy` converts it (the same plan and
refusals). Every other layer, and every layer in a process that never sets an FP8 policy, is untouched.

The recipe's ``modules`` / ``skip`` patterns match the layer's Keras path without its outermost component
(the model's name): ``"dense"`` in a flat Sequential model, a functional model's layers by their names (they
are built before the model exists). Should a future Keras no longer call ``_post_build`` after ``build``,
this says so once (a ``RuntimeWarning``) and layers are converted only by ``apply_policy``.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import polyamp
from polyamp import Policy
from polyamp.backend_api.policies import PolicyOverrides
from polyamp_keras import _float8
from polyamp_keras._keras import keras

__all__ = ["install"]

_MARK = "__polyamp_float8_build__"
_lock = threading.Lock()
_warned = False


def install(policy: Policy, overrides: PolicyOverrides) -> None:
    """Convert the ``Dense`` / ``EinsumDense`` layers built from now on under an FP8 policy (idempotent;
    nothing happens until ``policy`` or one of ``overrides`` has an FP8 recipe)."""
    global _warned
    if policy.float8 is None and not any(p.float8 is not None for _, p in overrides.items()):
        return
    with _lock:
        for cls in (keras.layers.Dense, keras.layers.EinsumDense):
            if vars(cls).get(_MARK):
                continue
            original = getattr(cls, "_post_build", None)
            if not callable(original):
                if not _warned:
                    _warned = True
                    warnings.warn(
                        f"Keras {keras.__version__} has no Layer._post_build, so Dense and EinsumDense layers built "
                        "under an FP8 policy are not converted when built; convert the model with "
                        "polyamp_keras.apply_policy(model).",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                return
            cls._post_build = _converting(original)
            setattr(cls, _MARK, True)


def _converting(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _post_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _convert_if_under_float8(self)
        return result

    return _post_build


def _convert_if_under_float8(layer: Any) -> None:
    if type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense):
        return  # polyamp's FP8 layers (loaded or converted) and user subclasses keep their class
    from polyamp_keras._follow import keras_policy_for  # imports this module

    setting = polyamp.get_policy_setting()
    if setting.source == "default" or layer.dtype_policy is not keras_policy_for(setting):
        return  # not built under polyamp's policy (an explicit dtype=, Keras's own setting, a loaded config)
    path = str(layer.path or layer.name)
    policy = setting.overrides.match(path) or setting.policy
    if policy.float8 is None:
        return
    name = path.split("/", 1)[1] if "/" in path else path
    _float8.convert_layers(_float8.plan_layers([(name, layer, policy.float8)]))
