"""`PolyampPrecision`: polyamp's policy regions and loss scaler as a Lightning precision plugin.

Importing this module imports Lightning (``lightning.pytorch``); without it installed it raises
``polyamp.BackendNotInstalledError`` (an ``ImportError``) saying ``pip install lightning``.
``import polyamp_torch`` never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from polyamp import InvalidPolicyError, LossScaler, Policy, PolyampTypeError, SpikeRule
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import PolicyLike
from polyamp.backend_api.versions import import_framework
from polyamp_torch._autocast import autocast
from polyamp_torch._framework import torch
from polyamp_torch._integration import RecordTally, check_scaler_arguments
from polyamp_torch._scaler import TorchLossScaler

import_framework(
    "lightning.pytorch",
    "polyamp_torch.lightning",
    "Lightning",
    "Install it with: pip install lightning (or pip install 'polyamp[lightning]').",
)
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

__all__ = ["PolyampPrecision"]

#: Lightning's name for the precision of each compute dtype polyamp's mixed policies use.
_LIGHTNING_PRECISION = {"float16": "16-mixed", "bfloat16": "bf16-mixed"}


def _mixed_policy(policy: PolicyLike) -> Policy:
    resolved = Policy(policy)  # InvalidPolicyError / PolyampTypeError, naming the valid policies
    if resolved.compute_dtype not in _LIGHTNING_PRECISION or resolved.param_dtype != "float32":
        raise InvalidPolicyError(
            f"PolyampPrecision takes a mixed precision policy: float16 or bfloat16 compute with float32 parameters "
            f"(such as 'mixed_float16' or 'mixed_bfloat16'). Received {resolved.name!r}: compute "
            f"{resolved.compute_dtype}, parameters {resolved.param_dtype}. For float32 training use Lightning's "
            "default precision; for low-precision parameters use polyamp_torch.apply_policy on the model."
        )
    return resolved


class PolyampPrecision(MixedPrecision):
    """A Lightning precision plugin computing under a polyamp policy, with polyamp's loss scaler.

    ``Trainer(plugins=[PolyampPrecision("mixed_float16")])`` in place of ``Trainer(precision="16-mixed")``
    (or ``"mixed_bfloat16"`` for ``"bf16-mixed"``):

    * the training, validation, test and predict steps run in a `polyamp_torch.autocast` region of the
      policy (on CPU with CUDA's float32 op list, see ``cpu_float32_ops``);
    * the losses go through polyamp's scaler (`polyamp_torch.TorchLossScaler`, a drop-in for
      ``torch.amp.GradScaler``): scaled under float16, and under bfloat16 not scaled but guarded: a step whose
      gradients hold inf or NaN is skipped (Lightning refuses a scaler under ``"bf16-mixed"`` and would apply
      it); a `polyamp.SpikeRule` also skips outlier steps;
    * after each optimizer step it logs through ``LightningModule.log`` (to the trainer's loggers, at their
      ``log_every_n_steps``) ``loss_scale`` (while scaling), ``skipped_steps``, and
      ``skipped_steps/<reason>`` per skip reason seen (see `polyamp_torch.RecordWriter` for the reasons).
      This reads the scaler's records once per optimizer step (one host read); ``log=False`` turns it off;
    * checkpoints keep the scaler's state (``state_dict``/``load_state_dict``), and a checkpoint of
      Lightning's own ``"16-mixed"`` resumes with its GradScaler's scale.

    It is a ``lightning.pytorch.plugins.precision.MixedPrecision``, so Lightning's own code treats it as
    mixed precision (``trainer.precision`` is ``"16-mixed"`` or ``"bf16-mixed"``); gradient clipping
    (``Trainer(gradient_clip_val=...)``) clips unscaled gradients, and fused optimizers (which unscale in
    their step) work as with Lightning's plugin. With ``cpu_float32_ops=False`` on CPU and the same scaler
    settings, training under ``"mixed_float16"`` is bit for bit Lightning's ``"16-mixed"``.

    Args:
        policy: ``"mixed_float16"``, ``"mixed_bfloat16"`` or a `polyamp.Policy` computing in float16 or
            bfloat16 with float32 parameters.
        scaler: The `polyamp.LossScaler` to use. None (default) creates ``TorchLossScaler(device)``, scaling,
            under a float16 policy, and ``TorchLossScaler(enabled=False, guard=True)`` (guarding, not
            scaling) under bfloat16; ``guard`` and ``spike`` go to it.
        guard: For the scaler this plugin creates: whether steps that are not scaled (bfloat16) still skip on
            inf/NaN gradients. None (default) means True.
        spike: For the scaler this plugin creates: a `polyamp.SpikeRule` that also skips outlier steps.
        device: The device type the regions autocast ("cuda", "cpu", ...). None (default) covers the
            machine's accelerator and the CPU, as ``polyamp_torch.autocast()`` does.
        cpu_float32_ops: On CPU, run CUDA's float32 op list (softmax, norms, reductions) in float32 (default);
            False gives torch's CPU autocast lists, as Lightning's plugin uses.
        cache_enabled: ``torch.autocast``'s weight-cast cache; False (default) as in Lightning's plugin.
        log: Log the scaler's numbers after each optimizer step (default True).

    Raises:
        InvalidPolicyError: ``policy`` is not a mixed float16/bfloat16 policy with float32 parameters.
        PolyampTypeError: ``scaler`` is not a `polyamp.LossScaler` for torch, ``guard``/``spike`` are given
            with a ``scaler`` (set them on the scaler), or another argument has the wrong type.
    """

    def __init__(
        self,
        policy: PolicyLike = "mixed_float16",
        *,
        scaler: LossScaler | None = None,
        guard: bool | None = None,
        spike: SpikeRule | None = None,
        device: str | torch.device | None = None,
        cpu_float32_ops: bool = True,
        cache_enabled: bool = False,
        log: bool = True,
    ) -> None:
        resolved = _mixed_policy(policy)
        for name, value in (("cpu_float32_ops", cpu_float32_ops), ("cache_enabled", cache_enabled), ("log", log)):
            if not isinstance(value, bool):
                raise PolyampTypeError(f"PolyampPrecision's `{name}` must be a bool. Received: {describe(value)}.")
        device_type = device.type if isinstance(device, torch.device) else device
        if device_type is not None and not isinstance(device_type, str):
            raise PolyampTypeError(
                "PolyampPrecision's `device` takes None (the accelerator and the CPU), a device type such as "
                f"'cuda' or 'cpu', or a torch.device. Received: {describe(device)}."
            )
        check_scaler_arguments("PolyampPrecision", scaler, guard, spike)
        if scaler is None:
            float16 = resolved.compute_dtype == "float16"
            scaler = TorchLossScaler(
                device_type,
                enabled=float16,
                guard=True if guard is None else guard,
                spike=spike,
            )
        # MixedPrecision's constructor creates a torch GradScaler under "16-mixed" and refuses any scaler under
        # "bf16-mixed"; its attributes are set here instead (the same three it sets).
        #: Lightning's name for this precision: "16-mixed" or "bf16-mixed".
        self.precision = _LIGHTNING_PRECISION[resolved.compute_dtype]  # type: ignore[assignment]
        #: The device type the regions autocast, or None (the accelerator and the CPU).
        self.device = device_type  # type: ignore[assignment]
        #: The polyamp.LossScaler the steps go through.
        self.scaler: LossScaler = scaler  # type: ignore[assignment]
        #: The polyamp.Policy the steps compute under.
        self.policy = resolved
        self.cpu_float32_ops = cpu_float32_ops
        self.cache_enabled = cache_enabled
        self.log_records = log
        self._tally = RecordTally(scaler)

    def autocast_context_manager(self) -> Any:
        """The region the steps run in: `polyamp_torch.autocast` of this plugin's policy.

        Returns:
            A `polyamp_torch.PolicyRegion` (a context manager).
        """
        return autocast(
            self.policy,
            device_type=self.device,
            cache_enabled=self.cache_enabled,
            cpu_float32_ops=self.cpu_float32_ops,
        )

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Run the enclosed forward pass under this plugin's policy (see `autocast_context_manager`)."""
        with self.autocast_context_manager():
            yield

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward and backward), unscale, let Lightning clip, then step through the scaler
        (skipped on inf/NaN gradients) and update it; then log the scaler's numbers (see the class).

        Args:
            optimizer: The optimizer to step.
            model: The LightningModule being trained.
            closure: Lightning's closure running the training step and backward.
            **kwargs: Passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, None for a skipped step, or the closure's result when
            Lightning skipped the backward (the training step returned None).
        """
        result = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if self.log_records and isinstance(model, pl.LightningModule):
            for name, value in self._tally.read().items():
                model.log(name, value, on_step=True, on_epoch=False, logger=True, batch_size=1)
        return result

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state dict (`polyamp.LossScaler.state_dict`), which Lightning saves in checkpoints.

        Returns:
            A dict with ``torch.amp.GradScaler``'s keys and polyamp's settings.
        """
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler from a checkpoint's state (this plugin's, or a torch GradScaler's).

        Args:
            state_dict: What `state_dict` returned, or ``torch.amp.GradScaler.state_dict()``.

        Raises:
            StateDictError: the dict is malformed (see `polyamp.LossScaler.load_state_dict`).
        """
        self.scaler.load_state_dict(state_dict)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume the scale of a checkpoint saved with Lightning's own ``"16-mixed"`` plugin.

        Lightning restores this plugin from the checkpoint's ``"PolyampPrecision"`` entry itself; a checkpoint
        without one but with Lightning's ``"MixedPrecision"`` entry (its GradScaler's state) loads that.

        Args:
            checkpoint: The checkpoint being loaded.
        """
        if type(self).__qualname__ not in checkpoint and MixedPrecision.__qualname__ in checkpoint:
            native = checkpoint[MixedPrecision.__qualname__]
            if native:
                self.scaler.load_state_dict(native)

    def __repr__(self) -> str:
        return f"PolyampPrecision(policy={self.policy.name!r}, scaler={self.scaler!r})"
