"""polyamp's loss scaler in Hugging Face's ``Trainer``: `prepare_trainer` and `PolyampCallback`.

Importing this module imports Transformers and Accelerate; without them installed it raises
``polyamp.BackendNotInstalledError`` (an ``ImportError``) saying what to install. ``import polyamp_torch`` never
imports them.
"""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.versions import import_framework
from polyamp_torch._integration import RecordTally

import_framework(
    "transformers",
    "polyamp_torch.transformers",
    "Transformers",
    "Install it with: pip install transformers accelerate (or pip install 'polyamp[hf]').",
)
import transformers  # noqa: E402

# After the transformers import, so that a missing transformers is what the error names first.
from polyamp_torch.accelerate import prepare_accelerator  # noqa: E402

__all__ = ["PolyampCallback", "prepare_trainer"]

#: Between logs, the records are also read every this many optimizer steps, so that no skip reason is lost from
#: the scaler's record history (``history``, 256 iterations by default) however far apart the logs are.
READ_EVERY = 32


class PolyampCallback(transformers.TrainerCallback):
    """A ``transformers.TrainerCallback`` adding a polyamp scaler's numbers to the Trainer's training logs.

    Each training log (every ``logging_steps``) gets, when optimizer steps ended since the previous one:

    * ``loss_scale``: the scale the latest step's loss was multiplied by (left out when not scaling, e.g. the
      bfloat16 guard);
    * ``skipped_steps``: how many steps the scaler skipped so far;
    * ``skipped_steps/<reason>``: how many of them for each reason seen (``overflow``, ``non_finite``,
      ``loss_spike``, ``grad_spike``; the skipped steps' details are ``scaler.records()`` and the ``"polyamp"``
      logger's lines).

    It also makes the Trainer's learning-rate schedule hold back on skipped steps of fused optimizers (the
    Trainer's default), which Accelerate reports as taken (see `on_optimizer_step`).

    The numbers go into the ``logs`` dict the Trainer hands its callbacks, so reporters called after this
    callback (TensorBoard, W&B, the console) show them, and into ``trainer.state.log_history``. `prepare_trainer`
    installs the scaler and puts this callback first, before the reporters; added through ``Trainer(callbacks=
    [...])`` it comes after the reporters ``report_to`` names, which then miss the numbers.

    Reading the records is one host read per log (and one every 32 optimizer steps between logs).

    Args:
        scaler: The `polyamp.LossScaler` the Trainer steps with (``trainer.accelerator.scaler`` after
            `prepare_trainer`).

    Raises:
        PolyampTypeError: ``scaler`` is not a `polyamp.LossScaler`.
    """

    def __init__(self, scaler: LossScaler) -> None:
        #: What the scaler's records add up to so far.
        self.tally = RecordTally(scaler)
        self._steps = 0
        self._pending: dict[str, float] = {}  # read between logs, not logged yet

    @property
    def scaler(self) -> LossScaler:
        """The scaler whose records are logged."""
        return self.tally.scaler

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        """Tell the Trainer whether the step was skipped, also for fused optimizers.

        The Trainer advances its learning-rate schedule unless ``accelerator.optimizer_step_was_skipped``, which
        Accelerate answers by whether ``optimizer.step`` was called. A fused optimizer (the Trainer's default
        ``adamw_torch_fused``) is called on every step and skips on the device, so Accelerate reports its skips
        as steps, with torch's GradScaler as with polyamp's. This callback runs between the step and that check
        and sets the prepared optimizer's answer to the scaler's (``scaler.was_skipped``; one host read for a
        fused optimizer, none otherwise).

        Args:
            args, state, control: The Trainer's, as every callback gets them.
            optimizer: The Trainer's optimizer (Accelerate's ``AcceleratedOptimizer``).
            **kwargs: The Trainer's other callback arguments (unused).
        """
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or not hasattr(optimizer, "_is_overflow"):
            return
        skipped = self.scaler.was_skipped(inner)
        if skipped is not None:
            optimizer._is_overflow = skipped  # what AcceleratedOptimizer.step_was_skipped reports

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Count the step; every 32 steps, take in the records so far (nothing is logged here).

        Args:
            args, state, control: The Trainer's, as every callback gets them.
            **kwargs: The Trainer's other callback arguments (unused).
        """
        self._steps += 1
        if self._steps % READ_EVERY == 0:
            self._pending.update(self.tally.read())

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Add the scaler's numbers to ``logs`` and to the entry the Trainer just appended to ``log_history``.

        Args:
            args, state, control: The Trainer's, as every callback gets them.
            logs: The logs being written.
            **kwargs: The Trainer's other callback arguments (unused).
        """
        values = {**self._pending, **self.tally.read()}
        self._pending = {}
        if not values or logs is None:
            return
        logs.update(values)
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == getattr(state, "global_step", None):
            history[-1].update(values)


def prepare_trainer(
    trainer: Any,
    scaler: LossScaler | None = None,
    *,
    guard: bool | None = None,
    spike: Any = None,
) -> LossScaler:
    """Train a ``transformers.Trainer`` with polyamp's loss scaler, and log its numbers.

    Call it after creating the Trainer and before ``trainer.train()``:

        args = TrainingArguments(..., bf16=True)   # or fp16=True on a GPU
        trainer = Trainer(model=model, args=args, train_dataset=data)
        scaler = polyamp_torch.transformers.prepare_trainer(trainer)
        trainer.train()

    It installs the scaler in the Trainer's Accelerator (`polyamp_torch.accelerate.prepare_accelerator`: under
    ``fp16`` it scales with the settings of the GradScaler it replaces; under ``bf16`` or float32 it guards,
    skipping steps with inf/NaN gradients, which the Trainer's learning-rate schedule then does not count, as it
    reads ``accelerator.optimizer_step_was_skipped``) and puts a `PolyampCallback` first among the Trainer's
    callbacks. Checkpoints keep the scaler's state (the Trainer's ``scaler.pt``), and ``resume_from_checkpoint``
    restores it.

    Args:
        trainer: A ``transformers.Trainer`` that has not started training.
        scaler: The `polyamp.LossScaler` to use; None (default) creates one (see `prepare_accelerator`), with
            ``guard`` and ``spike``.
        guard: For the scaler created here: whether steps that are not scaled still skip on inf/NaN gradients.
            None (default) means True.
        spike: For the scaler created here: a `polyamp.SpikeRule` that also skips outlier steps.

    Returns:
        The installed scaler, for its records and skip counts.

    Raises:
        PolyampTypeError: ``trainer`` is not a ``transformers.Trainer``, or the scaler arguments are wrong (see
            `prepare_accelerator`).
        ScalerUsageError / PolyampValueError: as `prepare_accelerator` (training already prepared the
            optimizer; a setup it does not support).
    """
    if not isinstance(trainer, transformers.Trainer):
        raise PolyampTypeError(
            f"prepare_trainer takes a transformers.Trainer. Received: {describe(trainer)}. For a loop written "
            "with Accelerate, use polyamp_torch.accelerate.prepare_accelerator(accelerator)."
        )
    installed = prepare_accelerator(trainer.accelerator, scaler, guard=guard, spike=spike)
    callbacks = trainer.callback_handler.callbacks
    callbacks[:] = [c for c in callbacks if not isinstance(c, PolyampCallback)]
    callbacks.insert(0, PolyampCallback(installed))
    return installed
