"""What a backend provides to the core: the protocols a framework translation implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from polyamp._src.scaling import LossScaleConfig, LossScaleState

__all__ = ["Backend", "ScalerImpl"]


@runtime_checkable
class ScalerImpl(Protocol):
    """A loss scaler's device form, created by `Backend.make_scaler` and driven by `polyamp.LossScaler`.

    Besides the methods below, an implementation offers its framework's step methods (``scale``, and
    ``unscale_`` / ``step`` / ``update`` for PyTorch-style loops or ``unscale`` / ``apply_gradients`` for
    TensorFlow-style ones); `polyamp.LossScaler` forwards to whichever the bound backend has.
    """

    def get_state(self) -> LossScaleState:
        """Read the state to the host (may synchronise with the device)."""
        ...

    def set_state(self, config: LossScaleConfig, state: LossScaleState) -> None:
        """Replace config and state. Validation already happened; raise only for misuse (mid-step)."""
        ...

    def get_scale(self) -> float:
        """The current scale as a Python float (may synchronise)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A framework translation of polyamp's semantics, registered by a `polyamp.BackendSpec`."""

    name: str

    def owns(self, obj: object) -> bool:
        """True if ``obj`` is one of this framework's tensors, variables or optimizers."""
        ...

    def make_scaler(self, config: LossScaleConfig, state: LossScaleState, enabled: bool) -> ScalerImpl:
        """Create the device form of a loss scaler starting from ``state``."""
        ...
