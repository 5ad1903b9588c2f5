"""`LossScaleCallback`: the loss scale (while scaling) and skipped steps in Keras training logs."""

from __future__ import annotations

from typing import Any

from polyamp import PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp_keras._keras import keras
from polyamp_keras._optimizer import LossScaleOptimizer
from polyamp_keras._rule import read_scalar

__all__ = ["LossScaleCallback"]


class LossScaleCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Adds what the optimizer's mode makes worth watching to the logs of every batch and epoch, and reads the
    optimizer's step records (`polyamp_keras.LossScaleOptimizer.records`) as training goes, so each skipped step is
    logged through ``logging.getLogger("polyamp")`` with its reason and a collapsing scale is reported.

    * While the optimizer scales the loss (``"mixed_float16"``): ``loss_scale`` and ``skipped_steps``.
    * While it guards without scaling (bfloat16 policies): ``skipped_steps`` alone; the scale is 1.0 there
      and says nothing.
    * While it neither scales nor guards (``enabled=False, guard=False``): nothing, as no step can be skipped.

    The values appear in ``History.history``, the progress bar and ``keras.callbacks.TensorBoard`` (list
    this callback before TensorBoard, which reads the logs when it gets them). The model must be compiled
    with a `polyamp_keras.LossScaleOptimizer`; ``optimizer.summary()`` gives the whole run in one line.

    Example:
        ```python
        history = model.fit(x, y, epochs=3, callbacks=[polyamp_keras.LossScaleCallback()])
        history.history["loss_scale"], history.history["skipped_steps"]
        print(model.optimizer.summary())  # e.g. "6 steps, none skipped, scale 2^16"
        ```
    """

    def _optimizer(self) -> LossScaleOptimizer:
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, LossScaleOptimizer):
            raise PolyampTypeError(
                "LossScaleCallback needs a model compiled with polyamp_keras.LossScaleOptimizer. "
                f"The model's optimizer is {describe(optimizer)}."
            )
        return optimizer

    def _add(self, logs: dict[str, Any] | None) -> None:
        if logs is None:
            return
        optimizer = self._optimizer()
        if optimizer.enabled:
            logs["loss_scale"] = optimizer.get_scale()
        elif not optimizer.scaler.guarding:
            return  # neither scaled nor checked: no step can be skipped, no scale to watch
        logs["skipped_steps"] = int(read_scalar(optimizer.skipped_steps))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._add(logs)
        optimizer = self._optimizer()
        if optimizer.built and (batch + 1) % max(1, optimizer.scaler.history // 2) == 0:
            optimizer.records()  # read often enough that the ring never overwrites an unread step

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._add(logs)
        if self._optimizer().built:
            self._optimizer().records()  # logs this epoch's skipped steps (logging.getLogger("polyamp"))
