"""polyamp_keras.PrecisionOptimizer: the training state a policy plans, on every Keras backend.

The tests run in this process on its Keras backend; `test_on_every_keras_backend` runs this module again in a
subprocess per other backend (Keras picks its backend once per process). The writes are checked bit for bit
against `polyamp.backend_api.training_state.write_update` over a float32 NumPy reference of the inner optimizer (SGD
with momentum), so Keras-on-torch, Keras-on-JAX and Keras-on-TensorFlow follow the same trajectory as that reference.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import ml_dtypes  # noqa: E402

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp import InvalidConfigError, PolyampTypeError, StateDictError, TrainingStateWarning  # noqa: E402
from polyamp.backend_api.training_state import KAHAN_KEY, MASTER_KEY, write_update  # noqa: E402
from polyamp_keras.testing import apply, keras_backend  # noqa: E402

if TYPE_CHECKING:
    from conftest import RunOnKerasBackend

ops = keras.ops
BACKEND = keras_backend()
HERE = Path(__file__).resolve()
LR, MOMENTUM = 0.01, 0.9


def _numpy(value: Any) -> np.ndarray:
    return np.array(ops.convert_to_numpy(value))


def _f32(value: Any) -> np.ndarray:
    return _numpy(ops.cast(value, "float32")).astype(np.float32)


def _model(policy: str, seed: int = 0, width: int = 4) -> Any:
    with polyamp.policy_scope(policy):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(width)])


def _precision(policy: str, inner: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    model = _model(policy)
    optimizer = polyamp_keras.PrecisionOptimizer(
        inner if inner is not None else keras.optimizers.SGD(LR, momentum=MOMENTUM), policy, **kwargs
    )
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _grads(model: Any, step: int, scale: float = 1.0) -> list[Any]:
    rng = np.random.default_rng(100 + step)
    return [
        ops.convert_to_tensor((rng.normal(size=tuple(v.shape)) * scale).astype(np.float32), dtype=v.dtype)
        for v in model.trainable_variables
    ]


def _compiled_apply(optimizer: Any, variables: list[Any]) -> Callable[[list[Any]], None]:
    """One step compiled the way each backend compiles a training step (torch: eager, as Keras runs it)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda grads: optimizer.apply(grads, variables))
        return lambda grads: step(grads)
    if BACKEND == "jax":
        import jax

        jitted = jax.jit(optimizer.stateless_apply)

        def run(grads: list[Any]) -> None:
            new_values, new_opt = jitted([v.value for v in optimizer.variables], grads, [v.value for v in variables])
            for variable, value in zip(variables, new_values, strict=True):
                variable.assign(value)
            for variable, value in zip(optimizer.variables, new_opt, strict=True):
                variable.assign(value)

        return run
    return lambda grads: apply(optimizer, grads, variables)


