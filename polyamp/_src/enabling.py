"""When loss scaling is on: the one rule every scaler follows (`polyamp.LossScaler`, Keras's optimizer)."""

from __future__ import annotations

import warnings

from polyamp._src.errors import type_error
from polyamp._src.global_policy import get_policy_setting
from polyamp._src.policy import Policy

__all__ = ["check_enabled", "resolve_enabled"]


def check_enabled(enabled: object) -> bool | None:
    """Validate an ``enabled`` argument: True, False or None (follow the policy)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise type_error("`enabled`", "None or a bool (None follows the policy)", enabled)
    return enabled


def resolve_enabled(
    enabled: bool | None,
    policy: Policy | None = None,
    *,
    float16_in_use: bool = False,
    scales_under_float32: bool = False,
) -> bool:
    """Whether a scaler with setting ``enabled`` scales now: the one rule of every polyamp scaler.

    An explicit bool wins. ``None`` (the default of `polyamp.LossScaler`, ``polyamp_jax.loss_scaled`` and Keras's
    ``LossScaleOptimizer``) follows the policy in effect (``polyamp.get_policy()`` unless ``policy`` is given) at
    the moment the scaler is used, each iteration anew:

    * float16 compute with float32 parameters (``"mixed_float16"``): on;
    * bfloat16 compute (``"mixed_bfloat16"`` and the like): off, whatever else is seen (bfloat16 has float32's
      range and needs no scaling; the guard checks the gradients instead);
    * float16 *parameters* (``"float16"``): off, with a warning: unscaled float16 gradients underflow and
      overflow, so loss scaling needs float32 master parameters;
    * a float32 policy (polyamp's default, which names no mixed precision): on when the backend reports float16
      computation outside polyamp's global policy (``float16_in_use``: e.g. ``polyamp_torch.autocast`` given an
      explicit float16 policy, or Keras's own global policy), or when the scaler stands for a framework's class
      that always scales (``scales_under_float32``: Keras's ``LossScaleOptimizer``, as Keras's own).

    >>> from polyamp import Policy
    >>> resolve_enabled(None, Policy("mixed_float16")), resolve_enabled(None, Policy("mixed_bfloat16"))
    (True, False)
    >>> resolve_enabled(None, Policy("float32")), resolve_enabled(None, Policy("float32"), scales_under_float32=True)
    (False, True)
    >>> resolve_enabled(None, Policy("mixed_bfloat16"), scales_under_float32=True)
    False
    >>> resolve_enabled(False, Policy("mixed_float16"))
    False
    """
    if enabled is not None:
        return enabled
    policy = get_policy_setting().policy if policy is None else policy  # (`get_policy`, one call less)
    compute = policy.compute_dtype  # (asked at each iteration's start: read once)
    if compute == "bfloat16":
        return False  # a bfloat16 policy is a choice: float16 seen elsewhere does not override it
    if compute == "float16":
        if policy.param_dtype == "float16":
            warnings.warn(
                f"Loss scaling stays off under the policy {policy.name!r}: it keeps float16 parameters, whose "
                "gradients cannot be unscaled without underflow. Use 'mixed_float16' (float32 parameters, "
                "float16 compute) to train with loss scaling, or pass enabled=True if your optimizer keeps "
                "float32 master weights.",
                UserWarning,
                stacklevel=3,
            )
            return False
        return True
    return float16_in_use or scales_under_float32
