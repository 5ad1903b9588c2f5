"""What the training-framework integrations share: the scaler argument checks, records as logged numbers."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError, SpikeRule
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.records import SKIP_REASONS

__all__ = ["RecordTally", "check_scaler_arguments"]


def check_scaler_arguments(caller: str, scaler: Any, guard: Any, spike: Any) -> None:
    """Check an integration's ``scaler=``/``guard=``/``spike=`` arguments: a torch `polyamp.LossScaler` or None;
    ``guard`` and ``spike`` configure the scaler the integration creates, so they come without ``scaler``.

    Raises:
        PolyampTypeError: a wrong type, or ``guard``/``spike`` given with a ``scaler``.
    """
    if scaler is not None and (not isinstance(scaler, LossScaler) or scaler.backend not in (None, "torch")):
        raise PolyampTypeError(
            f"{caller}'s `scaler` takes None or a polyamp.LossScaler for torch (polyamp_torch.TorchLossScaler(...) "
            f"or polyamp.LossScaler(...)). Received: {describe(scaler)}."
        )
    if guard is not None and not isinstance(guard, bool):
        raise PolyampTypeError(f"{caller}'s `guard` takes None, True or False. Received: {describe(guard)}.")
    if spike is not None and not isinstance(spike, SpikeRule):
        raise PolyampTypeError(
            f"{caller}'s `spike` takes None or a polyamp.SpikeRule, e.g. SpikeRule(). Received: {describe(spike)}."
        )
    if scaler is not None and (guard is not None or spike is not None):
        raise PolyampTypeError(
            f"{caller} got a `scaler` and `guard`/`spike`: these configure the scaler it creates when `scaler` is "
            "None. Set them on your scaler instead, e.g. TorchLossScaler(guard=True, spike=polyamp.SpikeRule())."
        )


class RecordTally:
    """Adds up a `polyamp.LossScaler`'s step records for a training framework's logger.

    `read` takes the records of the iterations ended since the previous read (one host read, see
    ``LossScaler.records``) and returns, when there were any:

    * ``loss_scale``: the scale the latest iteration's loss was multiplied by (left out when that iteration
      did not scale: a bfloat16 or float32 guard, a disabled scaler);
    * ``skipped_steps``: how many iterations skipped their step since the scaler was created;
    * ``skipped_steps/<reason>``: how many of those were skipped for each reason seen so far (``overflow``,
      ``non_finite``, ``loss_spike``, ``grad_spike``), counted over the records read.

    A scaler keeps its last ``history`` records (256 by default): reading at least that often counts every
    reason.
    """

    def __init__(self, scaler: LossScaler) -> None:
        if not isinstance(scaler, LossScaler):
            raise PolyampTypeError(
                f"RecordTally needs the polyamp.LossScaler in use. Received: {describe(scaler)}. Pass the scaler "
                "the training loop steps with (polyamp_torch.TorchLossScaler or polyamp.LossScaler)."
            )
        self.scaler = scaler
        self._next = 0  # the first iteration not read yet
        self._reasons: dict[str, int] = {}

    def read(self) -> dict[str, float]:
        """The numbers to log after the iterations ended since the previous call; empty when none ended."""
        latest = None
        for record in self.scaler.records():
            if record.iteration < self._next:
                continue
            if record.skipped and record.reason is not None:
                self._reasons[record.reason] = self._reasons.get(record.reason, 0) + 1
            latest = record
            self._next = record.iteration + 1
        if latest is None:
            return {}
        values: dict[str, float] = {}
        if latest.scale is not None:
            values["loss_scale"] = float(latest.scale)
        values["skipped_steps"] = float(int(self.scaler.skipped_steps()))
        for reason in SKIP_REASONS:
            if reason in self._reasons:
                values[f"skipped_steps/{reason}"] = float(self._reasons[reason])
        return values