def _reference_step(
    weight: np.ndarray,
    master: np.ndarray | None,
    momentum: np.ndarray,
    compensation: np.ndarray | None,
    grad: np.ndarray,
    *,
    dtype: str,
    rounding: str,
    state: str,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """Keras's SGD(momentum) update_step in float32 NumPy, then each element written by `write_update`."""
    w32 = master if master is not None else weight
    m = (momentum * np.float32(MOMENTUM)).astype(np.float32) - (grad * np.float32(LR)).astype(np.float32)
    target = (w32 + m).astype(np.float32)
    stored_m = m if state == "float32" else m.astype(ml_dtypes.bfloat16).astype(np.float32)
    if master is not None:
        return target.astype(ml_dtypes.bfloat16).astype(np.float32), target, stored_m, None
    new_w = np.empty_like(weight)
    new_c = np.zeros_like(weight)
    for i in np.ndindex(weight.shape):
        c = 0.0 if compensation is None else float(compensation[i])
        new_w[i], new_c[i] = write_update(
            float(weight[i]), float(target[i]), dtype=dtype, rounding=rounding, compensation=c
        )
    return new_w, None, stored_m, None if compensation is None else new_c


def _assert_bits(actual: np.ndarray, desired: np.ndarray | None, ulps: int) -> None:
    """float32 arrays equal bit for bit, or within ``ulps`` units in the last place."""
    assert desired is not None
    distance = np.abs(actual.astype(np.float32).view(np.int32).astype(np.int64) - desired.view(np.int32))
    assert int(distance.max(initial=0)) <= ulps, f"{int(distance.max())} ulps apart (allowed: {ulps})"


@pytest.mark.filterwarnings("ignore::polyamp.TrainingStateWarning")  # the nearest plan: its hazard is said
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "policy", ["bfloat16_kahan", "bfloat16_float32_master", "params=bf16,compute=bf16,state=bf16,rounding=nearest"]
)
def test_writes_match_write_update_bitwise(policy: str, compiled: bool) -> None:
    """Weights, master copies, slots and compensation buffers after 6 steps of SGD(momentum), bit for bit as
    the float32 NumPy reference written through write_update (the same trajectory on every backend)."""
    plan = polyamp.Policy(policy)
    model, optimizer = _precision(policy)
    variables = list(model.trainable_variables)
    step = _compiled_apply(optimizer, variables) if compiled else (lambda g: apply(optimizer, g, variables))
    weights = [_f32(v) for v in variables]
    masters = [w.copy() for w in weights] if plan.keeps_master else [None] * len(weights)
    momenta = [np.zeros_like(w) for w in weights]
    compensations = [np.zeros_like(w) for w in weights] if plan.rounding == "kahan" else [None] * len(weights)
    for s in range(6):
        grads = _grads(model, s, scale=0.05)
        step(grads)
        for i, g in enumerate(grads):
            weights[i], masters[i], momenta[i], compensations[i] = _reference_step(
                weights[i], masters[i], momenta[i], compensations[i], _f32(g),
                dtype="bfloat16", rounding=plan.rounding, state=plan.state_dtype,
            )  # fmt: skip
    # Under jax.jit, XLA may fuse SGD's multiply-subtract (m * momentum - g * lr) into one FMA: the float32
    # momentum can differ from the eager one in its last bits. The writes (additions only) stay exact: the
    # weights are checked bitwise everywhere, and against the master copy actually held.
    ulps = 4 if compiled and BACKEND == "jax" else 0
    for i, variable in enumerate(variables):
        np.testing.assert_array_equal(_f32(variable).view(np.uint32), weights[i].view(np.uint32))
        _assert_bits(_f32(optimizer.slot_variables[i]), momenta[i], ulps)
    for i, master in enumerate(optimizer.master_variables):
        _assert_bits(_numpy(master), masters[i], ulps)
        written = _numpy(master).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(_f32(variables[i]).view(np.uint32), written.view(np.uint32))
    for i, compensation in enumerate(optimizer.compensation_variables):
        np.testing.assert_array_equal(_f32(compensation).view(np.uint32), compensations[i].view(np.uint32))
    assert any(np.any(c != 0) for c in compensations if c is not None) or plan.rounding != "kahan"
    assert int(_numpy(optimizer.iterations)) == 6


def test_stochastic_rounding_is_write_update_with_the_seeded_stream() -> None:
    """Each write adds the next 16 random bits of a SeedGenerator(seed) stream (part of the state): the same
    bits as stochastic_round_bfloat16 with those numbers; another seed draws others."""
    model, optimizer = _precision("bfloat16_stochastic", seed=7)
    variables = list(model.trainable_variables)
    stream = keras.random.SeedGenerator(7)
    momenta = [np.zeros(tuple(v.shape), np.float32) for v in variables]
    for s in range(3):
        grads = _grads(model, s, scale=0.05)
        before = [_f32(v) for v in variables]
        apply(optimizer, grads, variables)
        for i, (variable, g) in enumerate(zip(variables, grads, strict=True)):
            random16 = _numpy(keras.random.randint(tuple(variable.shape), 0, 65536, dtype="int32", seed=stream))
            m = (momenta[i] * np.float32(MOMENTUM)).astype(np.float32) - (_f32(g) * np.float32(LR)).astype(np.float32)
            target = (before[i] + m).astype(np.float32)
            momenta[i] = m.astype(ml_dtypes.bfloat16).astype(np.float32)
            expected = np.array(
                [
                    write_update(float(w), float(t), dtype="bfloat16", rounding="stochastic", random16=int(r))[0]
                    for w, t, r in zip(before[i].ravel(), target.ravel(), random16.ravel(), strict=True)
                ],
                np.float32,
            ).reshape(target.shape)
            np.testing.assert_array_equal(_f32(variable).view(np.uint32), expected.view(np.uint32))
    other_model, other = _precision("bfloat16_stochastic", seed=8)
    apply(other, _grads(other_model, 0, scale=0.05), list(other_model.trainable_variables))
    again_model, again = _precision("bfloat16_stochastic", seed=8)
    apply(again, _grads(again_model, 0, scale=0.05), list(again_model.trainable_variables))
    assert np.array_equal(_f32(other_model.trainable_variables[0]), _f32(again_model.trainable_variables[0]))
    assert not np.array_equal(_numpy(other._seeds.state), _numpy(optimizer._seeds.state))


