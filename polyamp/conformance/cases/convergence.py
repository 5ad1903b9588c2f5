"""Convergence: the mixed policies train like float32."""

from __future__ import annotations

from typing import Any

from polyamp import Policy
from polyamp.conformance._context import (
    parametrize,
    requires,
)
from polyamp.conformance.cases._shared import _batches

# -- convergence ---------------------------------------------------------------------------------------------

#: Final-loss tolerance against the float32 run: |amp - float32| <= CONVERGENCE_ABS + CONVERGENCE_REL * float32.
CONVERGENCE_ABS = 0.05
CONVERGENCE_REL = 0.10


@parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@requires("trainer", "low_precision")
def test_converges_like_float32(harness: Any, policy: str) -> None:
    """80 Adam steps under a mixed policy end within tolerance of the float32 run's loss."""
    batches = _batches(80)

    def final_loss(spec: str) -> float:
        trainer = harness.trainer(Policy(spec), scaler={"enabled": None}, optimizer="adam")
        losses = [float(trainer.step(x, y)) for x, y in batches]
        return sum(losses[-10:]) / 10

    amp, reference = final_loss(policy), final_loss("float32")
    if not abs(amp - reference) <= CONVERGENCE_ABS + CONVERGENCE_REL * reference:
        raise AssertionError(f"final loss {amp:.4f} under {policy}, {reference:.4f} in float32: beyond tolerance")
