"""polyamp.LossScaler bound to TensorFlow: custom GradientTape loops, eager and in tf.function."""

from __future__ import annotations

import functools
import gc
import math
import os
import re
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_tensorflow  # noqa: E402
from polyamp import BackendMismatchError, PolyampTypeError, ScalerUsageError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def mixed_float16() -> Iterator[None]:
    polyamp.set_policy("mixed_float16")
    yield
    polyamp.set_policy("float32")


def drive(scaler: Any, pattern: str, *, function: bool = False) -> tuple[list[tuple[float, int, int]], Any]:
    w = tf.Variable([1.0, 2.0, 3.0])
    optimizer = keras.optimizers.SGD(0.01)

    def step(bad: Any) -> None:
        with tf.GradientTape() as tape:
            # A tiny loss, so that even a 2**126 scale overflows only where the pattern says so.
            scaled = scaler.scale(tf.reduce_sum(w * w) * 1e-30 * bad)
        grads = tape.gradient(scaled, [w])
        scaler.apply_gradients(optimizer, zip(grads, [w]))

    run = tf.function(step) if function else step
    states = []
    for char in pattern:
        run(tf.constant(math.inf if char == "O" else 1.0))
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states, optimizer


CONFIGS = {
    "default": dict(growth_interval=3),
    "hysteresis": dict(growth_interval=3, hysteresis=2),
    "bounds": dict(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=16.0, max_scale=128.0),
    "odd_factors": dict(init_scale=1000.0, growth_factor=1.37, backoff_factor=0.61, growth_interval=2),
    "static": dict(init_scale=256.0, dynamic=False),
    "growth_guard": dict(init_scale=2.0**126, growth_interval=1),
}
PATTERN = "FFFOFFOOOFFFFFOOOOFFFF"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("function", [False, True], ids=["eager", "tf_function"])
def test_state_machine_follows_the_reference(name: str, function: bool) -> None:
    scaler = polyamp.LossScaler(**CONFIGS[name])
    states, _ = drive(scaler, PATTERN, function=function)
    assert scaler.backend == "tensorflow"
    assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in scaler.config.states(PATTERN)]


@settings(max_examples=15, deadline=None)
@given(
    growth_interval=st.integers(1, 3),
    hysteresis=st.integers(1, 3),
    growth_factor=st.floats(1.01, 4.0),
    backoff_factor=st.floats(0.05, 0.95),
    pattern=st.text(alphabet="FO", min_size=1, max_size=12),
)
def test_state_machine_matches_the_reference_on_random_configs(
    growth_interval: int, hysteresis: int, growth_factor: float, backoff_factor: float, pattern: str
) -> None:
    scaler = polyamp.LossScaler(
        init_scale=1000.0,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        enabled=True,
    )
    states, _ = drive(scaler, pattern)
    assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in scaler.config.states(pattern)]


def test_first_use_inside_tf_function_creates_state_safely() -> None:
    scaler = polyamp.LossScaler(growth_interval=2)
    w = tf.Variable([1.0])
    optimizer = keras.optimizers.SGD(0.5)

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w))
        scaler.apply_gradients(optimizer, zip(tape.gradient(scaled, [w]), [w]))

    for _ in range(3):
        step()
    assert scaler.get_scale() == 131072.0
    assert w.numpy()[0] == -0.5
    assert int(scaler.skipped_steps()) == 0 and not bool(scaler.step_skipped(optimizer))


def test_skipped_step_changes_no_variable_slot_or_iteration() -> None:
    scaler = polyamp.LossScaler()
    w = tf.Variable([1.0, 2.0])
    optimizer = keras.optimizers.Adam(0.1)
    scaler.apply_gradients(optimizer, [(scaler.scale(tf.constant([1.0, 1.0])), w)])
    before = [keras.ops.convert_to_numpy(v) for v in [w, *optimizer.variables]]
    scaler.scale(tf.constant(1.0))  # every iteration that scales starts from a scaled loss
    scaler.apply_gradients(optimizer, [(tf.constant([math.nan, 1.0]), w)])
    after = [keras.ops.convert_to_numpy(v) for v in [w, *optimizer.variables]]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert bool(scaler.step_skipped()) and int(optimizer.iterations.numpy()) == 1


