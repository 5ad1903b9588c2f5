"""The PyTorch-style loop: gradients on the parameters, ``unscale_`` (with clipping folded in) and ``step``.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

from typing import Any

from polyamp._src import registry
from polyamp._src.errors import (
    PolyampTypeError,
    ScalerUsageError,
)
from polyamp._src.iteration import Stage, no_gradients_error
from polyamp._src.scaler_base import ScalerBase, check_norm_bound

__all__ = ["ImperativePart"]


class ImperativePart(ScalerBase):
    """The PyTorch-style loop."""

    def unscale_(self, optimizer: Any) -> None:
        """PyTorch: divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional, for inspecting or clipping gradients before `step`. At most once per optimizer per
        `update`.

        Raises:
            ScalerUsageError: a second call for this optimizer in the iteration, or a call after its step.
        """
        device = self._styled("unscale_", "imperative", optimizer)
        device.check_optimizer("unscale_", optimizer)
        if not self._begin():
            return
        self._require_scaled("unscale_()")
        self._iteration.check_unscale(optimizer, "unscale_()")
        self._iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))

    def unscale_and_clip_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> tuple[bool, Any]:
        """PyTorch: `unscale_` with gradient-norm clipping folded in, where the device can fold it.

        Returns ``(folded, total_norm)``: ``(True, norm)`` when the gradients were unscaled and clipped in one
        pass (``norm``: the total norm of the unscaled gradients, as ``torch.nn.utils.clip_grad_norm_`` returns
        it); ``(False, None)`` when they were only unscaled (the device cannot fold this case, or the scaler is
        not scaling) and the caller clips. Same rules as `unscale_`.
        """
        device = self._styled("unscale_", "imperative", optimizer)
        device.check_optimizer("unscale_", optimizer)
        check_norm_bound("max_norm", max_norm)
        if not self._begin():
            return False, None
        self._require_scaled("unscale_()")
        self._iteration.check_unscale(optimizer, "unscale_()")
        fold = None if self._capabilities is None else self._capabilities.unscale_and_clip
        folded = None if fold is None else fold(optimizer, float(max_norm), float(norm_type))
        if folded is None:
            self._iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))
            return False, None
        flag, total_norm = folded
        self._iteration.mark(optimizer, Stage.UNSCALED, flag)
        return True, total_norm

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless one of its gradients is inf or NaN.

        PyTorch: ``step(optimizer, *args, **kwargs)`` unscales (unless `unscale_` did), then calls
        ``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite; returns its result, or None when
        skipped. TensorFlow: ``step(optimizer, grads_and_vars)`` applies or skips in the graph. Either way,
        each optimizer steps once per iteration; `update` ends the iteration.

        Raises:
            ScalerUsageError: the optimizer already stepped in this iteration, has no gradients, or a closure
                was passed while scaling.
        """
        if self._device is None:  # the optimizer's backend decides the loop style
            owner = registry.detect_backend(optimizer)
            if owner is not None:
                self.bind(owner)
        capabilities = self._capabilities
        if capabilities is not None and capabilities.style == "tape":
            if kwargs.keys() - {"grads_and_vars"} or len(args) + len(kwargs) != 1:
                raise PolyampTypeError(
                    "A TensorFlow-style step takes (optimizer, grads_and_vars). Received "
                    f"{len(args)} positional and {sorted(kwargs)} keyword arguments after the optimizer."
                )
            pairs = args[0] if args else kwargs["grads_and_vars"]
            device = self._styled("step", "tape", optimizer)
            return self._apply(device, optimizer, pairs, "step()")
        device = self._styled("step", "imperative", optimizer)
        device.check_optimizer("step", optimizer)
        iteration = self._iteration
        enabled = self._begin(None, iteration)
        stage = iteration.check_step(optimizer, "step()")
        if not enabled:
            closure = "closure" in kwargs or (args and callable(args[0]))
            checked = device.check_gradients_finite(optimizer) if iteration.guarding and not closure else None
            if checked is None:  # not guarding, no gradients, or a closure that recomputes them in the step
                result = device.plain_step(optimizer, args, kwargs)
                iteration.mark(optimizer, Stage.STEPPED, None)
                self._remember(optimizer, device.finite_flag(), False)
                return result
            skip = self._spike_decision(device, optimizer, checked)
            outcome = self._device_step(device, optimizer, skip, args, kwargs)
            iteration.mark(optimizer, Stage.STEPPED, checked)
            self._remember(optimizer, skip, outcome.skipped)
            return outcome.result
        if not iteration.scaled:
            self._require_scaled("step()")
        if "closure" in kwargs or (args and callable(args[0])):
            raise ScalerUsageError(
                "step() with a closure is not supported while loss scaling is enabled: the closure would "
                "recompute gradients that are scaled but never unscaled. Compute the loss and gradients before "
                "step(), or use a bfloat16 policy without loss scaling."
            )
        own_scaling = self._capabilities.step_own_scaling if self._capabilities is not None else None
        if own_scaling is not None:
            result = own_scaling(optimizer, self, args, kwargs)
            if result is not NotImplemented:
                # The optimizer scaled by itself (through this scaler's public methods); record what it checked.
                checked = iteration.found_inf_of(optimizer)
                iteration.mark(optimizer, Stage.STEPPED, checked)
                self._remember(optimizer, device.finite_flag() if checked is None else checked, None)
                return result
        found_inf = None
        if stage is Stage.UNSCALED:
            found_inf = iteration.found_inf_of(optimizer)
            if found_inf is None:
                raise no_gradients_error()
        elif self._spikes.rule is not None or not device.unscales_in_step(optimizer):
            # (A spike rule decides before the step, on unscaled gradients: a fused optimizer then gets them
            # unscaled, with the combined flag.)
            found_inf = device.unscale_gradients(optimizer)
            if found_inf is None:
                raise no_gradients_error()
            iteration.mark(optimizer, Stage.UNSCALED, found_inf)  # the gradients are unscaled now, whatever follows
        if self._spikes.rule is None:
            outcome = self._device_step(device, optimizer, found_inf, args, kwargs)
            iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)
            self._remember(optimizer, outcome.found_inf, outcome.skipped)
            return outcome.result
        skip = self._spike_decision(device, optimizer, found_inf)
        outcome = self._device_step(device, optimizer, skip, args, kwargs)
        iteration.mark(optimizer, Stage.STEPPED, found_inf)  # the scale rule sees overflows only
        self._remember(optimizer, skip, outcome.skipped)
        return outcome.result

    def _device_step(self, device: Any, optimizer: Any, flag: Any, args: Any, kwargs: Any) -> Any:
        """The device's step, or with ``skip_on_device`` its masked step where it has one and can take it."""
        if self._skip_on_device and flag is not None and self._capabilities is not None:
            masked = self._capabilities.step_on_device
            outcome = None if masked is None else masked(optimizer, flag, args, kwargs)
            if outcome is not None:
                return outcome
        return device.step(optimizer, flag, args, kwargs)

    def _spike_decision(self, device: Any, optimizer: Any, found_inf: Any) -> Any:
        """``found_inf`` combined with the spike rule's flag (imperative devices)."""
        self._spikes.decide(lambda: device.spike_grad_norm(optimizer))
        return self._with_spike(device, found_inf)
