"""`watch_forward` for Keras: which layer first produced an inf or NaN in a forward pass, on every Keras backend.

For the duration of the watch, the ``call`` of the model and of every layer in it (recursively, nested
models included) is wrapped by an instance attribute; ``remove()`` (or leaving the ``with``) deletes the
attributes again, so each layer's ``call`` is its class's method as before. A call of the model is one
forward pass; in a watched one each floating tensor a layer's ``call`` receives or returns is checked with
``keras.ops.isfinite`` and ``keras.ops.all`` (a tensor already checked is not checked again), the checks
are read with one conversion to NumPy when the model's call returns, and only when one of them is
non-finite are the outputs counted and handed to ``polyamp.backend_api.forward_watch.forward_report``.

Eager calls only: a model call traced by ``tf.function`` or ``jax.jit`` (``model.fit``, ``predict`` and
``evaluate`` compile by default) cannot be read inside the trace; such a call is not watched, is counted
in ``watch.traced``, and the first one logs a WARNING saying so. ``model.compile(run_eagerly=True)``, or
calling ``model(x)`` directly, gives eager calls (the PyTorch backend is eager unless ``jit_compile=True``).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from keras.src.utils import backend_utils, jax_utils

from polyamp import ForwardReport, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.forward_watch import LOGGER_NAME, ForwardPass, ForwardWatchBase
from polyamp_keras._gradients import non_finite_counts
from polyamp_keras._keras import keras

__all__ = ["ForwardWatch", "watch_forward"]

_logger = logging.getLogger(LOGGER_NAME)
ops = keras.ops


def _float_tensors(value: Any) -> Iterator[Any]:
    """The floating, non-empty tensors in a nested structure (flattened only when iterated)."""
    for leaf in keras.tree.flatten(value):
        if ops.is_tensor(leaf) and keras.backend.is_float_dtype(leaf.dtype) and all(leaf.shape):
            yield leaf


def _traced(tensors: list[Any]) -> bool:
    """Whether these tensors belong to a trace (tf.function, jax.jit, torch.compile) rather than an eager call."""
    name = keras.backend.backend()
    if name == "tensorflow":
        return bool(backend_utils.in_tf_graph())
    if name == "jax":
        return any(jax_utils.is_in_jax_tracing_scope(t) for t in tensors)
    if name == "torch":
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            return True
        return any(t.device.type == "meta" for t in tensors)
    return False


def _dtype(tensor: Any) -> str:
    return str(keras.backend.standardize_dtype(tensor.dtype))


def _layers_with_paths(model: Any) -> list[tuple[Any, str]]:
    """The model and every layer in it, once each, with its ``layer.path`` (for a layer Keras has not given
    one, as it has no weights: its parent's path, ``/``, its name)."""
    found: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def visit(layer: Any, path: str) -> None:
        seen.add(id(layer))
        found.append((layer, layer.path or path))
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) not in seen and not isinstance(child, keras.layers.InputLayer):
                visit(child, f"{layer.path or path}/{child.name}")

    visit(model, model.name)
    return found


def _check(tensor: Any) -> Any:
    """A tensor's finiteness check: a boolean scalar on the backend's device (no host read)."""
    return ops.all(ops.isfinite(tensor))


class ForwardWatch(ForwardWatchBase):
    """A forward watch on a Keras model (see `watch_forward`): in place until `remove` or the ``with`` exits."""

    def __init__(self, model: Any, every: int = 1) -> None:
        if not isinstance(model, keras.layers.Layer):
            raise PolyampTypeError(
                f"polyamp_keras.watch_forward expects a Keras model or layer; received {describe(model)}. Pass the "
                "model whose forward passes to watch (for a torch.nn.Module use polyamp_torch.watch_forward)."
            )
        super().__init__(model, every)
        self._traced = 0
        self._wrapped: list[tuple[Any, Any, Any]] = []  # (layer, its previous instance `call` or None, wrapper)
        for layer, path in _layers_with_paths(model):
            self._wrap(layer, path, root=layer is model)

    _check = staticmethod(_check)

    def _read(self, forward: ForwardPass) -> ForwardReport | None:
        """The pass's report: the checks read with one conversion to NumPy (two only when one is non-finite)."""
        if not forward.checks:
            return None
        flags = ops.stack(forward.checks)
        if bool(ops.convert_to_numpy(ops.all(flags))):  # the one read of the fast path
            return None
        return forward.report(
            [bool(f) for f in ops.convert_to_numpy(flags).tolist()],
            size=lambda t: int(ops.size(t)),
            dtype=_dtype,
            counts=lambda t: ops.convert_to_numpy(non_finite_counts(t)).tolist(),
        )

    def _wrap(self, layer: Any, path: str, root: bool) -> None:
        previous = layer.__dict__.get("call")
        call = layer.call

        @functools.wraps(call)
        def watched_call(*args: Any, **kwargs: Any) -> Any:
            forward = self._enter_call(layer, path, root, _float_tensors((args, kwargs)))
            output = None
            try:
                output = call(*args, **kwargs)
            finally:
                self._exit_call(layer, root, forward, _float_tensors(output))
            return output

        object.__setattr__(layer, "call", watched_call)  # an instance attribute, outside Keras's tracking
        self._wrapped.append((layer, previous, watched_call))

    def _counts(self, key: Any, inputs: Sequence[Any]) -> bool:
        if not _traced(list(inputs)):
            return True
        self._traced += 1
        if self._traced == 1:
            _logger.warning(
                "polyamp_keras.watch_forward: a call of %r is being traced (tf.function, jax.jit or "
                "torch.compile), where values cannot be read; traced calls are not watched. Call the "
                "model eagerly, or compile it with run_eagerly=True, to watch it.",
                key.name,
            )
        return False

    @property
    def traced(self) -> int:
        """How many calls of the model ran inside a trace (tf.function, jax.jit) and so were not watched."""
        return self._traced

    def _installed(self) -> bool:
        return bool(self._wrapped)

    def _uninstall(self) -> None:
        for layer, previous, wrapper in reversed(self._wrapped):
            if layer.__dict__.get("call") is not wrapper:
                continue  # replaced by someone else since: theirs stays
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)
        self._wrapped = []

    def _model_label(self) -> str:
        return repr(self.model.name)


def watch_forward(model: Any, *, every: int = 1) -> ForwardWatch:
    """Watch a Keras model's eager forward passes for the layer that first produces an inf or NaN.

    The Keras counterpart of ``polyamp_torch.watch_forward``, with the same records: after each watched
    pass, ``watch.report()`` is None when every layer output was finite, else a ``polyamp.ForwardReport``
    naming the producer (the first layer whose inputs were all finite and whose output was not, by
    ``layer.path``), the layers that only propagated the value and each output's counts; it is also logged as
    a WARNING through ``logging.getLogger("polyamp")``. ``every=N`` watches one eager call in N.

    Inputs are checked as a layer's ``call`` receives them, after Keras has cast them to the layer's compute
    dtype: a float32 value beyond float16's range turns inf in that cast, and the consuming layer is then the
    first propagating call. Traced calls (``tf.function``, ``jax.jit``) are not watched (see ``traced``).

    >>> import keras, polyamp_keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    >>> with polyamp_keras.watch_forward(model) as watch:
    ...     _ = model(keras.ops.ones((1, 2)))
    >>> watch.report() is None
    True
    """
    return ForwardWatch(model, every=every)