def test_stochastic_rounding_is_unbiased() -> None:
    """A step 0.3 units in the last place up rounds up 30% of the time (4096 weights at 1.0)."""
    with polyamp.policy_scope("bfloat16_stochastic"):
        weight = keras.Variable(np.ones((64, 64), np.float32), dtype="bfloat16")
    optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(1.0), "bfloat16_stochastic", seed=3)
    optimizer.build([weight])
    ulp = 2.0**-7  # bfloat16 spacing in [1, 2)
    apply(optimizer, [ops.convert_to_tensor(np.full((64, 64), -0.3 * ulp, np.float32), dtype="bfloat16")], [weight])
    values = _f32(weight)
    assert set(np.unique(values).tolist()) <= {1.0, 1.0 + ulp}
    up = float(np.mean(values > 1.0))
    gradient = float(np.float32(ml_dtypes.bfloat16(-0.3 * ulp)))  # the gradient as stored in bfloat16
    assert abs(up - (-gradient / ulp)) < 0.03  # 4096 Bernoulli draws: 4.5 standard deviations


@pytest.mark.parametrize(
    ("policy", "slot", "master", "compensation"),
    [
        ("bfloat16_kahan", "bfloat16", None, "bfloat16"),
        ("bfloat16_stochastic", "bfloat16", None, None),
        ("bfloat16_float32_master", "float32", "float32", None),
        ("params=bf16,compute=bf16,state=f32,rounding=kahan", "float32", None, "bfloat16"),
    ],
)
def test_state_variables_are_made_in_the_plans_dtypes(
    policy: str, slot: str, master: str | None, compensation: str | None
) -> None:
    model, optimizer = _precision(policy, keras.optimizers.AdamW(1e-3))
    assert {str(v.dtype) for v in model.trainable_variables} == {"bfloat16"}
    assert [str(v.dtype) for v in optimizer.slot_variables] == [slot] * 4  # two moments per variable
    assert [str(v.dtype) for v in optimizer.master_variables] == ([master] * 2 if master else [])
    assert [str(v.dtype) for v in optimizer.compensation_variables] == ([compensation] * 2 if compensation else [])
    names = [str(v.name) for v in optimizer.variables]
    assert sum(MASTER_KEY in n for n in names) == (2 if master else 0)
    assert sum(KAHAN_KEY in n for n in names) == (2 if compensation else 0)
    assert optimizer.iterations is optimizer.inner_optimizer.iterations
    # the inner optimizer's float32 keys hold no memory and are neither its variables nor this one's
    assert (
        all(str(v.dtype) != "float32" or MASTER_KEY in v.name or "learning_rate" in v.name for v in optimizer.variables)
        or slot == "float32"
    )
    assert len(optimizer.inner_optimizer.variables) == 2  # its iterations and learning rate
    if master:
        for variable, copy in zip(model.trainable_variables, optimizer.master_variables, strict=True):
            assert np.array_equal(_f32(variable), _numpy(copy))  # initialised from the weights, exactly


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("bfloat16_kahan", 10), ("bfloat16_stochastic", 8), ("bfloat16_float32_master", 16), ("float32", 16)],
)
def test_measure_state_bytes_counts_adamw_from_its_variables(policy: str, expected: int) -> None:
    _, optimizer = _precision(policy, keras.optimizers.AdamW(1e-3))
    measured = polyamp_keras.measure_state_bytes(polyamp_keras.LossScaleOptimizer(optimizer, enabled=None))
    assert measured.parameters == 24 and measured.per_parameter == expected
    assert measured.total == expected * 24
    assert measured.per_parameter == polyamp.state_bytes(policy).total


