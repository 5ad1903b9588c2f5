"""The TensorFlow-style loop: gradients as values, ``unscale`` (with clipping folded in) and ``apply_gradients``.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from polyamp._src.errors import (
    PolyampTypeError,
)
from polyamp._src.iteration import Stage
from polyamp._src.scaler_base import ScalerBase, check_norm_bound

__all__ = ["TapePart"]


class TapePart(ScalerBase):
    """The TensorFlow-style loop."""

    def unscale(self, grads: Iterable[Any]) -> list[Any]:
        """TensorFlow: return the gradients divided by the scale (None entries stay None).

        The next `apply_gradients` (or `step`) takes its gradients as unscaled: these, or tensors made from
        them (clipped). Passing the scaled originals instead raises `ScalerUsageError`.
        """
        grads = list(grads)
        device = self._styled("unscale", "tape", grads)
        device.check_gradients("unscale", grads)
        if not self._begin():
            return grads
        self._require_scaled("unscale()")
        unscaled = device.unscale(grads)
        self._iteration.stages.record(grads, unscaled, method="unscale()")
        return unscaled  # type: ignore[no-any-return]

    def unscale_and_clip(self, grads: Iterable[Any], clip_norm: float) -> tuple[list[Any], Any]:
        """TensorFlow: `unscale` and ``tf.clip_by_global_norm(..., clip_norm)`` in one multiply of the gradients.

        Returns ``(clipped, global_norm)`` as ``tf.clip_by_global_norm`` does: the unscaled gradients clipped to
        a global norm of ``clip_norm`` (None entries stay None) and their global norm before clipping. The next
        `apply_gradients` (or `step`) takes them as unscaled, as after `unscale`. For a power-of-two scale the
        values are bit for bit those of the two steps. When the scaler is not scaling, this is the clipping alone.
        """
        grads = list(grads)
        device = self._styled("unscale", "tape", grads)
        device.check_gradients("unscale_and_clip", grads)
        check_norm_bound("clip_norm", clip_norm)
        fold = None if self._capabilities is None else self._capabilities.unscale_and_clip_values
        if fold is None:
            raise PolyampTypeError(
                f"The {self._backend_name!r} backend's scaler cannot clip gradients in the unscale; call unscale() "
                "and clip the gradients it returns."
            )
        if not self._begin():
            return fold(grads, float(clip_norm), scaled=False)  # type: ignore[no-any-return]
        self._require_scaled("unscale_and_clip()")
        clipped, norm = fold(grads, float(clip_norm), scaled=True)
        self._iteration.stages.record(grads, clipped, method="unscale_and_clip()")
        return clipped, norm

    def apply_gradients(self, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """TensorFlow: `step` then `update` in one call: unscale (unless done), check, apply or skip, update.

        Usable eagerly and inside ``tf.function`` (also ``jit_compile=True``): the skip is decided in the
        graph, with no Python branch on a tensor value. Returns what the optimizer's apply returns.
        """
        device = self._styled("apply_gradients", "tape", optimizer)
        result = self._apply(device, optimizer, grads_and_vars, "apply_gradients()", ends=True)
        self._finish(device, None, "apply_gradients()")
        return result

    def _apply(
        self, device: Any, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]], method: str, *, ends: bool = False
    ) -> Any:
        """Check, unscale, apply or skip. ``ends``: `_finish` ends the iteration right after, with no
        ``new_scale`` (``apply_gradients``)."""
        device.check_optimizer(method.removesuffix("()"), optimizer)
        pairs = [tuple(pair) for pair in grads_and_vars]
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        device.check_gradients(method.removesuffix("()"), grads)
        enabled = self._begin()
        iteration = self._iteration
        iteration.check_step(optimizer, method)
        if not enabled:
            if not iteration.guarding:
                result = device.plain_apply(optimizer, grads, variables)
                iteration.mark(optimizer, Stage.STEPPED, None)
                self._remember(optimizer, device.finite_flag(), False)
                return result
            veto = self._spikes.decide(lambda: device.spike_grad_norm(grads, unscaled=True))
            outcome = device.apply(optimizer, grads, variables, unscaled=True, veto=veto)  # check, apply or skip
            iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)
            self._remember(optimizer, self._with_spike(device, outcome.found_inf), outcome.skipped)
            return outcome.result
        self._require_scaled(method)
        stage = iteration.stages.check(grads, method)
        veto = self._spikes.decide(lambda: device.spike_grad_norm(grads, unscaled=stage is not None))
        outcome = None
        fused = None if self._capabilities is None else self._capabilities.apply_and_advance
        if fused is not None and ends and veto is None and not iteration.flagged and self._ends_plainly(None):
            # The iteration is this step alone and ends in `_finish`'s few steps: the rule advances on this
            # step's flag there, so the device may advance it in the branch that applies or skips.
            outcome = fused(optimizer, grads, variables, unscaled=stage is not None)
            iteration.advanced = outcome is not None and outcome.found_inf is not None
        if outcome is None:
            outcome = device.apply(optimizer, grads, variables, unscaled=stage is not None, veto=veto)
        if stage is not None:
            iteration.stages.consume(stage)
        iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)  # overflows only: the rule's input
        self._remember(optimizer, self._with_spike(device, outcome.found_inf), outcome.skipped)
        return outcome.result

    def _with_spike(self, device: Any, found_inf: Any) -> Any:
        flag = self._spikes.flag
        return found_inf if flag is None else device.combine([found_inf, flag])
