"""The end of an iteration: ``update`` advances the rule (or sets a new scale), writes the records and the spike
rule's window; ``discard_iteration`` drops one.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

import math
import numbers
from threading import get_ident
from typing import Any

from polyamp._src import registry
from polyamp._src.errors import (
    InvalidConfigError,
    ScalerUsageError,
    type_error,
)
from polyamp._src.iteration import Iteration
from polyamp._src.scaler_base import ScalerBase
from polyamp._src.scaling import LossScaleState, to_float32

__all__ = ["EndPart"]


class EndPart(ScalerBase):
    """The end of an iteration."""

    def update(self, new_scale: Any = None) -> None:
        """End the iteration: advance the loss-scale rule once, after every optimizer's `step`.

        Args:
            new_scale: Set the scale to this value instead (a positive float within ``[min_scale,
                max_scale]``, or the framework's one-element tensor). Allowed at any point, also
                between iterations, as with ``torch.amp.GradScaler``.

        Raises:
            ScalerUsageError: nothing was stepped or unscaled in this iteration (and no ``new_scale``).
        """
        if self._device is None:
            if new_scale is not None:
                value, _ = self._checked_new_scale(new_scale)
                if not isinstance(value, float):
                    raise ScalerUsageError(
                        "update(new_scale=<tensor>) was called before the scaler saw any tensor; pass a float."
                    )
                self._host_state = LossScaleState(
                    value, self._host_state.growth_tracker, self._host_state.hysteresis_left
                )
                return
            if not self.enabled:
                self._iteration.close()
                return
            raise ScalerUsageError(
                "LossScaler.update() was called before the scaler saw any tensor; call "
                "scaler.scale(loss).backward() and scaler.step(optimizer) first in each iteration."
            )
        uncompiled = self._capabilities.run_uncompiled if self._capabilities is not None else None
        if uncompiled is not None:
            # Traced, the iteration's host bookkeeping (records, provenance, counters) would specialise the
            # compiled code on values that change every iteration; run outside the trace, it is exact. Always,
            # not only while tracing: torch.compile can run this frame untraced yet compile each function it
            # calls as a frame of its own (seen with mode="reduce-overhead" on CUDA), each specialised anew on
            # every iteration's records, and its CUDA graphs would own the state made there.
            uncompiled(self._finish, self._device, new_scale, "update()")
            return
        self._finish(self._device, new_scale, "update()")

    def _finish(self, device: Any, new_scale: Any, method: str) -> None:
        """End the iteration, holding the history's lock: a reader in another thread (`records`, `get_state`)
        sees the device state and the records at one iteration. torch.compile never traces this (`update` runs
        it uncompiled: dynamo cannot trace a lock); ``tf.function`` takes the lock only while tracing.

        Training's steady state ends here in few steps: an iteration opened by this thread (not in a compiled
        region) in which some optimizer has a flag and that `_ends_plainly`. Its end is what `_end_iteration`
        makes of the same iteration: the rule advanced on the iteration's flag (`_iteration_flag`; already, when
        the device advanced it with an ``apply_gradients`` step), that flag as the last outcome, the iteration
        closed and recorded as a "scaling" iteration, skipped as its flag says. (Between a step's kernels, each
        call the host makes costs several times its price in a tight loop.) `_end_iteration` ends every other
        iteration."""
        with self._history.lock:
            iteration = self._iteration
            flagged = iteration.flagged
            if flagged and iteration.thread == get_ident() and self._ends_plainly(new_scale):
                clean, flag = self._iteration_flag(device, iteration)
                if not iteration.advanced:  # (else the device advanced the rule with the step)
                    device.update(flag, None)
                self._outcomes.write_last(device, flag, None)
                iteration.close()
                history = self._history
                history.write("scaling", None if clean else flag, history.host_skip)
                return
            self._end_iteration(device, new_scale, method)

    def _ends_plainly(self, new_scale: Any) -> bool:
        """Whether the current iteration, once some optimizer has a flag, ends by advancing the rule on that
        flag and recording it, nothing more: it scales, and there is no ``new_scale``, spike rule or process
        group. (`_finish` takes its few steps for it when this thread opened it, out of a compiled region.)"""
        return bool(
            new_scale is None and self._iteration.enabled and self._spikes.rule is None and self._process_group is None
        )

    def _end_iteration(self, device: Any, new_scale: Any, method: str) -> None:
        iteration = self._iteration
        history = self._history
        if not self._begin(None, iteration) and new_scale is None:
            if iteration.guarding and iteration.flagged:
                clean, combined = self._iteration_flag(device, iteration)
                if not clean:
                    device.count_skip(combined)
                spike_only = self._finish_spike(device, combined)
                self._outcomes.write_last(
                    device, self._with_flag(device, combined, spike_only), False if clean else None
                )
                history.write("guarding", None if clean else combined, history.host_skip, spike_only)
            else:
                self._outcomes.write_last(device, device.finite_flag(), False)
                history.write("off", None, False)
            iteration.close()
            self._count_group_iteration()
            return
        # the value for the device, and the scale as a float when the host knows it (a tensor read eagerly)
        value, known = (None, None) if new_scale is None else self._checked_new_scale(new_scale)
        if value is None and not iteration.flagged:
            iteration.check_update(method)
            raise ScalerUsageError(
                f"{method} was called but none of the optimizers unscaled in this iteration had gradients, "
                "so there is nothing to base the update on. Call scaler.scale(loss).backward() first."
            )
        clean, combined = self._iteration_flag(device, iteration)
        skipped_on_host = history.host_skip
        if not iteration.advanced:  # (else the device advanced the rule with the step)
            device.update(combined, value)
        spike_only = None if self._spikes.rule is None else self._finish_spike(device, combined)
        if combined is not None:
            self._outcomes.write_last(device, self._with_flag(device, combined, spike_only), None)
        iteration.close()
        if self._process_group is not None:
            self._count_group_iteration()
        if value is not None:
            if combined is not None:  # the iteration counts as skipped or not, but the rule did not run
                history.write("set", combined, False, spike_only, set_scale=known)
            history.reanchor_after_set(value)
        elif combined is not None:
            history.write("scaling", None if clean else combined, skipped_on_host, spike_only)

    def _iteration_flag(self, device: Any, iteration: Iteration) -> tuple[bool, Any]:
        """Whether the host knows the iteration was finite, and the flag standing for the iteration (None
        when no step has a flag). Known finite (`_known_finite`): the flag is the device's finite flag (nothing
        to combine, the device may leave out what only an overflow needs, and the record needs no flag read back
        later); else the steps' flags combined."""
        flagged = iteration.flagged
        if not flagged:
            return False, None
        if self._known_finite(flagged):
            return True, device.finite_flag()
        return False, device.combine(iteration.found_infs())

    def _known_finite(self, flags: int) -> bool:
        """Whether the host knows the iteration was finite, given how many of its optimizers have a flag: some
        have, each step read its flag as "not skipped" to the host, and no spike rule decided on the device."""
        return flags > 0 and self._history.host_clean == flags and self._spikes.flag is None

    def _finish_spike(self, device: Any, overflow: Any) -> Any:
        """End the iteration for the spike rule: its statistic enters the window if the step was applied, a
        skip by the rule alone is counted; returns that skip's flag (None without a decision)."""
        only = self._spikes.finish(overflow)
        if only is not None:
            device.count_skip(only)
        return only

    @staticmethod
    def _with_flag(device: Any, flag: Any, spike_only: Any) -> Any:
        return flag if spike_only is None else device.combine([flag, spike_only])

    def discard_iteration(self) -> None:
        """Forget the current iteration without updating the scale: its stages, checks and pending unscaled
        gradients, as if it never started.

        For recovering after an exception in the middle of a training step (the next iteration starts
        clean); the scale, counters and skip records stay as they were.

        With a ``process_group``, every rank reduces its found-inf flags with the others at each ``unscale_``
        and ``step``, so a rank may discard an iteration alone only after those reductions; otherwise call it on
        every rank for the same iteration. A rank that discards alone before its reductions would pair its next
        iteration's reductions with the others' current ones: each reduction carries the rank's iteration
        count, so this is detected on the device, the affected steps are skipped on every rank, and the next
        read of the records (`records`, or the scaler's own reads) raises `ScalerUsageError` naming the cause.
        """
        self._iteration.close()
        self._history.reset_iteration()
        self._spikes.reset()
        self._count_group_iteration()

    def _count_group_iteration(self) -> None:
        """Tell a device that reduces flags over a process group that this rank's iteration ended."""
        if self._process_group is not None and self._device is not None:
            self._group_iterations += 1
            self._device.set_group_iteration(self._group_iterations)

    def _checked_new_scale(self, new_scale: Any) -> tuple[Any, float | None]:
        """``update(new_scale)``'s argument validated: (what the device sets, its value when the host knows it)."""
        if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
            if registry.detect_backend(new_scale) != self._backend_name or self._backend_name is None:
                raise type_error("update(new_scale)", "a float or a one-element tensor", new_scale)
            # A framework tensor: the device checks its shape and dtype and reads it (one host sync), and its
            # value is checked like a float's; a symbolic tensor in a compiled function is taken as is.
            number = self._device.read_new_scale(new_scale)
            known = None if number is None else self._checked_new_scale(number)[1]
            return new_scale, known
        try:
            value = to_float32(float(new_scale))
        except OverflowError:
            value = math.inf
        config = self._config
        if not (math.isfinite(value) and value > 0):
            raise InvalidConfigError(f"update(new_scale) needs a finite positive scale. Received: {new_scale!r}.")
        if value < config.floor_f32 or (config.max_scale_f32 is not None and value > config.max_scale_f32):
            raise InvalidConfigError(
                f"update(new_scale={new_scale!r}) is outside [min_scale, max_scale] = "
                f"[{config.floor_f32!r}, {config.max_scale!r}] (without a min_scale, the floor is 1.0)."
            )
        return value, value