def test_measure_state_bytes_of_a_plain_optimizer_and_refusals() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingStateWarning)
        model = _model("bfloat16")
        plain = keras.optimizers.AdamW(1e-3)
        plain.build(model.trainable_variables)
    assert polyamp_keras.measure_state_bytes(plain).per_parameter == 8
    with pytest.raises(polyamp.PolyampValueError, match="not built yet"):
        polyamp_keras.measure_state_bytes(keras.optimizers.Adam())
    with pytest.raises(PolyampTypeError, match="Keras optimizer"):
        polyamp_keras.measure_state_bytes("adam")


def test_float32_variables_pass_straight_through() -> None:
    """With float32 variables and state, the inner optimizer runs as it is: the same bits as without it."""
    model, optimizer = _precision("float32", keras.optimizers.Adam(0.01))
    plain_model = _model("float32")
    plain = keras.optimizers.Adam(0.01)
    plain.build(plain_model.trainable_variables)
    for s in range(3):
        apply(optimizer, _grads(model, s), list(model.trainable_variables))
        apply(plain, _grads(plain_model, s), list(plain_model.trainable_variables))
    for a, b in zip(model.trainable_variables, plain_model.trainable_variables, strict=True):
        assert np.array_equal(_numpy(a), _numpy(b))


@pytest.mark.filterwarnings("ignore:LossScaleOptimizer.*before scale_loss:UserWarning")  # the gradients are made
@pytest.mark.parametrize("policy", ["bfloat16_kahan", "bfloat16_stochastic", "bfloat16_float32_master"])
@pytest.mark.parametrize("enabled", [None, True], ids=["guard", "scaling"])
def test_a_skipped_step_leaves_every_variable_bitwise(policy: str, enabled: bool | None) -> None:
    """Under LossScaleOptimizer (the bfloat16 guard, or scaling), a step with an inf gradient changes no weight,
    slot, master copy, compensation buffer, inner iterations or random state; the next step applies."""
    model, precision = _precision(policy, keras.optimizers.AdamW(1e-2))
    optimizer = polyamp_keras.LossScaleOptimizer(precision, enabled=enabled)
    variables = list(model.trainable_variables)
    optimizer.build(variables)
    scale = optimizer.get_scale() if enabled else 1.0
    apply(optimizer, _grads(model, 0, scale=scale), variables)
    watched = [*variables, *precision.variables]
    before = [_numpy(v) for v in watched]
    grads = _grads(model, 1, scale=scale)
    grads[0] = ops.convert_to_tensor(np.full(tuple(variables[0].shape), np.inf, np.float32), dtype=grads[0].dtype)
    apply(optimizer, grads, variables)
    assert bool(_numpy(optimizer.last_skipped))
    for old, variable in zip(before, watched, strict=True):
        assert old.tobytes() == _numpy(variable).tobytes(), variable.path
    apply(optimizer, _grads(model, 2, scale=optimizer.get_scale() if enabled else 1.0), variables)
    assert int(_numpy(precision.iterations)) == 2


def test_model_fit_with_loss_scaling_around_the_plan(tmp_path: Path) -> None:
    """model.fit (compiled on every backend) with LossScaleOptimizer(PrecisionOptimizer(AdamW)) under
    bfloat16_kahan: the loss falls, the state stays in the plan's dtypes, and model.save / load_model bring the
    two optimizers back with every variable."""
    with polyamp.policy_scope("bfloat16_kahan"):
        keras.utils.set_random_seed(1)
        model = polyamp_keras.cast_outputs(
            keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]),
            "bfloat16_kahan",
        )
        optimizer = polyamp_keras.LossScaleOptimizer(
            polyamp_keras.PrecisionOptimizer(keras.optimizers.AdamW(3e-3)), enabled=None
        )
        model.compile(optimizer=optimizer, loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 6)).astype(np.float32)
        y = (x @ rng.normal(size=(6, 1))).astype(np.float32)
        history = model.fit(x, y, epochs=4, batch_size=32, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.8 * losses[0]
    precision = optimizer.inner_optimizer
    assert int(_numpy(precision.iterations)) == 32
    assert {str(v.dtype) for v in precision.compensation_variables} == {"bfloat16"}
    assert any(np.any(_f32(c) != 0) for c in precision.compensation_variables)
    path = tmp_path / "fitted.keras"
    model.save(path)
    restored = keras.saving.load_model(path).optimizer
    assert isinstance(restored.inner_optimizer, polyamp_keras.PrecisionOptimizer)
    assert restored.inner_optimizer.policy.name == "bfloat16_kahan"
    for saved, back in zip(optimizer.variables, restored.variables, strict=True):
        assert _numpy(saved).tobytes() == _numpy(back).tobytes(), saved.path


def _distance_after(policy: str, steps: int = 120) -> float:
    """|w - target| after SGD steps too small for bfloat16 to hold (0.3% of the weight)."""
    weight = keras.Variable(np.ones((256,), np.float32), dtype=polyamp.Policy(policy).param_dtype)
    target = np.full((256,), 1.03, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingStateWarning)
        optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(0.01), policy, seed=1)
        optimizer.build([weight])
    for _ in range(steps):
        grad = ops.convert_to_tensor(0.1 * np.sign(_f32(weight) - target), dtype=weight.dtype)
        apply(optimizer, [grad], [weight])
    return float(np.mean(np.abs(_f32(weight) - target)))