def test_skipped_steps_is_a_snapshot_that_later_skips_leave_alone() -> None:
    scaler = polyamp.LossScaler(growth_interval=10)
    w = tf.Variable([1.0, 2.0])
    optimizer = keras.optimizers.SGD(0.1)

    def step(bad: Any) -> Any:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w) * bad)
        scaler.apply_gradients(optimizer, zip(tape.gradient(scaled, [w]), [w]))
        return scaler.skipped_steps()

    compiled = tf.function(step)
    kept = [step(tf.constant(math.inf)), compiled(tf.constant(math.inf)), step(tf.constant(1.0))]
    counts = [scaler.skipped_steps(), tf.function(scaler.skipped_steps)()]
    step(tf.constant(math.inf))
    # Each value is the count when it was read: a tensor, not the counter's variable, so a later skip leaves it.
    assert all(tf.is_tensor(value) and not isinstance(value, tf.Variable) for value in kept + counts)
    assert [int(value) for value in kept] == [1, 2, 2]
    assert [int(value) for value in counts] == [2, 2]
    assert int(scaler.skipped_steps()) == 3


def test_unscale_clip_apply_moves_by_the_clipped_true_gradient() -> None:
    """torch's unscale_ -> clip -> step pattern, in TensorFlow: clipping makes new tensors."""
    scaler = polyamp.LossScaler()
    w = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(1.0)
    with tf.GradientTape() as tape:
        scaled = scaler.scale(tf.reduce_sum(w * tf.constant([3.0, 4.0])))
    grads = scaler.unscale(tape.gradient(scaled, [w]))
    assert np.array_equal(grads[0].numpy(), [3.0, 4.0])
    clipped, _ = tf.clip_by_global_norm(grads, 1.0)
    scaler.apply_gradients(optimizer, zip(clipped, [w]))
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6)
    # The stage is consumed: the next step unscales by itself again.
    with tf.GradientTape() as tape:
        scaled = scaler.scale(tf.reduce_sum(w * tf.constant([1.0, 1.0])))
    scaler.apply_gradients(optimizer, zip(tape.gradient(scaled, [w]), [w]))
    np.testing.assert_allclose(w.numpy(), [-1.6, -1.8], rtol=1e-6)


def test_passing_the_scaled_gradients_after_unscale_is_refused() -> None:
    scaler = polyamp.LossScaler()
    w = tf.Variable([1.0])
    optimizer = keras.optimizers.SGD(1.0)
    with tf.GradientTape() as tape:
        scaled = scaler.scale(tf.reduce_sum(w))
    grads = tape.gradient(scaled, [w])
    scaler.unscale(grads)
    with pytest.raises(ScalerUsageError, match="received the scaled gradients"):
        scaler.apply_gradients(optimizer, zip(grads, [w]))
    assert w.numpy()[0] == 1.0


def test_mixed_unscaled_and_scaled_gradients_are_refused() -> None:
    scaler = polyamp.LossScaler()
    a, b = tf.Variable([1.0]), tf.Variable([1.0])
    optimizer = keras.optimizers.SGD(1.0)
    with tf.GradientTape() as tape:
        scaled = scaler.scale(tf.reduce_sum(a * b))
    ga, gb = tape.gradient(scaled, [a, b])
    (ga,) = scaler.unscale([ga])
    with pytest.raises(ScalerUsageError, match="mix of gradients"):
        scaler.apply_gradients(optimizer, zip([ga, gb], [a, b]))


def test_scale_promotes_low_precision_losses_to_float32() -> None:
    scaler = polyamp_tensorflow.TensorFlowLossScaler()
    scaled = scaler.scale(tf.constant(2.0, dtype=tf.float16))
    assert scaled.dtype == tf.float32 and scaled.numpy() == 131072.0
    assert [t.numpy() for t in scaler.scale([tf.constant(1.0), tf.constant(0.5)])] == [65536.0, 32768.0]


