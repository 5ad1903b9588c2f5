"""Import TensorFlow and Keras 3 once, turning their absence into advice on what to install."""

from __future__ import annotations

from polyamp import BackendNotInstalledError
from polyamp.backend_api.versions import import_framework, warn_if_untested

_HINT = "Install it with: pip install 'polyamp[tensorflow]'"

tf = import_framework("tensorflow", "polyamp_tensorflow", "TensorFlow", _HINT)
keras = import_framework("keras", "polyamp_tensorflow", "Keras 3", _HINT)

if int(keras.__version__.partition(".")[0]) < 3:
    raise BackendNotInstalledError(
        f"polyamp_tensorflow needs Keras 3 (TensorFlow >= 2.16); found keras {keras.__version__}. {_HINT}"
    )

# Keras's own version is polyamp_keras's to check (polyamp_tensorflow imports it).
warn_if_untested("polyamp_tensorflow", {"tensorflow": tf.__version__})


def _leave_polyamp_to_python() -> None:
    # polyamp's code is graph-safe by construction (no Python branch on a tensor value), like Keras and
    # TensorFlow's own, which autograph also leaves unconverted. Converting it would only cost time and
    # warnings (e.g. when a scaler binds, and so imports its backend, inside tf.function).
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # pragma: no cover - a TensorFlow without it converts polyamp harmlessly
        return
    names = ("polyamp", "polyamp_tensorflow", "polyamp_keras", "importlib")
    present = {getattr(rule, "_prefix", None) for rule in config.CONVERSION_RULES}
    new_rules = tuple(config.DoNotConvert(name) for name in names if name not in present)
    config.CONVERSION_RULES = new_rules + tuple(config.CONVERSION_RULES)


_leave_polyamp_to_python()

__all__ = ["keras", "tf"]
