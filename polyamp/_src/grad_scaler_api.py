"""``torch.amp.GradScaler``'s spellings of a scaler's settings, for code written against GradScaler.

Each getter reads the scaler's validated `polyamp.LossScaleConfig`; each setter changes one setting through
the scaler's own `_change_setting` (validated, the records so far replayed under the old rule first).
"""

from __future__ import annotations

from typing import Any

from polyamp._src.scaling import LossScaleConfig

__all__ = ["GradScalerSpelling"]


class GradScalerSpelling:
    """``is_enabled`` and ``get_/set_`` growth factor, backoff factor and growth interval (torch's names)."""

    _config: LossScaleConfig

    @property
    def enabled(self) -> bool:
        raise NotImplementedError

    def _change_setting(self, name: str, value: Any) -> None:
        raise NotImplementedError

    def is_enabled(self) -> bool:
        """Same as `enabled` (torch's spelling)."""
        return self.enabled

    def get_growth_factor(self) -> float:
        """The growth factor (torch's spelling)."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Change the growth factor (validated; torch's spelling)."""
        self._change_setting("growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor (torch's spelling)."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Change the backoff factor (validated; torch's spelling)."""
        self._change_setting("backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (torch's spelling)."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Change the growth interval (validated; torch's spelling)."""
        self._change_setting("growth_interval", new_interval)
