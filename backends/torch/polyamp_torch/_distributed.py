"""polyamp with torch.distributed: a policy as FSDP2's ``MixedPrecisionPolicy``, and DTensor detection.

* DDP needs nothing: gradients are all-reduced in backward, every rank checks the same values.
* FSDP2 (``torch.distributed.fsdp.fully_shard``): gradients are DTensors; torch's DTensor rule for the fused
  unscale kernel reduces the found-inf flag over the gradients' mesh, so every rank skips together with
  ``process_group=None``. `fsdp_mixed_precision` states the policy once for FSDP2's module-level casting.
* Ranks holding different gradients as plain tensors (optimizer sharding, pipeline stages): construct the
  scaler with ``process_group=`` (see `polyamp_torch._device.TorchDevice`).
"""

from __future__ import annotations

import sys
from typing import Any

from polyamp import BackendNotInstalledError, Policy, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import PolicyLike
from polyamp_torch._autocast import policy_in_effect
from polyamp_torch._framework import TORCH_DTYPES, torch

__all__ = ["fsdp_mixed_precision", "is_dtensor"]


def _torch_dtype(value: Any, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in TORCH_DTYPES.values():
        return value
    if isinstance(value, str) and value in TORCH_DTYPES:
        return TORCH_DTYPES[value]
    raise PolyampTypeError(
        f"fsdp_mixed_precision({what}=...) takes None, {', '.join(map(repr, TORCH_DTYPES))} or the matching "
        f"torch.dtype. Received: {describe(value)}."
    )


def fsdp_mixed_precision(
    policy: PolicyLike | None = None, *, root: bool = True, reduce_dtype: Any = None, cast_forward_inputs: bool = True
) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a polyamp policy, so the policy is stated once.

    FSDP2 keeps the sharded parameters (what the optimizer updates) in the dtype they have, which should
    be the policy's param dtype, and all-gathers them in ``param_dtype`` for forward and backward. So:

    * ``param_dtype`` = the policy's compute dtype (float16 under ``"mixed_float16"``);
    * ``reduce_dtype`` = the policy's param dtype unless given (gradients are reduce-scattered in float32
      under the mixed policies, as DDP reduces float32 gradients; pass ``"float16"`` / ``"bfloat16"`` to
      halve the communication);
    * ``output_dtype`` = the policy's output dtype for the root (``root=True``), None for the blocks
      (``root=False``). FSDP2 casts the output of every module given one, and a float32 block output would meet
      the root's own float16 parameters (a final norm, a head) in a matmul torch refuses.

    Args:
        policy: A policy or its name; None means the policy in effect (`polyamp_torch.policy_in_effect`).
        root: True for the module whose output is the model's (it leaves in the policy's output dtype); False for
            the blocks sharded inside it (their outputs stay in the compute dtype).
        reduce_dtype: None, a dtype name ("float32", "float16", "bfloat16") or the torch.dtype.
        cast_forward_inputs: As FSDP2's (cast floating forward inputs to ``param_dtype``).

    Returns:
        ``torch.distributed.fsdp.MixedPrecisionPolicy``; pass it as ``fully_shard(module, mp_policy=...)``.

    Raises:
        PolyampTypeError: ``reduce_dtype`` is not one of those, or ``root`` / ``cast_forward_inputs`` is not a bool;
            InvalidPolicyError: ``policy`` is not a policy.
        BackendNotInstalledError: this torch build has no ``torch.distributed``.

    Example:
        ```python
        for block in model.blocks:
            fully_shard(block, mp_policy=polyamp_torch.fsdp_mixed_precision("mixed_float16", root=False))
        fully_shard(model, mp_policy=polyamp_torch.fsdp_mixed_precision("mixed_float16"))
        ```
    """
    resolved = policy_in_effect() if policy is None else Policy(policy)
    reduce = TORCH_DTYPES[resolved.param_dtype] if reduce_dtype is None else _torch_dtype(reduce_dtype, "reduce_dtype")
    if not isinstance(root, bool):
        raise PolyampTypeError(
            f"fsdp_mixed_precision(root=...) takes True (the root module) or False (the blocks inside it). Received: "
            f"{describe(root)}."
        )
    if not isinstance(cast_forward_inputs, bool):
        raise PolyampTypeError(
            f"fsdp_mixed_precision(cast_forward_inputs=...) takes True or False. Received: {describe(cast_forward_inputs)}."
        )
    if not torch.distributed.is_available():
        raise BackendNotInstalledError(
            "fsdp_mixed_precision() needs torch.distributed, which this torch build lacks. Install a torch build "
            "with distributed support (the standard Linux, macOS and Windows wheels have it)."
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[resolved.compute_dtype],
        reduce_dtype=reduce,
        output_dtype=TORCH_DTYPES[resolved.output_dtype] if root else None,
        cast_forward_inputs=cast_forward_inputs,
    )


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2- or tensor-parallel-sharded parameter), importing nothing."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)
