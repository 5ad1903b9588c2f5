"""Import Keras 3 once, turning its absence into advice on what to install. Imports no Keras backend itself."""

from __future__ import annotations

from polyamp import BackendNotInstalledError
from polyamp.backend_api.versions import import_framework, warn_if_untested

_HINT = "Install it with: pip install 'polyamp[keras]' (or 'polyamp[tensorflow]' for Keras on TensorFlow)"

keras = import_framework("keras", "polyamp_keras", "Keras 3", _HINT)

if int(keras.__version__.partition(".")[0]) < 3:
    raise BackendNotInstalledError(f"polyamp_keras needs Keras 3; found keras {keras.__version__}. {_HINT}")

warn_if_untested("polyamp_keras", {"keras": keras.__version__})

__all__ = ["keras", "overwritten_by_gradient"]


def overwritten_by_gradient(variable: object) -> bool:
    """Whether Keras's optimizers write ``variable``'s gradient over it instead of stepping it (FP8 scales and
    amax histories, polyamp's cast counts): Keras's ``overwrite_with_gradient``."""
    return bool(getattr(variable, "overwrite_with_gradient", False))