def test_kahan_and_stochastic_track_the_float32_master_while_nearest_stalls() -> None:
    """Each update (0.001) is below half a bfloat16 unit at 1.0 (0.0039): to nearest the weights never move;
    a float32 master, Kahan compensation and stochastic rounding all reach the target."""
    nearest = _distance_after("params=bf16,compute=bf16,state=bf16")
    master = _distance_after("bfloat16_float32_master")
    kahan = _distance_after("bfloat16_kahan")
    stochastic = _distance_after("bfloat16_stochastic")
    assert nearest == pytest.approx(0.03, abs=1e-6)  # never moved
    assert master < 0.005 and kahan < 0.005 and stochastic < 0.008


def test_save_and_load_model_round_trips_the_plan_and_state(tmp_path: Path) -> None:
    model, optimizer = _precision("bfloat16_kahan", keras.optimizers.AdamW(1e-2), seed=5)
    model.compile(optimizer=optimizer, loss="mse")
    for s in range(2):
        apply(optimizer, _grads(model, s, scale=0.05), list(model.trainable_variables))
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    restored = loaded.optimizer
    assert isinstance(restored, polyamp_keras.PrecisionOptimizer)
    assert (restored.policy, restored.seed) == (polyamp.Policy("bfloat16_kahan"), 5)
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert [str(v.dtype) for v in restored.variables] == [str(v.dtype) for v in optimizer.variables]
    for saved, back in zip(optimizer.variables, restored.variables, strict=True):
        assert _numpy(saved).tobytes() == _numpy(back).tobytes(), saved.path
    apply(optimizer, _grads(model, 3, scale=0.05), list(model.trainable_variables))
    apply(restored, _grads(loaded, 3, scale=0.05), list(loaded.trainable_variables))
    for a, b in zip(model.trainable_variables, loaded.trainable_variables, strict=True):
        assert _numpy(a).tobytes() == _numpy(b).tobytes()


def _trained(policy: str) -> tuple[Any, Any]:
    model, optimizer = _precision(policy, keras.optimizers.AdamW(1e-2))
    model.compile(optimizer=optimizer, loss="mse")
    for s in range(2):
        apply(optimizer, _grads(model, s, scale=0.05), list(model.trainable_variables))
    return model, optimizer


