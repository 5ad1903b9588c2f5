"""The PyTorch-style loop: gradients on the parameters, ``unscale_`` (with clipping folded in) and ``step``.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

import weakref
from typing import Any

from polyamp._src import registry
from polyamp._src.errors import (
    PolyampTypeError,
    ScalerUsageError,
)
from polyamp._src.iteration import Stage, no_gradients_error
from polyamp._src.scaler_base import ScalerBase, check_norm_bound

__all__ = ["ImperativePart", "masked_step"]


def masked_step(device: Any, masked: Any, optimizer: Any, flag: Any, args: Any, kwargs: Any) -> Any:
    """An imperative device's step with ``skip_on_device`` (``LossScaler._device_step`` when the device has
    ``step_on_device``, ``masked``): its masked step where it can take it (a flag is known), else its step."""
    outcome = None if flag is None else masked(optimizer, flag, args, kwargs)
    return device.step(optimizer, flag, args, kwargs) if outcome is None else outcome


class ImperativePart(ScalerBase):
    """The PyTorch-style loop."""

    def unscale_(self, optimizer: Any) -> None:
        """PyTorch: divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional, for inspecting or clipping gradients before `step`. At most once per optimizer per
        `update`.

        Raises:
            ScalerUsageError: a second call for this optimizer in the iteration, or a call after its step.
        """
        checked = self._checked_optimizers["unscale_"]  # (the last optimizer `_check` passed, weakly)
        device = self._device if checked is not None and checked() is optimizer else self._check("unscale_", optimizer)
        iteration = self._only_iteration or self._iteration
        if not self._begin(None, iteration):
            return
        if not iteration.scaled:
            self._require_scaled("unscale_()")
        iteration.check_unscale(optimizer, "unscale_()")
        iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))

    def unscale_and_clip_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> tuple[bool, Any]:
        """PyTorch: `unscale_` with gradient-norm clipping folded in, where the device can fold it.

        Returns ``(folded, total_norm)``: ``(True, norm)`` when the gradients were unscaled and clipped in one
        pass (``norm``: the total norm of the unscaled gradients, as ``torch.nn.utils.clip_grad_norm_`` returns
        it); ``(False, None)`` when they were only unscaled (the device cannot fold this case, or the scaler is
        not scaling) and the caller clips. Same rules as `unscale_`.
        """
        checked = self._checked_optimizers["unscale_"]  # (the last optimizer `_check` passed, weakly)
        device = self._device if checked is not None and checked() is optimizer else self._check("unscale_", optimizer)
        check_norm_bound("max_norm", max_norm)
        iteration = self._only_iteration or self._iteration
        if not self._begin(None, iteration):
            return False, None
        if not iteration.scaled:
            self._require_scaled("unscale_()")
        iteration.check_unscale(optimizer, "unscale_()")
        fold = None if self._capabilities is None else self._capabilities.unscale_and_clip
        folded = None if fold is None else fold(optimizer, float(max_norm), float(norm_type))
        if folded is None:
            iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))
            return False, None
        flag, total_norm = folded
        iteration.mark(optimizer, Stage.UNSCALED, flag)
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
        checked = self._checked_optimizers["step"]  # (the last optimizer `_check` passed, weakly)
        device = self._device if checked is not None and checked() is optimizer else self._check("step", optimizer)
        iteration = self._only_iteration or self._iteration
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
            outcome = self._device_step(optimizer, skip, args, kwargs)
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
            outcome = self._device_step(optimizer, found_inf, args, kwargs)
            iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)
            # `_remember`, in place (every scaling step passes here)
            self._outcomes.write(device, optimizer, outcome.found_inf, outcome.skipped)
            self._history.note_step(optimizer, outcome.skipped)
            return outcome.result
        skip = self._spike_decision(device, optimizer, found_inf)
        outcome = self._device_step(optimizer, skip, args, kwargs)
        iteration.mark(optimizer, Stage.STEPPED, found_inf)  # the scale rule sees overflows only
        self._remember(optimizer, skip, outcome.skipped)
        return outcome.result

    def _check(self, method: str, optimizer: Any) -> Any:
        """The device, once ``optimizer`` is known to be one it steps through ``method`` (``"unscale_"`` or
        ``"step"``): the framework's and the loop style's (`_styled`, which binds an unbound scaler), then the
        device's ``check_optimizer``. The optimizer checked is remembered in ``_checked_optimizers[method]``
        (weakly, and not while a compiler traces the call); the callers do not check it again while it is the
        one they get: what is checked is its type and what it holds, which a training loop does not change
        under the scaler."""
        device = self._styled(method, "imperative", optimizer)
        device.check_optimizer(method, optimizer)
        if not self._compiling():
            try:
                self._checked_optimizers[method] = weakref.ref(optimizer)
            except TypeError:  # not weakly referenceable: checked every time
                pass
        return device

    def _spike_decision(self, device: Any, optimizer: Any, found_inf: Any) -> Any:
        """``found_inf`` combined with the spike rule's flag (imperative devices)."""
        self._spikes.decide(lambda: device.spike_grad_norm(optimizer))
        return self._with_spike(device, found_inf)
