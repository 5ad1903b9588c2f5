"""The doctor's FP8 advice: whether this machine multiplies in FP8 natively, and which recipe to start with.

One rule (`advise_float8`), by the lowest CUDA compute capability (a policy applies to every device):

* >= 10.0 (Blackwell): native FP8 and MX tensor cores -> ``"mixed_bfloat16+mxfp8"``;
* >= 8.9 (Ada, Hopper): native FP8 tensor cores -> ``"float8_tensorwise"`` (the fastest kernel; ``"float8_rowwise"``
  when the loss drifts from the bfloat16 run);
* below 8.9, or no CUDA device: the FP8 casts run (on the CPU through ``torch._scaled_mm``, on older GPUs
  emulated in float32) with the same values, but no FP8 units multiply them: no recipe, the 16-bit policy
  is faster there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from polyamp._src.policy import Policy

__all__ = ["FLOAT8_FRAMEWORKS", "Float8Advice", "advise_float8", "float8_conversions"]

#: A tensor of delayed scaling's state, as polyamp_torch (``<layer>.float8_input_scale``), Keras's
#: ``quantize("float8")`` (``<layer>/inputs_amax_history``) and Flax's ``fp8_ops`` (``input_amax_history``)
#: name it: the layer, then the operand and what it is.
_FLOAT8_STATE: Final = re.compile(
    r"^(?:(?P<layer>.*?)[/.])?(?:float8_)?"
    r"(?P<role>input|inputs|weight|kernel|grad_output|output_grad|outputs_grad)_(?P<what>scale|amax_history)$"
)

NATIVE: Final = (8, 9)
MX_NATIVE: Final = (10, 0)


@dataclass(frozen=True)
class Float8Advice:
    """How FP8 runs here and the recipe to start with.

    Attributes:
        support: ``"native"`` (FP8 tensor cores), ``"emulated"`` (the casts run, the matmuls without FP8
            units) or ``"none"`` (no framework polyamp runs FP8 with is installed).
        policy: The policy to try (an FP8 policy name), or None where FP8 would not pay.
        reason: Why.
    """

    support: str
    policy: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain values, with stable keys."""
        return {"support": self.support, "policy": self.policy, "reason": self.reason}


#: The frameworks polyamp runs FP8 layers on, with the names the advice gives them.
FLOAT8_FRAMEWORKS: Final = {"torch": "PyTorch", "keras": "Keras", "jax": "JAX"}


def advise_float8(devices: Iterable[Any], *, frameworks: Iterable[str]) -> Float8Advice:
    """The FP8 advice for these devices (`polyamp._src.doctor.DeviceInfo`) and installed ``frameworks``
    (names among ``"torch"``, ``"keras"``, ``"jax"``); the rule is in this module's docstring.

    >>> from polyamp._src.doctor import DeviceInfo
    >>> advise_float8([DeviceInfo("torch", "cuda", 0, "H100", (9, 0))], frameworks=["torch"]).policy
    'float8_tensorwise'
    >>> advise_float8([], frameworks=["jax"]).support
    'emulated'
    """
    present = [name for name in FLOAT8_FRAMEWORKS if name in set(frameworks)]
    if not present:
        return Float8Advice(
            "none",
            None,
            "none of PyTorch, Keras and JAX is installed: polyamp's FP8 layers run on polyamp_torch, "
            "polyamp_keras and polyamp_jax.",
        )
    known = [d for d in devices if d.kind == "cuda" and d.compute_capability is not None]
    if known:
        weakest = min(known, key=lambda d: d.compute_capability)
        cc = weakest.compute_capability
        where = f"{weakest.name} (compute capability {cc[0]}.{cc[1]})"
        if cc >= MX_NATIVE:
            return Float8Advice(
                "native",
                "mixed_bfloat16+mxfp8",
                f"{where} has FP8 and MX tensor cores: MXFP8 (32-value blocks, E8M0 scales) keeps bfloat16's "
                "accuracy closest; 'float8_tensorwise' is the fallback.",
            )
        if cc >= NATIVE:
            return Float8Advice(
                "native",
                "float8_tensorwise",
                f"{where} has FP8 tensor cores (compute capability >= 8.9): 'float8_tensorwise' is the fastest "
                "recipe; use 'float8_rowwise' if the loss drifts from the bfloat16 run.",
            )
        return Float8Advice(
            "emulated",
            None,
            f"{where} has no FP8 tensor cores (they need compute capability >= 8.9): the FP8 recipes run "
            "emulated in float32, slower than bfloat16.",
        )
    names = ", ".join(FLOAT8_FRAMEWORKS[name] for name in present)
    return Float8Advice(
        "emulated",
        None,
        f"without a CUDA device the FP8 recipes run on the CPU ({names}) with the values a GPU computes "
        "(to test a recipe), but no faster than the 16-bit policy.",
    )


def float8_conversions(names: Iterable[str], policy: Policy) -> list[str]:
    """What loading a checkpoint with these tensor names into a model under ``policy`` does with FP8 state, one
    line per layer holding delayed scaling's state (its amax histories and scales), or one line for all.

    Weights load unchanged between FP8 and 16-bit models (an FP8 layer keeps its parameters in the policy's
    dtype); only delayed scaling keeps state of its own. A layer counts when it has an amax history.

    >>> names = ["fc.weight", "fc.float8_input_amax_history", "fc.float8_input_scale"]
    >>> print(float8_conversions(names, Policy("mixed_bfloat16"))[0].partition(" has")[0])
    'fc': FP8 delayed-scaling state (2 tensors: fc.float8_input_amax_history, fc.float8_input_scale)
    >>> float8_conversions(["fc.weight"], Policy("mixed_bfloat16"))
    []
    """
    layers: dict[str, list[str]] = {}
    histories: set[str] = set()
    for name in names:
        found = _FLOAT8_STATE.match(name)
        if found:
            layer = found["layer"] or "(top level)"
            layers.setdefault(layer, []).append(name)
            if found["what"] == "amax_history":
                histories.add(layer)
    state = {layer: tensors for layer, tensors in layers.items() if layer in histories}
    recipe = policy.float8
    delayed = recipe is not None and recipe.scaling == "delayed"
    if not state:
        if delayed:
            return [
                f"no FP8 delayed-scaling state: under {policy.name!r} each converted layer starts with a scale of 1 "
                "and an empty amax history (the first steps cast with that scale); the weights load unchanged."
            ]
        if recipe is not None:
            return [
                f"{recipe.spec!r} keeps no state: the weights load unchanged and the FP8 layers scale each cast from "
                "the tensor itself."
            ]
        return []
    lines = []
    for layer, tensors in state.items():
        held = f"{layer!r}: FP8 delayed-scaling state ({len(tensors)} tensors: {', '.join(tensors)})"
        if delayed:
            lines.append(f"{held} loads with its weights and resumes the amax histories and scales.")
        else:
            lines.append(
                f"{held} has no place under {policy.name!r}: loading drops it (torch's load_state_dict(strict=False) "
                "lists it as unexpected keys) and the weights load unchanged. Keep a 'float8_delayed' policy to "
                "resume with the same scales."
            )
    return lines
