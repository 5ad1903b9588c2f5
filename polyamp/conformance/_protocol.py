"""What a backend's conformance harness provides: the only way the cases touch a framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from polyamp import LossScaler, Policy

__all__ = ["OPS", "Harness", "HarnessUnavailable", "Trainer"]

#: Op classes whose output dtype the cases check. The first three run in the compute dtype; the others in
#: float32 (as CUDA's autocast lists have them).
OPS = ("matmul", "dense", "conv", "softmax", "log_softmax", "cross_entropy", "layer_norm", "sum")
COMPUTE_OPS = frozenset({"matmul", "dense", "conv"})


class HarnessUnavailable(Exception):
    """Raised by a harness constructor when its framework or device is not available here."""


@runtime_checkable
class Trainer(Protocol):
    """A tiny classifier (8 inputs, 16 hidden ReLU units, 4 classes, cross-entropy) and its optimizer."""

    scaler: LossScaler | None

    def step(self, x: np.ndarray, y: np.ndarray, *, overflow: bool = False) -> float:
        """One iteration; ``overflow`` plants an inf in one (scaled) gradient after backward. Returns the loss."""
        ...

    def params(self) -> list[np.ndarray]:
        """The parameters, as NumPy arrays (float32)."""
        ...

    def optimizer_state(self) -> list[np.ndarray]:
        """The optimizer's slots and step counters, as NumPy arrays."""
        ...

    def step_skipped(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (False without a scaler)."""
        ...


@runtime_checkable
class Harness(Protocol):
    """One backend on one device, as the conformance cases see it.

    Attributes:
        backend: The backend's name ("torch", "tensorflow", ...).
        device: The device type ("cpu", "cuda").
        divergences: Case keys (see `polyamp.conformance.expect_divergence`) where this backend knowingly
            differs from polyamp's semantics, with the reason. Those cases are expected to fail (strictly:
            a passing one is reported, so the table stays true).
    """

    backend: str
    device: str
    divergences: Mapping[str, str]

    def op_dtype(self, op: str, policy: Policy) -> str:
        """Run op class ``op`` (see `OPS`) on low-precision activations under ``policy``; return its output dtype."""
        ...

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        """Build the tiny model under ``policy``; return its parameter dtypes and its output dtype."""
        ...

    def trainer(
        self,
        policy: Policy,
        *,
        scaler: Mapping[str, Any] | None = None,
        optimizer: str = "sgd",
        clip: float | None = None,
        seed: int = 0,
    ) -> Trainer:
        """A `Trainer` under ``policy``. ``scaler``: keyword arguments for this backend's `polyamp.LossScaler`
        (None: a plain loop without scaler). ``optimizer``: "sgd" (momentum 0.9, lr 0.1) or "adam" (lr 0.01).
        ``clip``: unscale, then clip the global gradient norm to this value. Same ``seed``, same initial
        weights."""
        ...

    def tiny_gradient(
        self, x: np.ndarray, w: np.ndarray, factor: float, policy: Policy, scaler: LossScaler | None
    ) -> np.ndarray:
        """The gradient of ``factor * sum(x @ w)`` w.r.t. ``w`` with the matmul under ``policy``, through
        ``scaler`` (scale, backward, unscale) when given; float32."""
        ...

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        """Whether ``scaler.scale(loss)`` returns the very loss object, for one of this backend's tensors."""
        ...
