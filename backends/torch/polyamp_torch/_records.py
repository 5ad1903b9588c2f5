"""`RecordWriter`: a loss scaler's step records as TensorBoard scalars, for PyTorch loops."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError
from polyamp.backend_api.arguments import describe

__all__ = ["RecordWriter"]


class RecordWriter:
    """Writes a `polyamp.LossScaler`'s step records (`polyamp.StepRecord`) to a TensorBoard writer.

    Each `write` reads the scaler's records (one host read, see ``LossScaler.records``) and writes the
    iterations not written yet, at ``global_step`` = the record's iteration:

    * ``<prefix>/loss_scale``: the scale the iteration's loss was multiplied by (when scaling);
    * ``<prefix>/skipped``: 1 for a skipped step, else 0;
    * ``<prefix>/skipped_steps``: how many steps were skipped so far (as written);
    * a text entry ``<prefix>/skip`` per skipped step: its log line (reason, scale, the non-finite gradients).

    ``writer`` is anything with ``add_scalar(tag, value, global_step)`` and ``add_text(tag, text,
    global_step)``, such as ``torch.utils.tensorboard.SummaryWriter``::

        board = polyamp_torch.RecordWriter(scaler, SummaryWriter("runs/amp"))
        for step, (x, y) in enumerate(loader):
            ...
            if step % 100 == 0:
                board.write()
    """

    def __init__(self, scaler: LossScaler, writer: Any, *, prefix: str = "polyamp") -> None:
        if not isinstance(scaler, LossScaler):
            raise PolyampTypeError(f"RecordWriter needs the polyamp.LossScaler in use. Received: {describe(scaler)}.")
        if not (callable(getattr(writer, "add_scalar", None)) and callable(getattr(writer, "add_text", None))):
            raise PolyampTypeError(
                "RecordWriter writes through add_scalar/add_text, such as torch.utils.tensorboard.SummaryWriter's. "
                f"Received: {describe(writer)}."
            )
        self.scaler = scaler
        self.writer = writer
        self.prefix = prefix
        self._next = 0  # the first iteration not written yet
        self._skipped = 0

    def write(self) -> int:
        """Write the records of the iterations since the last call; return how many were written."""
        written = 0
        for record in self.scaler.records():
            if record.iteration < self._next:
                continue
            step = record.iteration
            if record.scale is not None:
                self.writer.add_scalar(f"{self.prefix}/loss_scale", record.scale, step)
            self.writer.add_scalar(f"{self.prefix}/skipped", int(record.skipped), step)
            if record.skipped:
                self._skipped += 1
                self.writer.add_text(f"{self.prefix}/skip", record.message(), step)
            self.writer.add_scalar(f"{self.prefix}/skipped_steps", self._skipped, step)
            self._next = step + 1
            written += 1
        return written