def test_bfloat16_policy_scaler_is_disabled_and_just_applies() -> None:
    polyamp.set_policy("mixed_bfloat16")
    scaler = polyamp.LossScaler()
    loss = tf.constant(1.5)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    w = tf.Variable([1.0])
    optimizer = keras.optimizers.SGD(1.0)
    scaler.apply_gradients(optimizer, [(tf.constant([0.25]), w)])
    assert w.numpy()[0] == 0.75 and not bool(scaler.step_skipped(optimizer))


def test_state_dict_after_use_and_load() -> None:
    scaler = polyamp.LossScaler(growth_interval=2, hysteresis=2)
    drive(scaler, "FFFO")
    state = scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["hysteresis_left"]) == (131072.0, 0, 1)
    other = polyamp_tensorflow.TensorFlowLossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    drive(other, "O")
    assert other.get_scale() == 65536.0


def test_torch_tensors_are_refused_by_a_tensorflow_bound_scaler() -> None:
    torch = pytest.importorskip("torch")
    scaler = polyamp_tensorflow.TensorFlowLossScaler()
    with pytest.raises(BackendMismatchError, match="bound to tensorflow, but scale\\(\\) received a torch object"):
        scaler.scale(torch.tensor(1.0))


def test_tensorflow_tensors_are_refused_by_a_torch_bound_scaler() -> None:
    pytest.importorskip("torch")
    import polyamp_torch

    scaler = polyamp_torch.TorchLossScaler()
    with pytest.raises(BackendMismatchError, match="bound to torch, but scale\\(\\) received a tensorflow object"):
        scaler.scale(tf.constant(1.0))


@pytest.mark.parametrize(
    ("optimizer", "error", "fragment"),
    [
        (lambda: object(), PolyampTypeError, "takes a Keras 3 optimizer"),
        (
            lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
            ScalerUsageError,
            "scales by itself",
        ),
        (lambda: polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD()), ScalerUsageError, "scales by itself"),
        (lambda: keras.optimizers.SGD(loss_scale_factor=8.0), ScalerUsageError, "loss_scale_factor"),
    ],
)
def test_apply_gradients_refuses_optimizers_that_would_double_unscale(
    optimizer: Any, error: type, fragment: str
) -> None:
    scaler = polyamp_tensorflow.TensorFlowLossScaler()
    w = tf.Variable([1.0])
    with pytest.raises(error) as info:
        scaler.apply_gradients(optimizer(), [(tf.constant([1.0]), w)])
    assert fragment in str(info.value)
    assert w.numpy()[0] == 1.0


def test_unscale_and_apply_reject_non_tensors() -> None:
    scaler = polyamp_tensorflow.TensorFlowLossScaler()
    with pytest.raises(PolyampTypeError, match="takes TensorFlow tensors"):
        scaler.unscale(["grad"])
    with pytest.raises(PolyampTypeError, match="takes a TensorFlow tensor"):
        scaler.scale("loss")


def test_step_skipped_errors() -> None:
    scaler = polyamp_tensorflow.TensorFlowLossScaler()
    with pytest.raises(
        ScalerUsageError, match="before this LossScaler stepped any optimizer"
    ):  # one wording on every backend
        scaler.step_skipped()
    with pytest.raises(ScalerUsageError, match="has not been stepped"):
        scaler.step_skipped(keras.optimizers.SGD())


