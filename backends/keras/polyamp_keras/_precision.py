"""`PrecisionOptimizer`: a Keras 3 optimizer that keeps the training state a policy plans (a float32 master
copy, the optimizer state's dtype, the rounding of each write), on every Keras backend.

How the update is formed in float32 without a float32 copy of the model: the inner optimizer is built over
*keys*, float32 Keras variables with the shapes of the model's variables that hold no memory (Keras's own
deferred variables, created in a ``StatelessScope``), so its slots are float32 keys too. For each variable, the
inner optimizer's ``update_step`` runs once in a ``StatelessScope`` mapping the keys to float32 working copies
(the weight or its master copy, the gradient, the stored slots): only one variable's float32 copies exist at a
time. The stored state, in the plan's dtypes, is this optimizer's own variables. The writes follow
`polyamp.backend_api.training_state.write_update` operation for operation.
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Keras's deferred variables wait in global_state until the next StatelessScope exit initializes them.
from keras.src.backend.common import global_state
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.utils.tracking import no_automatic_dependency_tracking

import polyamp
from polyamp import InvalidConfigError, Policy, PolyampTypeError, TrainingStateWarning
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import PolicyLike
from polyamp.backend_api.training_state import (
    KAHAN_KEY,
    MASTER_KEY,
    is_state_slot,
    unplanned_hazard_message,
)
from polyamp_keras._keras import keras, overwritten_by_gradient
from polyamp_keras._precision_checkpoint import CheckpointMethods
from polyamp_keras._precision_layout import _LOW, _dtype, _Entry, _inner_name, _Layout

__all__ = ["PrecisionOptimizer"]

ops = keras.ops
#: The sign, exponent and top 7 mantissa bits of a float32, as an int32: what a bfloat16 keeps.
_BFLOAT16_BITS = -65536  # 0xFFFF0000
_logger = logging.getLogger("polyamp")


@contextmanager
def _memoryless() -> Iterator[None]:
    """Variables created inside hold no memory: Keras's deferred variables, taken off the list that the next
    ``StatelessScope`` exit would initialize them from."""
    before = {id(v) for v in global_state.get_global_attribute("uninitialized_variables") or []}
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        pending = global_state.get_global_attribute("uninitialized_variables") or []
        global_state.set_global_attribute("uninitialized_variables", [v for v in pending if id(v) in before])


def _computes_on_values(inner: Any) -> None:
    """Let ``inner`` run on the values of a ``StatelessScope`` on every backend: TensorFlow's optimizers key
    their variables and write them through the ``tf.Variable`` under each Keras variable (for tf.distribute),
    which the keys here do not have; Keras's backend-agnostic base methods act on the Keras variables."""
    if keras.backend.backend() != "tensorflow":
        return
    for name in ("_var_key", "assign", "assign_add", "assign_sub"):
        setattr(inner, name, types.MethodType(getattr(BaseOptimizer, name), inner))


