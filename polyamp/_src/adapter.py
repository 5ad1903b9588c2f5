"""`ScalerAdapter`: what an adapter that runs a `polyamp.LossScaler` inside its framework's own machinery
(polyamp_keras's ``LossScaleOptimizer``: a jitted stateless step, weights restored by Keras) asks of the
scaler beyond its public API. Kept off the scaler's class, which users read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp._src.errors import ScalerUsageError
from polyamp._src.functional import FunctionalMode
from polyamp._src.loss_scaler import LossScaler

__all__ = ["ScalerAdapter"]


class ScalerAdapter:
    """The adapter's handle on ``scaler``."""

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler

    def functional_iteration(self, grads: Sequence[Any], method: str) -> tuple[FunctionalMode, bool]:
        """One iteration whose device work is the functional form's (`polyamp.FunctionalLossScaler` over
        state the adapter holds): the host-side decisions, made as `LossScaler.apply_gradients` makes them,
        and the iteration ended.

        Returns the mode (``"scaling"``, ``"guarding"`` or ``"off"``), in which the caller runs the functional
        form (whose ``update`` writes the iteration's record into the ring the scaler's `records` reads), and
        whether ``grads`` went through a pending `unscale` already. Raises `ScalerUsageError` as
        `apply_gradients` does (a loss not scaled in this iteration, gradients that went into `unscale`).
        """
        scaler = self.scaler
        enabled = scaler._begin()
        iteration = scaler._iteration
        unscaled = False
        mode: FunctionalMode
        if enabled:
            scaler._require_scaled(method)
            stage = iteration.stages.check(grads, method)
            if stage is not None:
                iteration.stages.consume(stage)
                unscaled = True
            mode = "scaling"
        else:
            mode = "guarding" if iteration.guarding else "off"
        iteration.close()
        scaler._history.written_elsewhere()
        return mode, unscaled

    def restored_on_device(self) -> None:
        """Say that the bound device's variables were restored by the framework itself (an optimizer's weights
        loaded from a Keras file): the records go on from the restored ring, replayed from the restored state.
        Read `records` before: those records belong to the state replaced.

        Raises:
            ScalerUsageError: the scaler is not bound.
        """
        scaler = self.scaler
        if scaler._device is None:
            raise ScalerUsageError("restored_on_device() needs a bound scaler: nothing was restored on a device.")
        scaler._skipped_before = 0  # the restored variables hold the run's skip count
        scaler._history.restart(scaler._device.read_state())