def test_jit_compiled_step() -> None:
    scaler = polyamp.LossScaler(growth_interval=2)
    w = tf.Variable([1.0, -1.0])
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([w])

    @tf.function(jit_compile=True)
    def step(bad: Any) -> Any:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * w) * bad)
        scaler.apply_gradients(optimizer, zip(tape.gradient(scaled, [w]), [w]))
        return scaler.step_skipped()

    skipped = [bool(step(tf.constant(b))) for b in (1.0, math.inf, 1.0, 1.0)]
    assert skipped == [False, True, False, False]
    assert scaler.get_scale() == 65536.0 and int(optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("jit", [False, True], ids=["tf_function", "jit_compile"])
def test_two_optimizers_in_one_compiled_iteration_skip_separately(jit: bool) -> None:
    scaler = polyamp.LossScaler(growth_interval=10)
    a, b = tf.Variable([1.0, 1.0]), tf.Variable([1.0, 1.0])
    opt_a, opt_b = keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.5)
    opt_a.build([a])
    opt_b.build([b])

    @tf.function(jit_compile=jit)
    def iteration(bad_a: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(a * bad_a) + tf.reduce_sum(b))
        grad_a, grad_b = tape.gradient(scaled, [a, b])
        scaler.step(opt_a, [(grad_a, a)])
        scaler.step(opt_b, [(grad_b, b)])
        scaler.update()

    iteration(tf.constant(math.inf))
    assert (bool(scaler.step_skipped(opt_a)), bool(scaler.step_skipped(opt_b)), bool(scaler.step_skipped())) == (
        True,
        False,
        True,
    )
    assert np.array_equal(a.numpy(), [1.0, 1.0]) and np.array_equal(b.numpy(), [0.5, 0.5])
    assert scaler.get_scale() == 32768.0 and int(scaler.skipped_steps()) == 1  # one backoff for the iteration
    iteration(tf.constant(1.0))
    assert not bool(scaler.step_skipped(opt_a)) and not bool(scaler.step_skipped())
    assert scaler.state_dict()["_growth_tracker"] == 1