@keras.saving.register_keras_serializable(package="polyamp", name="PrecisionOptimizer")
class PrecisionOptimizer(CheckpointMethods, keras.optimizers.Optimizer):  # type: ignore[misc]
    """A Keras 3 optimizer that follows a policy's training-state plan: a float32 master copy, the dtype of
    the optimizer state, and how each update is written into bfloat16/float16 weights (to nearest,
    stochastically, or with Kahan compensation), on every Keras backend (TensorFlow, JAX, PyTorch).

    It wraps any Keras optimizer whose per-variable state is made with ``add_variable_from_reference``
    (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, Nadam, Lion, ...). For each variable the inner optimizer's
    update runs on float32 working copies of the weight (or its master copy), the gradient and the slots, one
    variable at a time, so memory does not double; the slots are stored back in the plan's ``state_dtype``
    (rounded to nearest) and the weight is written with the plan's rounding, bit for bit as
    `polyamp.backend_api.training_state.write_update`. Variables in float32 (e.g. layers kept in float32) are updated
    exactly, with no master copy or compensation. With float32 variables only and float32 state, the inner optimizer
    runs as it is (the same results as without this wrapper).

    The model's variables are in the policy's parameter dtype: build the model under the policy
    (``polyamp.policy_scope("bfloat16_kahan")`` or ``polyamp.set_policy``; Keras's ``"bfloat16"`` dtype
    policy gives the same variables).

    Loss scaling and the bfloat16 guard go outside: ``polyamp_keras.LossScaleOptimizer(PrecisionOptimizer(
    keras.optimizers.AdamW()), enabled=None)`` skips a non-finite step and leaves every variable of this
    optimizer (slots, master copies, compensation buffers, the inner ``iterations`` and the random state)
    bitwise unchanged. Works in ``model.fit`` and custom loops: ``apply`` (TensorFlow, PyTorch, eagerly or in
    ``tf.function``) and ``stateless_apply`` (JAX, also under ``jax.jit``; any backend).

    Its variables (``optimizer.variables``) are saved with the model: per variable the slots, then the master
    copies, then the compensation buffers, each in its own dtype, a random-number state (stochastic
    rounding draws from it; it is saved so a resumed run draws the same numbers) and the inner optimizer's
    ``iterations`` and learning rate. Loading weights saved under another plan (``model.load_weights``,
    ``load_own_variables``, ``set_weights``) converts them with one note through
    ``logging.getLogger("polyamp")``: slots cast to the plan's state dtype, master copies initialised from the
    weights (load the model's layers first, as Keras does) or dropped, compensation buffers started at zero or
    dropped.

    Args:
        inner_optimizer: The Keras optimizer that computes the update (not built yet, without
            ``gradient_accumulation_steps`` or ``use_ema``).
        policy: The plan: a `polyamp.Policy` or a policy name/spec (e.g. ``"bfloat16_kahan"``). Default: the
            policy in effect when the optimizer is made (``polyamp.get_policy()``).
        seed: Seed of the random stream of stochastic rounding (an int in [0, 2**31)).
        name: The optimizer's name.

    Raises:
        PolyampTypeError: ``inner_optimizer`` is not a Keras optimizer, or is a loss-scale or precision
            optimizer.
        InvalidConfigError: the inner optimizer is built or accumulates gradients / keeps an EMA, or ``seed``
            is not an int in range.
        InvalidPolicyError: ``policy`` is not a valid policy.

    Examples:
        >>> import keras, polyamp, polyamp_keras
        >>> optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.AdamW(1e-3), "bfloat16_kahan")
        >>> optimizer.policy.rounding
        'kahan'
    """

    #: Tells polyamp's hazard check that this optimizer follows a training-state plan of its own.
    _polyamp_plans_training_state = True

    def __init__(
        self, inner_optimizer: Any, policy: PolicyLike | None = None, *, seed: int = 0, name: str | None = None
    ) -> None:
        _check_inner(inner_optimizer)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise InvalidConfigError(
                f"`seed` must be an int in [0, 2**31) (the seed of stochastic rounding's random stream). "
                f"Received: {describe(seed)}."
            )
        plan = polyamp.get_policy() if policy is None else Policy(policy)
        super().__init__(learning_rate=0.0, name=name)
        # The iterations and learning rate are the inner optimizer's: this one's own would be dead weights.
        self._untrack_variable(self._iterations)
        self._untrack_variable(self._learning_rate)
        self.inner_optimizer = inner_optimizer
        self._policy = plan
        self._seed = seed
        with keras.name_scope(self.name, caller=self):
            self._seeds = keras.random.SeedGenerator(seed, name="rounding_seed")
        self._track_variable(self._seeds.state)
        self._layout = _Layout([], pass_through=True)
        self._hazard_said = False

    # -- what it is ----------------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The `polyamp.Policy` whose training-state plan this optimizer follows."""
        return self._policy

    @property
    def seed(self) -> int:
        """The seed of stochastic rounding's random stream."""
        return self._seed

    @property
    def iterations(self) -> Any:
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self) -> list[Any]:
        """This optimizer's state, all of it saved with the model: the random state, the slots (in the
        plan's ``state_dtype``), the float32 master copies, the compensation buffers, then the inner
        optimizer's own variables (its ``iterations`` and learning rate)."""
        return [*self._variables, *self.inner_optimizer.variables]

    @property
    def slot_variables(self) -> list[Any]:
        """The optimizer state kept per parameter (moments and the like), in the plan's ``state_dtype``."""
        if self._layout.pass_through:
            inner = self.inner_optimizer
            scalars = {id(inner._iterations), id(inner._learning_rate)}
            return [v for v in inner.variables if id(v) not in scalars]
        return list(self._layout.slots())

    @property
    def master_variables(self) -> list[Any]:
        """The float32 master copies (one per bfloat16/float16 variable when the plan keeps a master)."""
        return self._layout.masters()

    @property
    def compensation_variables(self) -> list[Any]:
        """The Kahan compensation buffers (one per bfloat16/float16 variable under ``rounding="kahan"``)."""
        return self._layout.compensations()

    # -- building --------------------------------------------------------------------------------------------

    @no_automatic_dependency_tracking  # type: ignore[untyped-decorator]
    def build(self, var_list: Sequence[Any]) -> None:
        if self.built:  # as Keras's optimizers: a LossScaleOptimizer around this one builds it again
            return
        variables = list(var_list)
        plan = self._policy
        dtypes = [_dtype(v) for v in variables]
        for variable, dtype in zip(variables, dtypes, strict=True):
            if dtype not in ("float32", *_LOW):
                raise InvalidConfigError(
                    f"PrecisionOptimizer updates float32, bfloat16 and float16 variables; {variable.path!r} is "
                    f"{dtype}. Keep it out of the optimizer's variables, or create it in one of those dtypes."
                )
            if overwritten_by_gradient(variable) and dtype != "float32":
                raise InvalidConfigError(
                    f"PrecisionOptimizer writes the gradient over a variable marked overwrite_with_gradient (FP8 "
                    f"scales and histories, cast counts) when it is float32; {variable.path!r} is {dtype}. "
                    "Create it in float32, as Keras's float8 layers do."
                )
            if dtype == "float16" and plan.rounding == "stochastic" and not plan.keeps_master:
                raise InvalidConfigError(
                    f"Stochastic rounding is defined for bfloat16 weights; {variable.path!r} is float16. Use "
                    "rounding=kahan for float16 weights (e.g. policy 'params=float16,rounding=kahan')."
                )
        super().build(variables)
        inner = self.inner_optimizer
        if all(d == "float32" for d in dtypes) and plan.state_dtype == "float32":
            with keras.name_scope(inner.name, caller=inner):
                inner.build(variables)
            self._layout = _Layout([], pass_through=True)
        else:
            self._layout = self._build_on_keys(variables)
        self._warn_if_unplanned(dtypes)

    def _build_on_keys(self, variables: list[Any]) -> _Layout:
        inner = self.inner_optimizer
        plan = self._policy
        excluded = getattr(inner, "_exclude_from_weight_decay", None) or set()
        excluded_at = {i for i, v in enumerate(variables) if inner._var_key(v) in excluded}
        _computes_on_values(inner)
        with _memoryless():
            keys = [
                keras.Variable(
                    initializer="zeros",
                    shape=v.shape,
                    dtype="float32",
                    trainable=False,
                    name=str(v.path).replace("/", "_"),
                )
                for v in variables
            ]
        entries = [_Entry(v, key) for v, key in zip(variables, keys, strict=True)]
        by_key = {id(entry.key): entry for entry in entries}
        made = inner.add_variable_from_reference
        unattributed: list[Any] = []

        def recording(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
            slot = made(reference_variable, *args, **kwargs)
            entry = by_key.get(id(reference_variable))
            if entry is None:
                unattributed.append(slot)
            else:
                entry.slot_keys.append(slot)
            return slot

        before = {id(v) for v in inner.variables}
        inner.add_variable_from_reference = recording
        try:
            with _memoryless(), keras.name_scope(inner.name, caller=inner):
                inner.build(keys)
        finally:
            del inner.add_variable_from_reference
        attributed = {id(slot) for entry in entries for slot in entry.slot_keys}
        unattributed += [v for v in inner.variables if id(v) not in before and id(v) not in attributed]
        if unattributed:
            raise InvalidConfigError(
                f"PrecisionOptimizer cannot tell which parameter the state variables "
                f"{[str(v.name) for v in unattributed]} of {_inner_name(inner)} belong to (they were not made "
                "with add_variable_from_reference). It wraps optimizers whose per-parameter state is, such as "
                "SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, Nadam and Lion."
            )
        for slot in [v for v in inner.variables if id(v) not in before]:
            inner._untrack_variable(slot)  # keys: the stored slots are this optimizer's own
        if excluded_at:
            inner._exclude_from_weight_decay = {inner._var_key(entries[i].key) for i in excluded_at}
            inner._exclude_from_weight_decay_cache = {}
        for entry in entries:
            for slot_key in entry.slot_keys:
                floating = is_state_slot(
                    floating=keras.backend.is_float_dtype(slot_key.dtype),
                    ndim=len(slot_key.shape),
                    param_ndim=len(entry.variable.shape),
                )
                entry.slots.append(
                    self.add_variable(
                        shape=slot_key.shape,
                        dtype=plan.state_dtype if floating else slot_key.dtype,
                        name=str(slot_key.name),
                    )
                )
        low = [entry for entry in entries if entry.dtype in _LOW]
        prefix = {id(entry): str(entry.variable.path).replace("/", "_") for entry in entries}
        if plan.keeps_master:
            for entry in low:
                entry.master = self.add_variable(
                    shape=entry.variable.shape,
                    initializer=_initial_master(entry.variable),
                    dtype=plan.master_dtype,
                    name=f"{prefix[id(entry)]}_{MASTER_KEY}",
                )
        elif plan.rounding == "kahan":
            for entry in low:
                entry.compensation = self.add_variable(
                    shape=entry.variable.shape, dtype=entry.dtype, name=f"{prefix[id(entry)]}_{KAHAN_KEY}"
                )
        return _Layout(entries, pass_through=False)

    def _warn_if_unplanned(self, dtypes: list[str]) -> None:
        if self._hazard_said:
            return
        message = unplanned_hazard_message(
            f"PrecisionOptimizer({_inner_name(self.inner_optimizer)})", dtypes, self._policy
        )
        if message is not None:
            self._hazard_said = True
            warnings.warn(TrainingStateWarning(message), stacklevel=4)

    # -- applying ------------------------------------------------------------------------------------------

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        if len(grads) == 0:
            return
        variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        _refuse_several_replicas()
        if self._layout.pass_through:
            self.inner_optimizer.apply(grads, variables)
            return
        self._check_variables_are_known(variables)
        indices = [self._get_variable_index(v) for v in variables]
        torch = sys.modules.get("torch") if keras.backend.backend() == "torch" else None
        with torch.no_grad() if torch is not None else _nothing():
            state = {id(v): v.value for v in self.variables}
            weights = [v.value for v in variables]
            new_weights, new_state = self._step(state, grads, weights, indices)
            for variable, old, new in zip(variables, weights, new_weights, strict=True):
                if new is not old:
                    variable.assign(new)
            for variable in self.variables:
                if new_state[id(variable)] is not state[id(variable)]:
                    variable.assign(new_state[id(variable)])

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """The stateless step (what ``model.fit`` uses on JAX): variable values in, new values out.

        Args:
            optimizer_variables: Values of `variables`, in order.
            grads: One gradient per trainable variable (None: that variable is left as it is).
            trainable_variables: Values of the trainable variables the optimizer was built with.

        Returns:
            ``(new trainable values, new optimizer values)``.
        """
        if not self.built:
            raise InvalidConfigError(
                "To call `stateless_apply`, PrecisionOptimizer must be built (its variables created). Build it "
                "with `optimizer.build(trainable_variables)`."
            )
        values = [v.value if isinstance(v, keras.Variable) else v for v in optimizer_variables]
        weights = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        grads = list(grads)
        mine = self.variables
        if len(values) != len(mine) or len(weights) != len(self._trainable_variables) or len(grads) != len(weights):
            raise InvalidConfigError(
                f"PrecisionOptimizer.stateless_apply takes one value per optimizer variable ({len(mine)}), and one "
                f"value and one gradient per trainable variable ({len(self._trainable_variables)}). Received "
                f"{len(values)} optimizer values, {len(weights)} trainable values and {len(grads)} gradients."
            )
        if self._layout.pass_through:
            own = len(self._variables)
            new_weights, new_inner = self.inner_optimizer.stateless_apply(values[own:], grads, weights)
            return list(new_weights), values[:own] + list(new_inner)
        state = {id(v): value for v, value in zip(mine, values, strict=True)}
        new_weights, new_state = self._step(state, grads, weights, list(range(len(weights))))
        return new_weights, [new_state[id(v)] for v in mine]

    def _step(
        self, state: dict[int, Any], grads: list[Any], weights: list[Any], indices: list[int]
    ) -> tuple[list[Any], dict[int, Any]]:
        """One step over values: the new weights and the new values of `variables` (by id)."""
        inner = self.inner_optimizer
        plan = self._policy
        counter = inner._iterations
        common = [(counter, state[id(counter)])]
        if isinstance(inner._learning_rate, keras.Variable):
            common.append((inner._learning_rate, state[id(inner._learning_rate)]))
        # A variable marked overwrite_with_gradient (FP8 scales and histories, cast counts) takes its gradient
        # as its new value, unclipped and unscaled, as Keras's optimizers write it; the rest are stepped.
        overwritten = [overwritten_by_gradient(self._layout.entries[index].variable) for index in indices]
        new_weights = list(weights)
        for position, g in enumerate(grads):
            if overwritten[position] and g is not None:
                new_weights[position] = ops.cast(g, self._layout.entries[indices[position]].dtype)
        grads = [None if skip else g for g, skip in zip(grads, overwritten, strict=True)]
        grads32: list[Any] = [None if g is None else ops.cast(g, "float32") for g in grads]
        if inner.clipnorm or inner.clipvalue or inner.global_clipnorm:
            present = [g for g in grads32 if g is not None]
            clipped = iter(inner._clip_gradients(present))
            grads32 = [None if g is None else next(clipped) for g in grads32]
        if inner.loss_scale_factor is not None:
            grads32 = [None if g is None else g / inner.loss_scale_factor for g in grads32]
        new_state = dict(state)
        seed_variable = self._seeds.state
        seed = state[id(seed_variable)]
        for position, (index, g32) in enumerate(zip(indices, grads32, strict=True)):
            if g32 is None:
                continue
            entry = self._layout.entries[index]
            weight = weights[position]
            w32 = ops.cast(weight if entry.master is None else state[id(entry.master)], "float32")
            mapping = [(entry.key, w32), *common]
            mapping += [
                (k, ops.cast(state[id(s)], "float32")) for k, s in zip(entry.slot_keys, entry.slots, strict=True)
            ]
            with keras.StatelessScope(state_mapping=mapping, initialize_variables=False) as scope:
                learning_rate = inner.learning_rate
                BaseOptimizer._apply_weight_decay(inner, [entry.key])
                inner.update_step(g32, entry.key, learning_rate)
                target = scope.get_current_value(entry.key)
                slots = [scope.get_current_value(k) for k in entry.slot_keys]
            for slot, value in zip(entry.slots, slots, strict=True):
                new_state[id(slot)] = ops.cast(value, slot.dtype)
            constraint = entry.variable.constraint
            if constraint is not None:
                target = constraint(target)
            if entry.master is not None:
                new_state[id(entry.master)] = target
                new_weights[position] = ops.cast(target, entry.dtype)
            elif entry.dtype == "float32" or plan.rounding == "nearest":
                new_weights[position] = ops.cast(target, entry.dtype)
            elif plan.rounding == "stochastic":
                with keras.StatelessScope(state_mapping=[(seed_variable, seed)], initialize_variables=False) as draw:
                    random16 = keras.random.randint(tuple(entry.key.shape), 0, 65536, dtype="int32", seed=self._seeds)
                    seed = draw.get_current_value(seed_variable)
                bits = ops.bitwise_and(ops.add(ops.view(target, "int32"), random16), _BFLOAT16_BITS)
                new_weights[position] = ops.cast(ops.view(bits, "float32"), entry.dtype)
            else:  # kahan: write_update's operations, each one float32 operation
                delta = ops.subtract(target, w32)
                y = ops.add(ops.cast(state[id(entry.compensation)], "float32"), delta)
                written = ops.cast(ops.add(w32, y), entry.dtype)
                lost = ops.subtract(y, ops.subtract(ops.cast(written, "float32"), w32))
                new_weights[position] = written
                new_state[id(entry.compensation)] = ops.cast(lost, entry.dtype)
        new_state[id(counter)] = ops.add(state[id(counter)], ops.cast(1, counter.dtype))
        new_state[id(seed_variable)] = seed
        return new_weights, new_state

    # -- saving and loading --------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "policy": self._policy.name,
            "seed": self._seed,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> PrecisionOptimizer:
        """The optimizer a `get_config` dict describes (what ``keras.models.load_model`` calls).

        Raises:
            PolyampTypeError: ``config`` is not a dict, or lacks ``inner_optimizer``.
        """
        if not isinstance(config, dict) or "inner_optimizer" not in config:
            raise PolyampTypeError(
                "PrecisionOptimizer.from_config() takes the dict get_config() returned (with 'inner_optimizer'). "
                f"Received: {describe(config)}."
            )
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def _initial_master(variable: Any) -> Callable[..., Any]:
    if keras.backend.backend() == "tensorflow":
        # Keras may build the optimizer while tracing the first train step; TensorFlow lifts the variables out
        # of that function, which it cannot do (under XLA) for an initial value read from another variable
        # inside it. The weights are read outside the trace instead; inside a trace the value is handed over as
        # a host array, since TensorFlow captures a large eager tensor as a function input, which it cannot
        # lift either (only small ones become constants).
        tf = sys.modules["tensorflow"]  # imported: it is Keras's backend

        inside = tf.inside_function()
        with tf.init_scope():
            value = tf.cast(variable.value, tf.float32)
            if inside:
                value = value.numpy()
        return lambda shape, dtype=None: value

    def initializer(shape: Any, dtype: Any = None) -> Any:
        return ops.cast(variable.value, "float32")

    return initializer


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _check_inner(inner: Any) -> None:
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise PolyampTypeError(
            f"`inner_optimizer` must be a Keras 3 optimizer such as keras.optimizers.AdamW(). Received: "
            f"{describe(inner)}."
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise PolyampTypeError(
            "`inner_optimizer` is a LossScaleOptimizer; put the loss scaling outside: "
            "polyamp_keras.LossScaleOptimizer(PrecisionOptimizer(keras.optimizers.AdamW())). Received: "
            f"{describe(inner)}."
        )
    if isinstance(inner, PrecisionOptimizer):
        raise PolyampTypeError("`inner_optimizer` is already a PrecisionOptimizer; pass its inner optimizer.")
    if inner.built:
        raise InvalidConfigError(
            f"`inner_optimizer` ({_inner_name(inner)}) is already built over a model's variables; "
            "PrecisionOptimizer builds it itself. Pass a new optimizer."
        )
    for setting, value in (
        ("gradient_accumulation_steps", inner.gradient_accumulation_steps),
        ("use_ema", inner.use_ema),
    ):
        if value:
            raise InvalidConfigError(
                f"PrecisionOptimizer does not support the inner optimizer's `{setting}`. Received: "
                f"{setting}={describe(value)}. Create the inner optimizer without it."
            )


def _refuse_several_replicas() -> None:
    tf = sys.modules.get("tensorflow")
    if tf is None or keras.backend.backend() != "tensorflow":
        return
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        raise InvalidConfigError(
            "PrecisionOptimizer does not sum gradients across the replicas of a tf.distribute strategy: "
            "train on one replica, or reduce the gradients before apply()."
        )
