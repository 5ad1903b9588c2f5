"""`SchedulerGuard`: an LR scheduler that does not advance on steps the loss scaler skipped."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError
from polyamp._src.errors import describe
from polyamp_torch._scaler import impl_of

__all__ = ["SchedulerGuard"]


class SchedulerGuard:
    """Wraps an LR scheduler so ``step()`` is a no-op when the scaler skipped its optimizer's last step.

    With loss scaling, early iterations often overflow and skip ``optimizer.step()``; a plain scheduler
    advances anyway, shifting the whole schedule (and warning that ``lr_scheduler.step()`` ran before
    ``optimizer.step()``). With fused optimizers the step "runs" even when skipped, so the schedule drifts
    silently. The guard checks the scaler's record for the scheduler's optimizer instead.

    Cost: none for ordinary optimizers (``scaler.step`` already read the flag); one host read of the flag
    per iteration for fused ones (whose step never syncs).

    Everything else (``state_dict``, ``get_last_lr``, ``last_epoch``, ...) is the wrapped scheduler's.

    Args:
        scheduler: Any ``torch.optim.lr_scheduler`` scheduler (or object with ``.optimizer`` and ``.step``).
        scaler: The `polyamp.LossScaler` that steps that optimizer.

    Example::

        scheduler = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.OneCycleLR(opt, ...), scaler)
        for x, y in loader:
            ...
            scaler.step(opt)
            scaler.update()
            scheduler.step()        # advances only if opt's step was applied
    """

    def __init__(self, scheduler: Any, scaler: LossScaler) -> None:
        if not hasattr(scheduler, "optimizer") or not callable(getattr(scheduler, "step", None)):
            raise PolyampTypeError(
                f"SchedulerGuard wraps an LR scheduler with .optimizer and .step(). Received: {describe(scheduler)}."
            )
        if not isinstance(scaler, LossScaler):
            raise PolyampTypeError(f"SchedulerGuard needs the polyamp.LossScaler in use. Received: {describe(scaler)}.")
        self.scheduler = scheduler
        self.scaler = scaler
        #: How many scheduler steps were held back because the optimizer step was skipped.
        self.held_back = 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Advance the wrapped scheduler unless its optimizer's last step was skipped."""
        if self.scaler.enabled:
            skipped = impl_of(self.scaler, bind_from=self.scheduler.optimizer).was_skipped(self.scheduler.optimizer)
            if skipped:
                self.held_back += 1
                return None
        return self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "scaler", "held_back"):  # not yet set: avoid recursion during unpickling
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SchedulerGuard({self.scheduler!r}, held_back={self.held_back})"