def test_a_graph_step_reads_the_scale_once_to_unscale_every_gradient() -> None:
    """In a ``tf.function`` step every gradient is divided by one read of the scale variable: a read is an
    operation of its own in the graph, and reading per gradient cost one operation per gradient. The divisions
    are in the branch that applies the step (as in Keras's LossScaleOptimizer: the scaled gradients are
    checked), the graph's only ones."""
    scaler = polyamp.LossScaler(backend="tensorflow", enabled=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)

    @tf.function  # type: ignore[untyped-decorator]
    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            loss = scaler.scale(tf.reduce_sum(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        scaler.apply_gradients(optimizer, zip(grads, model.trainable_variables))

    graph_def = step.get_concrete_function(tf.zeros((2, 4))).graph.as_graph_def()
    bodies = {"": list(graph_def.node), **{f.signature.name: list(f.node_def) for f in graph_def.library.function}}
    dividing = {name: [n for n in nodes if n.op == "RealDiv"] for name, nodes in bodies.items()}
    dividing = {name: divisions for name, divisions in dividing.items() if divisions}
    assert len(dividing) == 1
    ((body, divisions),) = dividing.items()
    assert body and len(divisions) == len(model.trainable_variables) == 4  # in a branch, not the step itself
    by_name = {n.name: n for n in bodies[body]}
    divisors = {_graph_source(by_name, n.input[1]).name for n in divisions}
    assert len(divisors) == 1
    assert by_name[divisors.pop()].op == "ReadVariableOp"


def _graph_source(by_name: dict[str, Any], name: str) -> Any:
    """The node an input (``name``, ``name:output``, ``^name``) comes from, in one graph or function body."""
    return by_name.get(name.lstrip("^").split(":")[0])


def _counter_writes_and_cast_round_trips(graph_def: Any) -> tuple[list[str], list[str]]:
    """Over a step graph and its functions (``cond`` branches): the variables written as read, add, assign
    (what a Keras variable's own ``assign_add`` builds; ``AssignAddVariableOp`` is one operation), and the casts
    of a cast."""
    read_add_assign, round_trips = [], []
    for nodes in [list(graph_def.node)] + [list(f.node_def) for f in graph_def.library.function]:
        by_name = {n.name: n for n in nodes}
        source = functools.partial(_graph_source, by_name)
        for node in nodes:
            if node.op == "AssignVariableOp":
                value = source(node.input[1])
                if value is not None and value.op == "AddV2":
                    reads = [source(i) for i in value.input]
                    if any(r is not None and r.op == "ReadVariableOp" and r.input[0] == node.input[0] for r in reads):
                        read_add_assign.append(node.name)
            if node.op == "Cast" and source(node.input[0]) is not None and source(node.input[0]).op == "Cast":
                round_trips.append(node.name)
    return read_add_assign, round_trips


def _graph_step(form: str, *, jit_compile: bool = False, growth: int = 2000) -> tuple[Any, Any]:
    """A ``tf.function`` GradientTape step of a small model with Adam, in one of the three forms: Keras's own
    LossScaleOptimizer, polyamp's, or polyamp.LossScaler's ``apply_gradients`` (``growth``: the growth
    interval); with the optimizer or scaler."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    inner = keras.optimizers.Adam(0.01)
    # A small initial scale: grown, it still leaves float16 gradients finite under a mixed policy.
    settings = {"initial_scale": 2.0**8, "dynamic_growth_steps": growth}
    scaler = (
        polyamp.LossScaler(backend="tensorflow", enabled=True, init_scale=2.0**8, growth_interval=growth)
        if form == "LossScaler"
        else None
    )
    if form == "keras":
        optimizer = keras.mixed_precision.LossScaleOptimizer(inner, **settings)
    elif form == "polyamp":
        optimizer = polyamp_tensorflow.LossScaleOptimizer(inner, **settings)
    else:
        optimizer = inner
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit_compile)  # type: ignore[untyped-decorator]
    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(x), tf.float32))
            scaled = optimizer.scale_loss(loss) if scaler is None else scaler.scale(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        pairs = zip(grads, model.trainable_variables)
        optimizer.apply_gradients(pairs) if scaler is None else scaler.apply_gradients(optimizer, pairs)

    return step, optimizer if scaler is None else scaler


@pytest.mark.parametrize("form", ["keras", "polyamp", "LossScaler"])
def test_a_graph_step_branches_once_on_its_flag_as_keras_does(form: str) -> None:
    """Every operation of a ``tf.function`` step is visited at every call, in a branch taken or not. Keras's
    LossScaleOptimizer branches once per step: apply and grow, or halve. polyamp's step (either form) does too:
    the rule advances inside the branch that applies or skips (``apply_and_advance``), not
    in a second branch on the same flag; the records are written from the boolean the flag was made from, with
    no comparison of the flag; and the skipped step's counting of non-finite gradients is one call of a function
    kept whole, not some thirty operations in the branch."""
    step, _ = _graph_step(form)
    graph_def = step.get_concrete_function(tf.zeros((2, 4))).graph.as_graph_def()
    top = [n.op for n in graph_def.node]
    assert sum(op in ("If", "StatelessIf") for op in top) == 1
    if form == "keras":
        return
    assert "Greater" not in top
    functions = {f.signature.name: f for f in graph_def.library.function}
    calls = [
        node
        for f in functions.values()
        for node in f.node_def
        if node.op in ("StatefulPartitionedCall", "PartitionedCall")
    ]
    assert len(calls) == 1
    counting = functions[calls[0].attr["f"].func.name]
    assert counting.attr["_noinline"].b
    assert {"UnsortedSegmentSum", "IsNan", "IsInf"} <= {n.op for n in counting.node_def}


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("form", ["polyamp", "LossScaler"])
def test_a_graph_step_with_the_rule_in_its_branch_follows_the_reference_and_names_what_overflowed(
    form: str, jit_compile: bool
) -> None:
    """The same step run (also compiled by XLA, which takes the counting function into its cluster): finite
    steps grow the scale at the interval, an overflow halves it and is recorded with the gradient it came from,
    read back from the counting function's write."""
    step, owner = _graph_step(form, jit_compile=jit_compile, growth=2)
    scaler = owner if form == "LossScaler" else owner._scaler
    config, state = scaler.config, scaler.get_state()
    assert config.growth_interval == 2
    bad = tf.constant([[np.inf, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    pattern = [False, False, True, False, False, False, True, True, False]
    for overflow in pattern:
        step(bad if overflow else tf.fill((2, 4), 1e-3))
        state = config.next_state(state, overflow)
        assert scaler.get_state() == state
    assert state.scale == 2.0**7  # grown twice from 2**8, halved three times: both halves ran
    records = scaler.records()[-len(pattern) :]
    assert [r.skipped for r in records] == pattern
    named = {g.name for r in records if r.skipped for g in r.gradients}
    assert named and all("kernel" in name for name in named)
    assert int(scaler.skipped_steps()) == pattern.count(True)


def test_a_tensorflow_that_refuses_the_kept_whole_attribute_counts_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_noinline`` is an attribute TensorFlow's ``tf.function`` lists as allowed today; one that refused it
    (a ``ValueError`` when the function is made) gets the counting inline in the branch, with the same
    records."""
    real = tf.function

    def refusing(*args: Any, **kwargs: Any) -> Any:
        if "experimental_attributes" in kwargs:
            raise ValueError("`_noinline is not supported by tf.function as an attribute.")
        return real(*args, **kwargs)

    monkeypatch.setattr(tf, "function", refusing)
    step, scaler = _graph_step("LossScaler")
    graph_def = step.get_concrete_function(tf.zeros((2, 4))).graph.as_graph_def()
    assert not [n for f in graph_def.library.function for n in f.node_def if n.op == "StatefulPartitionedCall"]
    step(tf.constant([[np.inf, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    (record,) = scaler.records()[-1:]
    assert record.skipped and record.gradients and all("kernel" in g.name for g in record.gradients)


@pytest.mark.parametrize("optimizer_kind", ["keras", "polyamp"])
def test_a_loss_scale_optimizer_step_counts_with_assign_add_and_keeps_the_tracker_in_its_dtype(
    optimizer_kind: str,
) -> None:
    """Each graph operation of a ``tf.function`` step costs about as much as a small kernel on a CPU. Keras's
    LossScaleOptimizer keeps its step counter (polyamp's growth tracker) in int64, and its variables are Keras
    variables, whose own ``assign_add`` is a read, an add and an assign. polyamp's optimizer writes the tracker
    in the tracker's dtype (no int32 round trip: two casts per step) and increments its counters (the records'
    count, the skip count, the tracker) through the optimizer's ``assign_add``, one ``AssignAddVariableOp`` on
    TensorFlow. Keras's own graph, built the same way, shows both patterns: its step counter is a
    read-add-assign."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    inner = keras.optimizers.SGD(0.01)
    make = (
        polyamp_tensorflow.LossScaleOptimizer
        if optimizer_kind == "polyamp"
        else keras.mixed_precision.LossScaleOptimizer
    )
    optimizer = make(inner)
    optimizer.build(model.trainable_variables)

    @tf.function  # type: ignore[untyped-decorator]
    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_mean(tf.cast(model(x), tf.float32)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    graph_def = step.get_concrete_function(tf.zeros((2, 4))).graph.as_graph_def()
    read_add_assign, round_trips = _counter_writes_and_cast_round_trips(graph_def)
    assert round_trips == []
    # One is Keras's own, in both: the inner optimizer's ``iterations.assign_add(1)`` in the applying branch.
    assert len(read_add_assign) == (1 if optimizer_kind == "polyamp" else 2)
    if optimizer_kind == "polyamp":
        # The rule's finite half, inside the applying branch (`apply_and_advance`), branches on the growth test
        # (`polyamp_keras._rule.advance`'s ``branch``): a finite step below the interval runs a branch that is
        # one increment, where the select form would compute the growth (a product, its finiteness, selects)
        # every step.
        bodies = [
            [n.op for n in f.node_def if n.op not in ("Const", "Cast", "Identity", "NoOp")]
            for f in graph_def.library.function
        ]
        assert ["AssignAddVariableOp"] in bodies
        assert not [ops for ops in bodies if "GreaterEqual" in ops and "SelectV2" in ops]
    for _ in range(3):  # and the step runs: three finite steps counted once each
        step(tf.fill((2, 4), 1e-3))  # gradients float16 holds at either initial scale
    assert int(optimizer.step_counter.numpy()) == 3
    if optimizer_kind == "polyamp":
        assert [r.skipped for r in optimizer.records()] == [False, False, False]


@pytest.mark.slow  # the page's block runs in the fast set (test_doc_blocks); this adds the warning check
def test_the_getting_started_loop_binds_inside_tf_function_without_an_autograph_warning(
    tmp_path: Path, run_bounded: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    # The page's loop, run from a file as a reader runs it (AutoGraph converts only code whose source it can
    # read): its LossScaler binds to TensorFlow inside the first trace of the tf.function.
    page = (ROOT / "docs" / "getting-started" / "tensorflow.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert code is not None and "polyamp.LossScaler()" in code.group(1)
    script = tmp_path / "getting_started.py"
    script.write_text(code.group(1))
    paths = [str(ROOT), *(str(ROOT / "backends" / name) for name in ("torch", "tensorflow", "keras", "jax"))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = run_bounded([sys.executable, str(script)], cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "AutoGraph" not in output and "do_not_convert" not in output, output[-3000:]


def test_a_checkpoint_saves_and_restores_the_whole_scaler_into_a_fresh_one(tmp_path: Path) -> None:
    settings = dict(init_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    scaler = polyamp_tensorflow.TensorFlowLossScaler(**settings, spike=polyamp.SpikeRule("loss", window=4, warmup=2))
    w = tf.Variable([1.0, 2.0])
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def step(bad: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * w) * bad)
        scaler.apply_gradients(optimizer, zip(tape.gradient(scaled, [w]), [w]))

    for char in "FOFFOF":
        step(tf.constant(math.inf if char == "O" else 1.0))
    checkpoint = tf.train.Checkpoint(w=w, optimizer=optimizer, scaler=scaler)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    manager.save()
    saved, skipped = scaler.state_dict(), int(scaler.skipped_steps())
    expected = polyamp.LossScaleConfig(**settings).states("FOFFOF")[-1]
    assert (saved["scale"], saved["_growth_tracker"], saved["hysteresis_left"]) == (
        expected.scale,
        expected.growth_tracker,
        expected.hysteresis_left,
    )
    assert skipped == 2 and len(saved["spike_window"]) == 4

    fresh = polyamp_tensorflow.TensorFlowLossScaler(spike=polyamp.SpikeRule("loss", window=4, warmup=2))
    restored = tf.train.Checkpoint(w=tf.Variable([0.0, 0.0]), optimizer=keras.optimizers.SGD(0.01), scaler=fresh)
    restored.restore(tf.train.CheckpointManager(restored, str(tmp_path), max_to_keep=2).latest_checkpoint)
    # Settings, scale, counters and spike window as saved, and the count of skipped steps.
    assert fresh.state_dict() == saved and fresh.config == scaler.config
    assert int(fresh.skipped_steps()) == skipped


def test_a_checkpoint_restore_follows_the_state_dict_rules(tmp_path: Path) -> None:
    disabled = polyamp_tensorflow.TensorFlowLossScaler(enabled=False)
    path = tf.train.Checkpoint(scaler=disabled).save(str(tmp_path / "disabled"))
    scaler = polyamp_tensorflow.TensorFlowLossScaler(init_scale=512.0)
    before = scaler.state_dict()
    with pytest.raises(polyamp.StateDictError, match="saved from a disabled LossScaler"):
        tf.train.Checkpoint(scaler=scaler).restore(path)
    assert scaler.state_dict() == before and int(scaler.skipped_steps()) == 0
    # A variable saved under the name: refused, the scaler unchanged.
    other = tf.train.Checkpoint(scaler=tf.Variable(1.0)).save(str(tmp_path / "other"))
    with pytest.raises(polyamp.StateDictError, match="not the JSON its save wrote"):
        tf.train.Checkpoint(scaler=scaler).restore(other).expect_partial()
    assert scaler.state_dict() == before


# -- settings once traced, unscale stages, bad scales inside a graph, long runs of NaN steps ------------------------


def _one_still_weight() -> tuple[Any, Any]:
    """A one-element weight and an SGD built for it with learning rate 0: steps run, the weight stays 1."""
    w = tf.Variable([1.0])
    opt = keras.optimizers.SGD(0.0)
    opt.build([w])
    return w, opt


def test_tensorflow_refuses_new_settings_once_traced_and_takes_new_state() -> None:
    scaler = polyamp.LossScaler(growth_interval=10, enabled=True)
    w, opt = _one_still_weight()

    @tf.function
    def step(bad: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w) * bad)
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))

    step(tf.constant(1.0))
    with pytest.raises(ScalerUsageError, match="already traced a step"):
        scaler.load_state_dict(dict(scaler.state_dict(), hysteresis=3, hysteresis_left=3))
    assert scaler.config.hysteresis == 1
    state = dict(scaler.state_dict(), scale=1024.0, _growth_tracker=9)
    scaler.load_state_dict(state)  # same settings: the scale and counters load at any time
    step(tf.constant(1.0))
    assert scaler.get_scale() == 2048.0
    with pytest.raises(ScalerUsageError, match="already traced"):
        scaler.set_growth_factor(4.0)


def test_an_unscale_left_without_its_apply_does_not_leak_into_the_next_iteration() -> None:
    scaler = polyamp.LossScaler(enabled=True)
    w = tf.Variable([0.0])
    opt = keras.optimizers.SGD(1.0)

    def grads() -> list[Any]:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * 3.0))
        return tape.gradient(scaled, [w])

    scaler.unscale(grads())  # inspected, never applied
    scaler.apply_gradients(opt, zip(grads(), [w]))  # fresh scaled gradients: unscaled once, here
    assert w.numpy()[0] == -3.0  # not -3 * 65536
    first = grads()
    scaler.unscale(first)
    with pytest.raises(ScalerUsageError, match="scaled gradients that were passed to unscale"):
        scaler.apply_gradients(opt, zip(first, [w]))


def test_unscale_stages_do_not_pile_up() -> None:
    scaler = polyamp.LossScaler(enabled=True, backend="tensorflow")
    refs = []
    for _ in range(200):
        scaler.scale(tf.constant(1.0))
        grads = [tf.ones((64, 64))]
        refs.append(weakref.ref(grads[0]))
        scaler.unscale(grads)
        del grads
    gc.collect()
    assert sum(ref() is not None for ref in refs) <= 1  # only the last stage holds its gradients


@pytest.mark.parametrize("new_scale", [math.nan, -5.0, 0.0, 2.0**30])
def test_update_with_a_bad_symbolic_scale_in_a_tf_function_is_refused(new_scale: float) -> None:
    """Inside a tf.function the value is known only when the graph runs: the graph checks it then."""
    scaler = polyamp.LossScaler(enabled=True, max_scale=2.0**20, backend="tensorflow")
    w, opt = _one_still_weight()

    @tf.function
    def step(value: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w))
        scaler.step(opt, zip(tape.gradient(scaled, [w]), [w]))
        scaler.update(new_scale=value)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"update\(new_scale\) needs a finite scale"):
        step(tf.constant(new_scale))
    assert scaler.get_scale() == 65536.0
    step(tf.constant(512.0))
    assert scaler.get_scale() == 512.0
    scaler.load_state_dict(scaler.state_dict())  # its own state dict still loads


@pytest.mark.parametrize("which", ["tensorflow_scaler", "keras_optimizer"])
def test_200_nan_steps_then_20_finite_ones_train_on_finite_weights(which: str) -> None:
    w = tf.Variable([1.0, 2.0])
    if which == "keras_optimizer":
        optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.01), enabled=True)

        def step(bad: float) -> None:
            with tf.GradientTape() as tape:
                scaled = optimizer.scale_loss(tf.reduce_sum(w * w) * bad)
            optimizer.apply_gradients(zip(tape.gradient(scaled, [w]), [w]))

        def skipped() -> bool:
            return bool(optimizer.last_skipped.numpy())

        scale = optimizer.get_scale
    else:
        scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True)
        inner = keras.optimizers.SGD(0.01)

        def step(bad: float) -> None:
            with tf.GradientTape() as tape:
                scaled = scaler.scale(tf.reduce_sum(w * w) * bad)
            scaler.apply_gradients(inner, zip(tape.gradient(scaled, [w]), [w]))

        def skipped() -> bool:
            return bool(scaler.step_skipped())

        scale = scaler.get_scale
    for _ in range(200):
        step(math.nan)
    assert scale() == 1.0 and np.array_equal(w.numpy(), [1.0, 2.0])
    for _ in range(20):
        step(1.0)
        assert not skipped()  # training goes on: never stuck skipping
    assert np.isfinite(w.numpy()).all() and w.numpy()[0] < 1.0
