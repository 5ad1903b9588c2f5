"""A loss scaler's step records in a PyTorch loop: as TensorBoard scalars (`RecordWriter`), and as a summary line
every N steps (`log_summary`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyamp import LossScaler, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.records import RunSummary, log_every

__all__ = ["RecordWriter", "log_summary"]


class RecordWriter:
    """Writes a `polyamp.LossScaler`'s step records (`polyamp.StepRecord`) to a TensorBoard writer.

    Each `write` reads the scaler's records (one host read, see ``LossScaler.records``) and writes the
    iterations not written yet, at ``global_step`` = the record's iteration:

    * ``<prefix>/loss_scale``: the scale the iteration's loss was multiplied by (when scaling);
    * ``<prefix>/skipped``: 1 for a skipped step, else 0;
    * ``<prefix>/skipped_steps``: how many steps were skipped so far (as written);
    * a text entry ``<prefix>/skip`` per skipped step: its log line (reason, scale, the non-finite gradients).

    ``writer`` is anything with ``add_scalar(tag, value, global_step)`` and ``add_text(tag, text,
    global_step)``, such as ``torch.utils.tensorboard.SummaryWriter``:

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


def log_summary(
    scaler: LossScaler,
    step: int,
    *,
    every: int = 100,
    progress: Any = None,
    write: Callable[[str], object] | None = None,
) -> RunSummary | None:
    """Show the scaler's run summary (`polyamp.LossScaler.summary`) every ``every`` steps; call it once per
    iteration, after ``scaler.update()``. The other iterations it returns at once: no host read, no device work.

    Args:
        scaler: The `polyamp.LossScaler` (or ``TorchLossScaler``) of the loop.
        step: The index of the iteration that just ended, from 0 (``for step, batch in enumerate(loader)``), a
            Python int. The summary is shown after iterations ``every - 1``, ``2 * every - 1``, ...
        every: How many iterations between two summaries.
        progress: A tqdm bar: the summary's short form (``"5 skipped, scale 2^13"``) becomes its postfix, and
            nothing is printed unless ``write`` is given.
        write: Where the line goes (``logger.info``, ``tqdm.write``); default: ``print``, unless ``progress``
            is given.

    Returns:
        The `RunSummary` on the iterations it is shown, else None.

    Raises:
        PolyampTypeError / PolyampValueError: ``scaler`` is not a polyamp scaler, ``step`` or ``every`` is not a
            count, or ``progress`` has no ``set_postfix_str``.

    Example:
        ```python
        for step, (x, y) in enumerate(loader):
            ...
            scaler.step(optimizer)
            scaler.update()
            polyamp_torch.log_summary(scaler, step, every=100)  # polyamp: 100 steps, none skipped, scale 2^16
        ```
    """
    if not isinstance(scaler, LossScaler):
        raise PolyampTypeError(f"log_summary needs the polyamp.LossScaler in use. Received: {describe(scaler)}.")
    return log_every(scaler.summary, step, every, progress, write)
