"""`SchedulerGuard`: an LR scheduler that does not advance on steps the loss scaler skipped."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp_torch._framework import torch

__all__ = ["SchedulerGuard"]

_HELD_BACK_KEY = "polyamp_held_back"


class SchedulerGuard(torch.optim.lr_scheduler.LRScheduler):
    """Wraps an LR scheduler so ``step()`` is a no-op when the scaler skipped its optimizer's last step.

    With loss scaling, early iterations often overflow and skip ``optimizer.step()``; a plain scheduler
    advances anyway, shifting the whole schedule (and warning that ``lr_scheduler.step()`` ran before
    ``optimizer.step()``). With fused optimizers the step "runs" even when skipped, so the schedule drifts
    silently. The guard checks the scaler's record for the scheduler's optimizer instead.

    It is a ``torch.optim.lr_scheduler.LRScheduler`` (frameworks that check the type accept it); everything
    it does not define (``get_last_lr``, ``last_epoch``, ...) is the wrapped scheduler's. Its
    ``state_dict`` is the wrapped scheduler's plus ``"polyamp_held_back"``, so the count survives a resume;
    ``load_state_dict`` also takes the wrapped scheduler's own dicts.

    Cost: none for ordinary optimizers (``scaler.step`` already read the flag); one host read of the flag
    per iteration for fused ones and under ``LossScaler(skip_on_device=True)`` (whose steps never sync).

    Args:
        scheduler: Any ``torch.optim.lr_scheduler`` scheduler (or object with ``.optimizer`` and ``.step``).
        scaler: The `polyamp.LossScaler` that steps that optimizer.

    Example:
        ```python
        scheduler = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.OneCycleLR(opt, ...), scaler)
        for x, y in loader:
            ...
            scaler.step(opt)
            scaler.update()
            scheduler.step()        # advances only if opt's step was applied
        ```
    """

    def __init__(self, scheduler: Any, scaler: LossScaler) -> None:
        # LRScheduler.__init__ is not called: the wrapped scheduler already holds the schedule's state.
        if not hasattr(scheduler, "optimizer") or not callable(getattr(scheduler, "step", None)):
            raise PolyampTypeError(
                f"SchedulerGuard wraps an LR scheduler with .optimizer and .step(). Received: {describe(scheduler)}."
            )
        if not isinstance(scaler, LossScaler):
            raise PolyampTypeError(f"SchedulerGuard needs the polyamp.LossScaler in use. Received: {describe(scaler)}.")
        self.__dict__["scheduler"] = scheduler
        self.__dict__["scaler"] = scaler
        #: How many scheduler steps were held back because the optimizer step was skipped.
        self.__dict__["held_back"] = 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Advance the wrapped scheduler unless its optimizer's last step was skipped."""
        if self.scaler.was_skipped(self.scheduler.optimizer):
            self.held_back += 1
            return None
        return self.scheduler.step(*args, **kwargs)

    # The LRScheduler interface, answered by the wrapped scheduler.
    @property
    def optimizer(self) -> Any:
        return self.scheduler.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self.scheduler.optimizer = value

    @property
    def last_epoch(self) -> Any:
        return self.scheduler.last_epoch

    @last_epoch.setter
    def last_epoch(self, value: Any) -> None:
        self.scheduler.last_epoch = value

    @property
    def base_lrs(self) -> Any:
        return self.scheduler.base_lrs

    @base_lrs.setter
    def base_lrs(self, value: Any) -> None:
        self.scheduler.base_lrs = value

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {**self.scheduler.state_dict(), _HELD_BACK_KEY: self.held_back}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        held_back = state.pop(_HELD_BACK_KEY, None)
        self.scheduler.load_state_dict(state)
        if held_back is not None:
            self.held_back = int(held_back)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "scaler", "held_back"):  # not yet set: avoid recursion during unpickling
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("scheduler", "scaler", "held_back") or name in type(self).__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"SchedulerGuard({self.scheduler!r}, held_back={self.held_back})"
