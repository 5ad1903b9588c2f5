"""Saved compiles that hold polyamp's `LossScaleOptimizer` come back for models with their own ``compile``.

Keras saves a model's compile arguments (``get_compile_config``) and, when loading, calls
``compile_from_config``, which compiles the new model with them. For a model whose class overrides
``compile`` (every keras_hub task: ``CausalLM``, ``TextClassifier``, ...), Keras's ``compile_from_config``
only warns and compiles nothing. keras_hub tasks compile themselves with defaults when built, so such a
model loads with a plain ``Adam`` (wrapped in Keras's own loss-scale optimizer under ``"mixed_float16"``),
and the optimizer variables saved from polyamp's optimizer (its scale and counters among them) are loaded
into that one, or dropped.

So, once per process, polyamp wraps Keras's ``compile_from_config`` (``keras.Model.compile_from_config``,
defined on Keras's ``Trainer``): when the saved compile holds polyamp's optimizer (or a registered subclass
of it) and the model's own ``compile`` accepts the saved arguments, the model is compiled with them, its
optimizer built, as Keras does for models without their own ``compile``; Keras then loads the optimizer's
variables into it. Every other model and compile goes through Keras's code unchanged. A keras_hub
``CausalLM``'s sampler is not among Keras's compile arguments, so it comes back as ``compile``'s default
(``"top_k"``), as it does with Keras alone.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from polyamp_keras._keras import keras
from polyamp_keras._optimizer import LossScaleOptimizer

__all__ = ["restore_polyamp_compiles"]

_MARK = "__polyamp_restores_compile__"


def _holds_polyamp_optimizer(config: Any) -> bool:
    """Whether a saved compile config's optimizer is polyamp's `LossScaleOptimizer` (or a subclass)."""
    optimizer = config.get("optimizer") if isinstance(config, Mapping) else None
    if not isinstance(optimizer, Mapping):
        return False
    name = optimizer.get("registered_name")
    cls = keras.saving.get_registered_object(name) if isinstance(name, str) else None
    return isinstance(cls, type) and issubclass(cls, LossScaleOptimizer)


def _accepts(compile_method: Callable[..., Any], config: Mapping[str, Any]) -> bool:
    try:
        inspect.signature(compile_method).bind(**config)
    except (TypeError, ValueError):
        return False
    return True


def _owner(name: str) -> type | None:
    """The class in ``keras.Model``'s MRO that defines ``name``."""
    return next((cls for cls in keras.Model.__mro__ if name in vars(cls)), None)


def restore_polyamp_compiles() -> None:
    """Make models with their own ``compile`` (keras_hub tasks) load a saved compile holding polyamp's
    `LossScaleOptimizer` (idempotent; see the module's docstring)."""
    trainer = _owner("compile_from_config")
    if trainer is None or _owner("compile") is not trainer:
        return  # a Keras laid out differently: keep its behaviour
    original = vars(trainer)["compile_from_config"]
    if getattr(original, _MARK, False):
        return
    keras_compile = vars(trainer)["compile"]

    @functools.wraps(original)
    def compile_from_config(self: Any, config: Any) -> Any:
        own_compile = type(self).compile is not keras_compile
        if own_compile and _holds_polyamp_optimizer(config):
            arguments = keras.saving.deserialize_keras_object(config)
            if isinstance(arguments, Mapping) and _accepts(self.compile, arguments):
                self.compile(**arguments)
                if getattr(self, "optimizer", None) is not None and self.built:
                    self.optimizer.build(self.trainable_variables)  # Keras then loads its variables
                return None
        return original(self, config)

    setattr(compile_from_config, _MARK, True)
    trainer.compile_from_config = compile_from_config  # type: ignore[attr-defined]