def test_loading_under_another_plan_converts_with_one_note(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    master_model, master_opt = _trained("bfloat16_float32_master")
    path = tmp_path / "master.weights.h5"
    master_model.save_weights(path)
    kahan_model, kahan_opt = _trained("bfloat16_kahan")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        kahan_model.load_weights(path)
    notes = [r.getMessage() for r in caplog.records if r.name == "polyamp"]
    assert len(notes) == 1
    assert "slots were saved in float32 and are loaded as bfloat16" in notes[0]
    assert "float32 master copies are dropped" in notes[0] and "no Kahan compensation buffers" in notes[0]
    for saved, loaded in zip(master_opt.slot_variables, kahan_opt.slot_variables, strict=True):
        assert str(loaded.dtype) == "bfloat16"
        assert _f32(loaded).tobytes() == _numpy(saved).astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()
    assert all(not np.any(_f32(c)) for c in kahan_opt.compensation_variables)
    # and back: a checkpoint without master copies into a float32-master plan starts them from the weights
    path = tmp_path / "kahan.weights.h5"
    kahan_model.save_weights(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        master_model.load_weights(path)
    notes = [r.getMessage() for r in caplog.records if r.name == "polyamp"]
    assert len(notes) == 1 and "no master copies (it was saved under another plan): they are made from" in notes[0]
    for variable, master in zip(master_model.trainable_variables, master_opt.master_variables, strict=True):
        assert np.array_equal(_f32(variable), _numpy(master))
    assert [str(v.dtype) for v in master_opt.slot_variables] == ["float32"] * 4


def test_a_malformed_state_is_refused_and_nothing_changes() -> None:
    _, optimizer = _trained("bfloat16_kahan")
    before = [_numpy(v).tobytes() for v in optimizer.variables]
    arrays = [_numpy(v) for v in optimizer.variables]
    with pytest.raises(StateDictError, match=r"holds 3 arrays.*left unchanged"):
        optimizer.set_weights(arrays[:3])
    arrays[1] = np.zeros((7, 7), np.float32)
    with pytest.raises(StateDictError, match=r"shape \(7, 7\)"):
        optimizer.set_weights(arrays)
    assert [_numpy(v).tobytes() for v in optimizer.variables] == before


def test_an_unplanned_optimizer_on_bfloat16_weights_warns_once() -> None:
    model = _model("bfloat16")
    plain = keras.optimizers.Adam()
    with pytest.warns(TrainingStateWarning, match="(Adam|SGD) updates bfloat16 weights directly") as said:
        plain.build(model.trainable_variables)
        polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(), enabled=None).build(model.trainable_variables)
    assert len(said) == 2  # once for each optimizer (SGD inside polyamp's LossScaleOptimizer)
    with pytest.warns(TrainingStateWarning, match=r"PrecisionOptimizer\(SGD\) updates bfloat16"):
        _precision("params=bf16,compute=bf16,state=bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingStateWarning)
        plain.build(model.trainable_variables)  # said once for this optimizer
        for policy in ("bfloat16_kahan", "bfloat16_stochastic", "bfloat16_float32_master", "float32"):
            _precision(policy)
        keras.optimizers.Adam().build(_model("mixed_bfloat16").trainable_variables)


def test_bad_arguments_are_refused_clearly() -> None:
    with pytest.raises(PolyampTypeError, match="must be a Keras 3 optimizer"):
        polyamp_keras.PrecisionOptimizer("adam")
    with pytest.raises(PolyampTypeError, match="put the loss scaling outside"):
        polyamp_keras.PrecisionOptimizer(polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD()))
    built = keras.optimizers.SGD()
    built.build(_model("float32").trainable_variables)
    with pytest.raises(InvalidConfigError, match="already built"):
        polyamp_keras.PrecisionOptimizer(built)
    with pytest.raises(InvalidConfigError, match="use_ema"):
        polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(use_ema=True))
    with pytest.raises(InvalidConfigError, match="`seed` must be an int"):
        polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(), seed=-1)
    with pytest.raises(polyamp.InvalidPolicyError):
        polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(), "bfloat16_kahn")
    with polyamp.policy_scope("bfloat16_stochastic"):
        assert polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD()).policy.rounding == "stochastic"


# -- the other backends, in subprocesses -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_on_every_keras_backend(backend: str, run_on_keras_backend: RunOnKerasBackend) -> None:
    run_on_keras_backend(backend, HERE)


@pytest.mark.parametrize("width", [4, 4096])  # 4096 x 5 weights: TensorFlow captures them as an input, not a constant
@pytest.mark.parametrize("policy", ["bfloat16_float32_master", "bfloat16_kahan", "bfloat16_stochastic"])
def test_fit_compiles_the_first_step_with_the_optimizer_built_inside_it(policy: str, width: int) -> None:
    """model.fit with jit_compile (XLA on TensorFlow, jax.jit on JAX) builds the optimizer while tracing its first
    step; the master copies start from the weights all the same, however large."""
    if BACKEND == "torch":
        pytest.skip("Keras on torch has no jit_compile for model.fit")
    model = _model(policy, width=width)
    before = [_f32(v) for v in model.trainable_variables]
    optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.SGD(0.0), policy)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    model.fit(np.ones((8, 5), "float32"), np.ones((8, width), "float32"), verbose=0, batch_size=8)
    after = [_f32(v) for v in model.trainable_variables]
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))  # lr 0: nothing moved
    masters = [_f32(v) for v in optimizer.master_variables]
    if policy == "bfloat16_float32_master":
        assert len(masters) == 2 and all(np.array_equal(m, b) for m, b in zip(masters, before, strict=True))
    else:
        assert masters == []
