"""The variables of a `polyamp_keras._device.KerasDevice`: their creation (standalone or an optimizer's), how
they are written, and the scaler's state read from and written to them.

The base the device's parts build on: it declares the attributes ``KerasDevice.__init__`` sets.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from polyamp import LossScaleConfig, LossScaleState, ScalerUsageError, SpikeRule
from polyamp_keras._gradients import is_sparse
from polyamp_keras._keras import keras
from polyamp_keras._rule import ScaleState, counter_dtype
from polyamp_keras._spikes import SpikeWindow

__all__ = ["AddVariable", "DeviceVariables"]

ops = keras.ops

#: Keras's ``Optimizer.add_variable(shape=, dtype=, initializer=, aggregation=, name=)``.
AddVariable = Callable[..., Any]


def _tensorflow() -> Any:
    """TensorFlow when it is Keras's backend, else None."""
    return sys.modules.get("tensorflow") if keras.backend.backend() == "tensorflow" else None


def _standalone_variable(*, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> Any:
    return keras.Variable(initializer(shape, dtype), dtype=dtype, trainable=False, name=name, aggregation=aggregation)


class _Slot:
    """A holder the core keeps (a history ring, a spike window), filled when the variables exist."""

    __slots__ = ("pending", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.pending: Any = None  # what to write once the variables exist (a spike window loaded early)


class DeviceVariables:
    """The device's variables and state (the attributes are set by ``KerasDevice.__init__``)."""

    _config: LossScaleConfig
    _host_state: LossScaleState
    _owned: bool
    _add_variable: AddVariable
    _assign: Callable[[Any, Any], Any] | None
    _assign_add: Callable[[Any, Any], Any] | None
    _branch: bool
    _scale_variables: Callable[[], tuple[Any, Any]] | None
    _variables: ScaleState | None
    _traced: bool
    _history: _Slot
    _windows: list[tuple[_Slot, SpikeRule]]
    _record: Any
    _finite: Any
    _made: tuple[weakref.ref[Any], weakref.ref[Any]] | None
    _provenance: dict[tuple[int, ...], tuple[list[Any], list[str], Any]]

    if TYPE_CHECKING:  # the parts that make the records' and the spike rule's variables

        def _build_history(self) -> None: ...

        def _provenance_slot(self, variables: Sequence[Any]) -> tuple[list[Any], list[str], Any]: ...

        def _build_window(self, slot: _Slot, rule: SpikeRule) -> None: ...

    # -- variables ---------------------------------------------------------------------------------------

    def _make_standalone(self, *, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> Any:
        """A variable of a standalone device (`polyamp_tensorflow` makes its own outside function graphs)."""
        return _standalone_variable(
            shape=shape, dtype=dtype, initializer=initializer, aggregation=aggregation, name=name
        )

    def _variable(self, name: str, dtype: str, value: Any, shape: Any = ()) -> Any:
        return self._add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            aggregation="none",
            name=name,
        )

    def _write(self, variable: Any, value: Any) -> None:
        if self._assign is not None:
            self._assign(variable, value)
        elif is_sparse(value):  # TensorFlow's IndexedSlices: a scatter, as Keras's optimizers write them
            (variable.value if isinstance(variable, keras.Variable) else variable).scatter_update(value)
        else:
            variable.assign(value)

    def _add(self, variable: Any, value: Any) -> None:
        """``variable += value``, through the optimizer's ``assign_add`` when it has one: on TensorFlow that is
        one ``AssignAddVariableOp`` on the backing variable, where a Keras variable's own ``assign_add`` reads,
        adds and assigns."""
        if self._assign_add is not None:
            self._assign_add(variable, value)
        else:
            variable.assign_add(value)

    @property
    def built(self) -> bool:
        """Whether the variables exist."""
        return self._variables is not None

    def build(self, variables: Sequence[Any] = ()) -> None:
        """Make the variables (an owned device: called from the optimizer's ``build``): the scale state, the
        record ring, spike windows and, for ``variables`` (the optimizer's), the skipped step's counts."""
        if self._variables is not None:
            return
        state = self._host_state
        if self._scale_variables is not None:
            scale, tracker = self._scale_variables()
            tf = _tensorflow()
            # Written now, once: Keras on TensorFlow builds an optimizer while it traces the first step, and an
            # assignment inside that trace would belong to a graph that need not be the one that runs.
            with tf.init_scope() if tf is not None else contextlib.nullcontext():
                self._write(scale, state.scale)
                self._write(tracker, ops.cast(state.growth_tracker, tracker.dtype))
        else:
            scale = self._variable("loss_scale", "float32", state.scale)
            tracker = self._variable("growth_tracker", "int32", state.growth_tracker)
        self._variables = ScaleState(
            scale,
            tracker,
            self._variable("hysteresis_left", "int32", state.hysteresis_left),
            self._variable("skipped_steps", counter_dtype(), 0),
        )
        if self._owned:
            self._record = self._add_variable(
                shape=(), dtype="bool", initializer=keras.initializers.Zeros(), aggregation="none", name="last_skipped"
            )
        self._build_history()
        if self._owned:
            self._provenance_slot(list(variables))
        for slot, rule in self._windows:
            self._build_window(slot, rule)

    def _state(self) -> ScaleState:
        if self._compiling_now():
            self._traced = True  # the settings are becoming constants of a graph
        if self._variables is None:
            if self._owned:
                raise ScalerUsageError(
                    "The loss scaler's variables belong to an optimizer that is not built yet: build it "
                    "(optimizer.build(model.trainable_variables)) before the first step."
                )
            self.build()
        assert self._variables is not None
        return self._variables

    def scale_value(self) -> Any:
        """The scale: its variable, or before an owned device is built the state's value."""
        if self._variables is None and self._owned:
            return ops.convert_to_tensor(self._host_state.scale, dtype="float32")
        return self._state().scale

    @property
    def record_variable(self) -> Any:
        """An owned device's variable holding whether the last step was skipped (None before `build`)."""
        return self._record

    def provenance_variable(self) -> Any:
        """An owned device's counts of the last skipped step's non-finite gradients, with that step's index in
        their last row (`provenance_rows`; None before `build`)."""
        if not self._provenance:
            return None
        return next(iter(self._provenance.values()))[2]

    def history_variables(self) -> tuple[Any, Any] | None:
        """The record ring's variables (codes, count), or None before they exist / without records."""
        return self._history.value  # type: ignore[no-any-return]

    def spike_window(self) -> SpikeWindow | None:
        """The spike rule's window (None without a rule or before it exists)."""
        return self._windows[0][0].value if self._windows else None

    @property
    def scale_state(self) -> ScaleState | None:
        """The scale's variables (None before they exist)."""
        return self._variables

    # -- state -------------------------------------------------------------------------------------------

    def read_state(self) -> LossScaleState:
        return self._host_state if self._variables is None else self._variables.read()

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        if self._traced and config != self._config:
            raise self.traced_settings_error(self._config, config)
        self._config = config
        if state is None:
            return
        self._host_state = state
        if self._variables is not None:
            self._variables.write(state)

    def traced_settings_error(self, old: LossScaleConfig, new: LossScaleConfig) -> ScalerUsageError:
        """The error for new settings once a compiled step traced the old ones as constants."""
        return ScalerUsageError(
            f"The loss-scaling settings would change ({old} -> {new}), but a compiled step (tf.function, jax.jit, "
            "model.fit) has already traced a step with this scaler: the settings are constants there, which would "
            "go on using the old ones. Change settings before the first compiled step, or make a new scaler (the "
            "scale and counters can be loaded at any time)."
        )

    @property
    def traced(self) -> bool:
        """Whether a compiled step traced the settings as constants."""
        return self._traced

    def note_traced(self) -> None:
        """A compiled step (``jax.jit``) is tracing the settings as constants."""
        self._traced = True

    def float16_in_use(self, *, since_last_iteration: bool = False, loss: Any = None) -> bool:
        """Whether Keras's own global dtype policy computes in float16 (e.g. set with
        ``keras.mixed_precision.set_global_policy("mixed_float16")``)."""
        return str(keras.config.dtype_policy().compute_dtype) == "float16"

    def _compiling_now(self) -> bool:
        tf = _tensorflow()
        return tf is not None and not tf.executing_eagerly()
