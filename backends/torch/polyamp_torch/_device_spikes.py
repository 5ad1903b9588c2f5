"""The torch device's side of the spike rule: its window on the device and the rule's steps as torch kernels
(`polyamp.backend_api.SpikeDevice`; the rule itself is `polyamp.backend_api.rules`').

A part of `polyamp_torch._device.TorchDevice`.
"""

from __future__ import annotations

from typing import Any

from polyamp.backend_api import rules
from polyamp.backend_api.arguments import no_gradients_error
from polyamp.backend_api.records import ring_values
from polyamp_torch._framework import torch
from polyamp_torch._rule import ops_for

__all__ = ["SpikeMethods"]

SpikeWindowArrays = rules.SpikeWindowArrays


class _SpikeState:
    """The spike rule's window on the device: a float64 ring of accepted statistics, their count and the run of
    spikes since one was accepted (made on the statistic's device at first use, from ``values`` and
    ``run_value`` when a window was loaded before)."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule
        self.ring: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.run: torch.Tensor | None = None
        self.values: list[float] = []
        self.run_value = 0

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.ring is None or self.count is None or self.run is None:
            ring = torch.zeros(self.rule.window, dtype=torch.float64)
            ring[: len(self.values)] = torch.tensor(self.values, dtype=torch.float64)
            self.ring = ring.to(device)
            self.count = torch.tensor(len(self.values), dtype=torch.int64, device=device)
            self.run = torch.tensor(self.run_value, dtype=torch.int64, device=device)
        return self.ring, self.count, self.run


class SpikeMethods:
    """The spike rule's device operations: stateless, the window lives in the `_SpikeState` they are given."""

    def new_spike_state(self, rule: Any) -> _SpikeState:
        return _SpikeState(rule)

    def spike_statistic(self, loss: Any) -> torch.Tensor:
        """The loss as a float64 scalar (a list of losses: their sum), detached."""
        first = loss if isinstance(loss, torch.Tensor) else loss[0]
        statistic: torch.Tensor = rules.loss_statistic(ops_for(first), loss)
        return statistic

    def spike_grad_norm(self, optimizer: Any) -> torch.Tensor:
        """The global L2 norm of ``optimizer``'s (unscaled) gradients, in float64."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            raise no_gradients_error()
        norm: torch.Tensor = rules.grad_norm(ops_for(grads[0]), grads)
        return norm

    def spike_check(self, state: _SpikeState, x: torch.Tensor) -> torch.Tensor:
        """The rule's decision for ``x`` as a float32 flag (1.0: a spike), on the device, no host read."""
        spike: torch.Tensor = rules.is_spike(ops_for(x), state.rule, SpikeWindowArrays(*state.on(x.device)), x)
        return spike.float()

    def spike_finish(
        self, state: _SpikeState, x: torch.Tensor, spike: torch.Tensor, overflow: torch.Tensor | None
    ) -> torch.Tensor:
        """After the iteration: ``x`` enters the window when the step was applied (emptying it first when the
        run of spikes reached the rule's bound: a re-base); returns the flag of a skip by the spike rule alone
        (counted by the core), or -1 when the iteration re-based (`polyamp.backend_api.SpikeDevice`)."""
        ops = ops_for(x)
        window = SpikeWindowArrays(*state.on(x.device))
        overflowed = None if overflow is None else overflow.to(x.device) > 0
        new, only, rebase = rules.finish(ops, state.rule, window, x, spike > 0, overflowed)
        for variable, value in zip(window, new, strict=True):
            variable.copy_(value)
        flag: torch.Tensor = rules.spike_flag(ops, only, rebase)
        return flag

    def read_spike_window(self, state: _SpikeState) -> list[float]:
        if state.ring is None or state.count is None:
            return list(state.values)
        return [float(v) for v in ring_values(int(state.count), state.ring.tolist())]

    def read_spike_run(self, state: _SpikeState) -> int:
        return state.run_value if state.run is None else int(state.run)

    def write_spike_window(self, state: _SpikeState, values: list[float], run: int = 0) -> None:
        state.values = list(values)
        state.run_value = run
        if state.ring is not None:
            device = state.ring.device
            state.ring = state.count = state.run = None
            state.on(device)
