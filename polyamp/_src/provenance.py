"""Which parameters held the non-finite gradients of a skipped step: one schema for every backend.

When an iteration skips a step, its `polyamp.StepRecord` carries ``gradients``: one `NonFiniteGradient` per
parameter whose gradient held inf, -inf or NaN, with the counts of each, the parameter's name and its layer
(the name up to its last ``.`` (torch module paths) or ``/`` (Keras variable paths)). Steps that do not skip
pay nothing for it: a backend counts only in the branch that skips (TensorFlow, Keras: inside the ``cond``), or
after the host already learned that the step skipped (torch's non-fused optimizers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["NonFiniteGradient", "layer_of", "non_finite_gradients"]


@dataclass(frozen=True)
class NonFiniteGradient:
    """One parameter whose gradient held non-finite values in a skipped step.

    Attributes:
        name: The parameter's name (``"encoder.0.weight"``, ``"dense/kernel"``); torch optimizers built from
            ``model.named_parameters()`` carry the names, others give ``"param_groups[g][i]"``.
        layer: The module or layer holding it (the name without its last component).
        inf, neg_inf, nan: How many elements of the gradient were +inf, -inf and NaN.
        size: How many elements the gradient has.
    """

    name: str
    layer: str
    inf: int
    neg_inf: int
    nan: int
    size: int

    def describe(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in (("inf", self.inf), ("-inf", self.neg_inf), ("NaN", self.nan)) if n)
        return f"{self.name} ({counts} of {self.size})"


def layer_of(name: str) -> str:
    """The layer or module of a parameter name: ``"block.1.weight"`` -> ``"block.1"``, ``"dense/kernel"`` ->
    ``"dense"``; a name without separator is its own layer."""
    cut = max(name.rfind("."), name.rfind("/"))
    return name[:cut] if cut > 0 else name


def non_finite_gradients(entries: Iterable[tuple[str, int, int, int, int]]) -> tuple[NonFiniteGradient, ...]:
    """`NonFiniteGradient` records from ``(name, inf, neg_inf, nan, size)`` counts, leaving out finite ones."""
    return tuple(
        NonFiniteGradient(name, layer_of(name), int(inf), int(neg_inf), int(nan), int(size))
        for name, inf, neg_inf, nan, size in entries
        if inf or neg_inf or nan
    )
