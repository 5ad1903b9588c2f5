"""FP8 training on Keras 3: `polyamp_keras.apply_policy` under an FP8 recipe, on every Keras backend.

Delayed scaling is compared bit for bit with Keras's own ``quantize("float8")`` training run side by side (the
same variables after the same steps, in ``fit`` and in a custom loop); the dynamic recipes' casts with the
reference quantizer, and their matmuls with a float64 product of the reference's dequantized values. The
tests run on this process's Keras backend; `test_on_every_keras_backend` runs the module again on JAX and
PyTorch in subprocesses.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
ml_dtypes = pytest.importorskip("ml_dtypes")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp import Float8Recipe, InvalidPolicyError, PolyampValueError  # noqa: E402
from polyamp._src import float8_reference as ref  # noqa: E402
from polyamp_keras import _float8  # noqa: E402
from polyamp_keras.testing import apply, gradients, keras_backend  # noqa: E402

if TYPE_CHECKING:
    from conftest import RunOnKerasBackend

ops = keras.ops
BACKEND = keras_backend()
HERE = Path(__file__).resolve()
HISTORY = 16  # a short amax history keeps the runs fast; both sides get it
QuantizedFloat8DTypePolicy = keras.dtype_policies.QuantizedFloat8DTypePolicy


def _numpy(value: Any) -> np.ndarray:
    return np.array(ops.convert_to_numpy(value))


def _mlp(seed: int, einsum: bool = False) -> Any:
    keras.utils.set_random_seed(seed)
    first = (
        keras.layers.EinsumDense("ab,bc->ac", output_shape=32, bias_axes="c", activation="relu")
        if einsum
        else keras.layers.Dense(32, activation="relu")
    )
    return keras.Sequential([keras.Input((16,)), first, keras.layers.Dense(16)])


def _keras_float8(model: Any, base: str, length: int = HISTORY) -> Any:
    """``model`` under Keras's own float8 training: each layer given ``float8_from_<base>`` (its quantize)."""
    for layer in model.layers:
        layer.dtype_policy = QuantizedFloat8DTypePolicy("float8", source_name=base, amax_history_length=length)
    return model


def _data(seed: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype("float32"), rng.normal(size=(n, 16)).astype("float32")


def _weights(model: Any) -> dict[str, np.ndarray]:
    """The variables by layer index and name (``0/inputs_scale``)."""
    return {f"{i}/{v.name}": _numpy(v) for i, layer in enumerate(model.layers) for v in layer.weights}


def _assert_bitwise(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        assert np.array_equal(np.atleast_1d(ours[name]).view(np.uint8), np.atleast_1d(theirs[name]).view(np.uint8)), (
            name
        )


def _pair(base: str, einsum: bool = False, spec: str | None = None) -> tuple[Any, Any]:
    """Keras's float8 model and polyamp's, from the same initial weights, under ``base``."""
    with polyamp.policy_scope(base):
        theirs = _keras_float8(_mlp(3, einsum), base)
        ours = _mlp(3, einsum)
    policy = f"{base}+{spec or f'float8_delayed[amax_history_length={HISTORY}]'}"
    return theirs, polyamp_keras.apply_policy(ours, policy)


def _inner(model: Any) -> Any:
    """The model inside an `apply_policy` result (Sequential models get an output cast around them)."""
    return model.layers[0]


# -- delayed scaling: Keras's quantize("float8"), bit for bit --------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "base"),
    [
        ("jit", "mixed_bfloat16"),
        ("eager", "float32"),
        pytest.param("jit", "float32", marks=pytest.mark.slow),
        pytest.param("eager", "mixed_bfloat16", marks=pytest.mark.slow),
    ],
)
def test_delayed_fit_is_keras_float8_bitwise(base: str, mode: str) -> None:
    theirs, ours = _pair(base)
    x, y = _data(0)
    jit = mode == "jit" and BACKEND != "torch"
    for model in (theirs, ours):
        # Keras's own float8 layers fail in TensorFlow's eager mode (its custom gradient reads variables that
        # TensorFlow then asks gradients for): there they run in a graph without XLA, the kernels eager uses.
        eager = mode == "eager" and not (model is theirs and BACKEND == "tensorflow")
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=jit, run_eagerly=eager)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert all(isinstance(layer, polyamp_keras.Float8Dense) for layer in _inner(ours).layers)
    assert _numpy(_inner(ours).layers[0].inputs_amax_history).shape == (HISTORY,)
    _assert_bitwise(_weights(_inner(ours)), _weights(theirs))
    assert _numpy(_inner(ours).layers[1].outputs_grad_scale) != 1.0  # the scales moved


def _sgd_step(model: Any) -> Any:
    """``step(x, y)``: one SGD step of ``model`` on the mean squared error, in a custom loop."""
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    variables = list(model.trainable_variables)

    def step(xb: Any, yb: Any) -> None:
        loss_fn = lambda: ops.mean(ops.square(ops.cast(model(xb, training=True), "float32") - yb))  # noqa: E731
        _, grads = gradients(loss_fn, variables, optimizer, scaled=False)
        apply(optimizer, list(grads), variables)

    return step


@pytest.mark.parametrize("base", ["float32", "mixed_bfloat16"])
def test_delayed_custom_loop_is_keras_float8_bitwise_on_einsum_dense(base: str) -> None:
    theirs, ours = _pair(base, einsum=True)
    assert isinstance(_inner(ours).layers[0], polyamp_keras.Float8EinsumDense)
    x, y = _data(1)
    for model in (theirs, _inner(ours)):
        step = _sgd_step(model)
        if BACKEND == "tensorflow" and model is theirs:
            # Keras's float8 layers run only in a graph on TensorFlow (see the fit test); ours run eagerly.
            step = sys.modules["tensorflow"].function(step)
        for i in range(3):
            step(ops.convert_to_tensor(x[16 * i : 16 * i + 16]), ops.convert_to_tensor(y[16 * i : 16 * i + 16]))
    _assert_bitwise(_weights(_inner(ours)), _weights(theirs))


def test_delayed_gradient_tape_in_xla_function_is_keras_float8_bitwise() -> None:
    if BACKEND != "tensorflow":
        pytest.skip("a tf.GradientTape loop is TensorFlow's")
    tf = sys.modules["tensorflow"]
    theirs, ours = _pair("mixed_bfloat16")
    x, y = _data(6)
    for model in (theirs, _inner(ours)):
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)

        @tf.function(jit_compile=True)
        def step(xb: Any, yb: Any, model: Any = model, optimizer: Any = optimizer) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(xb, training=True), "float32") - yb))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        for i in range(3):
            step(tf.constant(x[16 * i : 16 * i + 16]), tf.constant(y[16 * i : 16 * i + 16]))
    _assert_bitwise(_weights(_inner(ours)), _weights(theirs))


def test_delayed_casts_scale_in_the_compute_dtype_as_keras_does() -> None:
    # Keras's quantize_and_dequantize divides in the compute dtype: under bfloat16 the scale is rounded to
    # bfloat16 and the quotient too, so a float32 scaling (the core's default) casts some values differently.
    rng = np.random.default_rng(7)
    x = rng.normal(size=(64, 64)).astype(ml_dtypes.bfloat16)
    scale = np.float32(0.0123457)
    theirs = _numpy(
        keras.quantizers.quantize_and_dequantize(ops.convert_to_tensor(x), scale, "float8_e4m3fn", "bfloat16")
    )
    ours = ref.quantize(x, scale, "e4m3", divide=True, dtype="bfloat16").astype(ml_dtypes.bfloat16) * np.asarray(
        scale, ml_dtypes.bfloat16
    )
    assert np.array_equal(ours.view(np.uint16), theirs.view(np.uint16))
    wide = ref.quantize(x, scale, "e4m3", divide=True).astype(ml_dtypes.bfloat16) * np.asarray(
        scale, ml_dtypes.bfloat16
    )
    assert not np.array_equal(wide.view(np.uint16), theirs.view(np.uint16))


def test_delayed_state_interchanges_with_keras_checkpoints(tmp_path: Path) -> None:
    # Ported from Keras's dense_test `test_quantize_float8_fitting`: saved, reloaded, weights loaded into a
    # model Keras quantized itself, and the training goes on bit for bit after the reload.
    theirs, ours = _pair("float32")
    x, y = _data(2)
    ours.compile(optimizer="sgd", loss="mse")
    ours.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = tmp_path / "fp8.keras"
    ours.save(path)
    loaded = keras.models.load_model(path)
    assert all(isinstance(layer, polyamp_keras.Float8Dense) for layer in _inner(loaded).layers)
    assert (
        _inner(loaded).layers[0].float8_recipe
        == polyamp.Policy(f"float8_delayed[amax_history_length={HISTORY}]").float8
    )
    _assert_bitwise(_weights(_inner(loaded)), _weights(_inner(ours)))
    np.testing.assert_array_equal(_numpy(loaded.predict(x, verbose=0)), _numpy(ours.predict(x, verbose=0)))
    for model in (ours, loaded):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    _assert_bitwise(_weights(_inner(loaded)), _weights(_inner(ours)))

    weights = tmp_path / "fp8.weights.h5"
    _inner(ours).save_weights(weights)
    theirs.load_weights(weights)
    _assert_bitwise(_weights(theirs), _weights(_inner(ours)))


def test_delayed_training_false_changes_nothing() -> None:
    # Ported from Keras's dense_test `test_quantize_float8_inference`.
    _, ours = _pair("float32")
    x, _ = _data(3)
    layer = _inner(ours).layers[0]
    before = _weights(_inner(ours))
    np.testing.assert_array_equal(_numpy(layer(x, training=False)), _numpy(layer(x, training=True)))
    _assert_bitwise(_weights(_inner(ours)), before)


def test_delayed_honours_margin_and_most_recent_amax() -> None:
    # Keras has no margin; the next scale follows the reference's delayed step on the same history.
    _, ours = _pair("float32", spec="float8_delayed[amax_history_length=4,margin=2,amax_compute=most_recent]")
    layer = _inner(ours).layers[0]
    x, y = _data(4, 16)
    ours.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=True)
    history, scale = np.zeros(4, np.float32), np.float32(1.0)
    for _ in range(3):
        kernel = _numpy(layer.kernel)
        ours.train_on_batch(x, y)
        _, scale, history = ref.delayed_step(kernel, history, scale, "e4m3", margin=2, amax_compute="most_recent")
    np.testing.assert_array_equal(_numpy(layer.kernel_amax_history), history)
    assert _numpy(layer.kernel_scale) == scale


@pytest.mark.skipif(BACKEND == "jax", reason="mixed_float16 loss scaling is covered on TensorFlow and PyTorch")
def test_delayed_composes_with_loss_scale_optimizer() -> None:
    theirs, ours = _pair("mixed_float16")
    x, y = _data(5)
    for model in (theirs, ours):
        model.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    _assert_bitwise(_weights(_inner(ours)), _weights(theirs))
    assert ours.optimizer.scale_loss(1.0) is not None
    assert float(_numpy(_inner(ours).layers[1].outputs_grad_scale)) not in (0.0, 1.0)


@pytest.mark.parametrize("recipe", ["float8_tensorwise", "float8_rowwise"])
def test_dynamic_recipes_compose_with_a_training_state_plan(recipe: str) -> None:
    # bfloat16 kernels cast to FP8 each step, stepped by the plan's PrecisionOptimizer (Kahan writes).
    x, y = _data(5)
    with polyamp.policy_scope("bfloat16_kahan"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(128, activation="gelu"), keras.layers.Dense(16)]
        )
    model = polyamp_keras.apply_policy(model, f"bfloat16_kahan+{recipe}")
    dense = _inner(model).layers[0]
    assert isinstance(dense, polyamp_keras.Float8Dense) and str(dense.kernel.dtype) == "bfloat16"
    optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.Adam(1e-2), "bfloat16_kahan")
    model.compile(optimizer=optimizer, loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert len(optimizer.compensation_variables) == len(model.trainable_variables)
    assert {str(v.dtype) for v in optimizer.compensation_variables} == {"bfloat16"}


@pytest.mark.parametrize(
    "plan",
    [
        "bfloat16_kahan",
        pytest.param("bfloat16_stochastic", marks=pytest.mark.slow),
        pytest.param("bfloat16_float32_master", marks=pytest.mark.slow),
    ],
)
def test_delayed_scaling_trains_under_a_training_state_plan_with_its_scales_overwritten(plan: str) -> None:
    # PrecisionOptimizer writes delayed scaling's new scales and histories (and the cast counts) over their
    # variables, as Keras's optimizers do, and steps the rest by the plan: the same, bit for bit, as the plan's
    # optimizer over the weights alone with those variables written by hand.
    x, y = _data(5)

    def build() -> Any:
        with polyamp.policy_scope(plan):
            model = _mlp(0)
        model = polyamp_keras.apply_policy(model, f"{plan}+float8_delayed[amax_history_length=4]")
        polyamp_keras.record_float8(model)
        return model

    ours, theirs = build(), build()
    ours_variables, theirs_variables = list(ours.trainable_variables), list(theirs.trainable_variables)
    written = [bool(getattr(v, "overwrite_with_gradient", False)) for v in theirs_variables]
    stepped = [v for v, w in zip(theirs_variables, written, strict=True) if not w]
    assert sum(written) == 14  # two layers: three scales, three histories and the counts each
    mine = polyamp_keras.PrecisionOptimizer(keras.optimizers.Adam(1e-2), plan)
    reference = polyamp_keras.PrecisionOptimizer(keras.optimizers.Adam(1e-2), plan)
    mine.build(ours_variables)
    reference.build(stepped)

    def grads_of(model: Any, variables: list[Any], optimizer: Any, xb: Any, yb: Any) -> list[Any]:
        loss_fn = lambda: ops.mean(ops.square(ops.cast(model(xb, training=True), "float32") - yb))  # noqa: E731
        return list(gradients(loss_fn, variables, optimizer, scaled=False)[1])

    for start in range(0, 64, 16):
        xb, yb = ops.convert_to_tensor(x[start : start + 16]), ops.convert_to_tensor(y[start : start + 16])
        apply(mine, grads_of(ours, ours_variables, mine, xb, yb), ours_variables)
        grads = grads_of(theirs, theirs_variables, reference, xb, yb)
        for variable, grad, w in zip(theirs_variables, grads, written, strict=True):
            if w:
                variable.assign(grad)
        apply(reference, [g for g, w in zip(grads, written, strict=True) if not w], stepped)
    _assert_bitwise(_weights(ours), _weights(theirs))
    assert _numpy(_inner(ours).layers[0].inputs_scale) != 1.0  # the scales moved
    assert {str(v.dtype) for v in ours.trainable_variables if not getattr(v, "overwrite_with_gradient", False)} == {
        "bfloat16"
    }


def test_a_training_state_plan_refuses_a_low_precision_variable_overwritten_with_its_gradient() -> None:
    with polyamp.policy_scope("bfloat16_kahan"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    scale = keras.Variable(1.0, dtype="bfloat16", name="odd_scale")
    scale.overwrite_with_gradient = True
    optimizer = polyamp_keras.PrecisionOptimizer(keras.optimizers.Adam(1e-2), "bfloat16_kahan")
    with pytest.raises(polyamp.InvalidConfigError, match=r"overwrite_with_gradient .*odd_scale.* is bfloat16"):
        optimizer.build([*model.trainable_variables, scale])
    assert not optimizer.built


# -- dynamic scaling: the reference's casts, a float32 matmul ------------------------------------------------


@pytest.mark.parametrize("axis", [None, 0, -1])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dynamic_casts_equal_the_reference_bitwise(fmt: str, axis: int | None) -> None:
    rng = np.random.default_rng(8)
    x = (rng.standard_t(1.5, (32, 64)) * np.exp2(rng.integers(-20, 20, (32, 1)))).astype("float32")
    x[3] = 0.0
    cast, scale = _float8.current_cast(ops.convert_to_tensor(x), ref.fp8.FORMATS[fmt], axis, axis is not None)
    want_scale = ref.current_scale(x, fmt, axis=axis, power_of_two=axis is not None)
    np.testing.assert_array_equal(_numpy(scale), want_scale)
    want = ref.quantize(x, want_scale, fmt)
    assert np.array_equal(_numpy(ops.cast(cast, "float32")), want.astype(np.float32))


def _dequantized(a: np.ndarray, fmt: str, axis: int | None, power_of_two: bool) -> np.ndarray:
    scale = ref.current_scale(a, fmt, axis=axis, power_of_two=power_of_two)
    return ref.quantize(a, scale, fmt).astype(np.float64) * (np.float32(1.0) / scale).astype(np.float64)


@pytest.mark.parametrize("base", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("preset", ["float8_tensorwise", "float8_rowwise", "float8_rowwise_gw_hp"])
def test_dynamic_dense_forward_and_backward_follow_the_reference(preset: str, base: str) -> None:
    keras.utils.set_random_seed(0)
    model = polyamp_keras.apply_policy(
        keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, use_bias=False)]), f"{base}+{preset}"
    )
    layer = _inner(model).layers[0]
    recipe = polyamp.Policy(preset).float8
    x, _ = _data(9, 16)
    x = np.tile(x, (1, 4))
    g = np.random.default_rng(10).normal(size=(16, 32)).astype("float32")
    xt = keras.Variable(x, trainable=True, autocast=False)
    gt = ops.convert_to_tensor(g)
    loss_fn = lambda: ops.sum(ops.cast(layer(xt, training=True), "float32") * gt)  # noqa: E731
    _, (grad_kernel, grad_x) = gradients(loss_fn, [layer._kernel, xt], keras.optimizers.SGD(), scaled=False)
    out = _numpy(ops.cast(layer(x, training=True), "float32"))
    w = _numpy(layer._kernel)
    narrow = base == "mixed_bfloat16"
    xc = x.astype(ml_dtypes.bfloat16).astype(np.float32) if narrow else x
    gc = g.astype(ml_dtypes.bfloat16).astype(np.float32) if narrow else g
    row, p2, gfmt = recipe.granularity == "row", recipe.power_of_two, recipe.grad_output_format
    want_out = _dequantized(xc, "e4m3", -1 if row else None, p2) @ _dequantized(w, "e4m3", 0 if row else None, p2)
    weight_rows = row and not recipe.grad_weight_high_precision
    want_gx = (
        _dequantized(gc, gfmt, -1 if row else None, p2) @ _dequantized(w, "e4m3", 1 if weight_rows else None, p2).T
    )
    if recipe.grad_weight_high_precision:
        want_gw = xc.astype(np.float64).T @ gc.astype(np.float64)
    else:
        want_gw = _dequantized(xc, "e4m3", 0 if row else None, p2).T @ _dequantized(gc, gfmt, 0 if row else None, p2)
    # A float32 matmul of the same dequantized values, rounded to the compute dtype: within a few units in
    # the last place of that dtype of the float64 product's magnitude.
    eps = 2.0**-8 if narrow else 2.0**-20
    for got, want in ((out, want_out), (_numpy(grad_x), want_gx), (_numpy(grad_kernel), want_gw)):
        bound = eps * (np.abs(want).max() + 1.0)
        assert np.abs(got.astype(np.float64) - want).max() <= bound
    assert _numpy(grad_kernel).dtype == np.float32


# -- MX, emulated ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mx_casts_equal_the_reference_bitwise(fmt: str, rounding: str) -> None:
    recipe = polyamp.Policy(f"mxfp8[mx_rounding={rounding}]").float8
    x = (np.random.default_rng(12).normal(size=(8, 80)) * np.logspace(-45, 3, 80)).astype("float32")  # 2.5 blocks
    x[2, :32] = 0.0
    x[3, 5] = np.nan
    got = _numpy(_float8._mx_dequantized(ops.convert_to_tensor(x), ref.fp8.FORMATS[fmt], recipe, "float32"))
    want = ref._dequantized(x, fmt, recipe, None).astype(np.float32)
    nan_block = np.zeros(x.shape, bool)
    nan_block[3, :32] = True
    assert np.array_equal(got[~nan_block], want[~nan_block]) and not np.isnan(got[~nan_block]).any()
    assert np.isnan(got[nan_block]).all()  # E8M0's NaN scale makes the whole block NaN, as in polyamp_torch


def test_mx_dense_forward_and_backward_follow_the_reference() -> None:
    keras.utils.set_random_seed(0)
    model = polyamp_keras.apply_policy(
        keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, use_bias=False)]), "float32+mxfp8"
    )
    layer = _inner(model).layers[0]
    assert isinstance(layer, polyamp_keras.Float8Dense)
    rng = np.random.default_rng(13)
    x = rng.normal(size=(16, 64)).astype("float32")  # M=16: the grad-weight's blocks are zero-padded
    g = rng.normal(size=(16, 32)).astype("float32")
    xt = keras.Variable(x, trainable=True, autocast=False)
    gt = ops.convert_to_tensor(g)
    loss_fn = lambda: ops.sum(ops.cast(layer(xt, training=True), "float32") * gt)  # noqa: E731
    _, (grad_kernel, grad_x) = gradients(loss_fn, [layer._kernel, xt], keras.optimizers.SGD(), scaled=False)
    want = ref.linear(x, _numpy(layer._kernel).T, g, layer.float8_recipe)
    got = {
        "output": _numpy(layer(x, training=True)),
        "grad_input": _numpy(grad_x),
        "grad_weight": _numpy(grad_kernel).T,
    }
    for name, value in got.items():  # a float32 matmul of the reference's operands
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, want[name], rtol=0, atol=2.0**-18 * np.abs(want[name]).max(), err_msg=name)
    flat = polyamp.Policy("float32+float8_tensorwise").float8
    assert not np.allclose(ref.linear(x, _numpy(layer._kernel).T, g, flat)["output"], got["output"], rtol=0, atol=1e-6)


# -- layers built under an FP8 policy ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["float8_delayed[amax_history_length=4]", pytest.param("float8_rowwise", marks=pytest.mark.slow)]
)
def test_layers_built_under_an_fp8_policy_train_as_apply_policy_converts_them(spec: str, tmp_path: Path) -> None:
    x, y = _data(6)
    with polyamp.policy_scope(f"mixed_bfloat16+{spec}"):
        built = _mlp(0)
    with polyamp.policy_scope("mixed_bfloat16"):
        plain = _mlp(0)
    applied = polyamp_keras.apply_policy(plain, f"mixed_bfloat16+{spec}")
    recipe = polyamp.Policy(spec).float8
    assert [type(layer) for layer in built.layers] == [polyamp_keras.Float8Dense] * 2
    assert [layer.float8_recipe for layer in built.layers] == [recipe, recipe]
    steps = _sgd_step(built), _sgd_step(applied)
    for start in range(0, 48, 16):
        for step in steps:
            step(ops.convert_to_tensor(x[start : start + 16]), ops.convert_to_tensor(y[start : start + 16]))
    _assert_bitwise(_weights(built), _weights(_inner(applied)))
    # saved and loaded outside the policy, it keeps the recipe and its state
    built.save(tmp_path / "built.keras")
    loaded = keras.models.load_model(tmp_path / "built.keras")
    assert [layer.float8_recipe for layer in loaded.layers] == [recipe, recipe]
    _assert_bitwise(_weights(loaded), _weights(built))


def test_only_layers_built_under_an_fp8_policy_without_their_own_dtype_are_converted() -> None:
    with polyamp.policy_scope("mixed_bfloat16+float8_tensorwise[skip=head]"):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32)(inputs)
        own_dtype = keras.layers.Dense(32, dtype="float32")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(16, name="head")(own_dtype))
        small = keras.layers.Dense(15)  # 16 -> 15: not a multiple of 16, left in the compute dtype
        small.build((None, 16))
    with polyamp.policy_scope("mixed_bfloat16"):
        later = keras.layers.Dense(32)
        later.build((None, 16))
    assert [type(layer).__name__ for layer in model.layers[1:]] == ["Dense"] * 3
    assert [isinstance(layer, polyamp_keras.Float8Dense) for layer in model.layers[1:]] == [True, False, False]
    assert not isinstance(small, polyamp_keras.Float8Dense) and not isinstance(later, polyamp_keras.Float8Dense)

    class Block(keras.Model):  # a subclassed model: its layers are built on its first call
        def __init__(self) -> None:
            super().__init__()
            self.proj = keras.layers.Dense(32)

        def call(self, x: Any) -> Any:
            return self.proj(x)

    with polyamp.policy_scope("mixed_bfloat16+float8_tensorwise"):
        block = Block()
        block(np.zeros((2, 16), "float32"))
    assert isinstance(block.proj, polyamp_keras.Float8Dense)


def test_an_einsum_dense_built_under_a_rowwise_policy_is_refused_with_the_skip_to_write() -> None:
    with polyamp.policy_scope("mixed_bfloat16+float8_rowwise"):
        layer = keras.layers.EinsumDense("ab,bc->ac", output_shape=32, name="proj")
        with pytest.raises(InvalidPolicyError, match=r"float8_rowwise\[skip=proj\]"):
            layer.build((None, 16))


# -- which layers, and what is refused ---------------------------------------------------------------------


def test_recipe_patterns_match_the_path_within_the_model_and_odd_sizes_stay() -> None:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, name="body")(inputs)
    odd = keras.layers.Dense(10, name="odd")(hidden)
    head = keras.layers.Dense(16, name="head")(odd)
    model = polyamp_keras.apply_policy(keras.Model(inputs, head), "float8_tensorwise[skip=head]")
    kinds = {
        layer.name: isinstance(layer, polyamp_keras.Float8Dense)
        for layer in model.layers[1:]
        if layer.name != "functional_outputs"
    }
    assert kinds["body"] and not kinds["odd"] and not kinds["head"]
    again = polyamp_keras.apply_policy(model, "mixed_bfloat16")
    assert not any(isinstance(layer, polyamp_keras.Float8Dense) for layer in again.layers)


def _dense_model() -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(16)])


def test_mx_recipes_are_refused_on_einsum_dense_and_the_model_left_unchanged() -> None:
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.EinsumDense("ab,bc->ac", output_shape=32), keras.layers.Dense(32)]
    )
    with pytest.raises(InvalidPolicyError, match=r"EinsumDense layer 'einsum_dense.*'mxfp8'.*mxfp8\[skip="):
        polyamp_keras.apply_policy(model, "mxfp8")
    assert [type(layer) for layer in model.layers] == [keras.layers.EinsumDense, keras.layers.Dense]
    assert model.layers[0].dtype_policy.name == "float32"


def test_rowwise_einsum_dense_is_refused_with_the_skip_to_write() -> None:
    model = _mlp(0, einsum=True)
    with pytest.raises(InvalidPolicyError, match=r"EinsumDense layer 'einsum_dense.*float8_rowwise\[skip="):
        polyamp_keras.apply_policy(model, "float8_rowwise")
    assert type(model.layers[0]) is keras.layers.EinsumDense


def test_unbuilt_layers_are_refused() -> None:
    model = keras.Sequential([keras.layers.Dense(32)])
    with pytest.raises(PolyampValueError, match=r"not built.*Build the model first"):
        polyamp_keras.apply_policy(model, "float8_tensorwise")


def test_delayed_layers_refuse_another_recipe() -> None:
    model = polyamp_keras.apply_policy(_dense_model(), "float8_delayed")
    with pytest.raises(PolyampValueError, match=r"runs delayed FP8 scaling with Keras's float8 variables"):
        polyamp_keras.apply_policy(model, "float8_tensorwise")
    assert all(layer.float8_recipe.scaling == "delayed" for layer in _inner(model).layers)


def test_dynamic_layers_save_and_load_with_their_recipe(tmp_path: Path) -> None:
    model = polyamp_keras.apply_policy(_dense_model(), "float32+float8_rowwise")
    x, _ = _data(11)
    path = tmp_path / "rowwise.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert _inner(loaded).layers[0].float8_recipe == polyamp.Policy("float8_rowwise").float8
    np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(model(x)))


# -- delayed scaling's state dict ---------------------------------------------------------------------------


def _linear_steps(model: Any, xs: list[np.ndarray], upstreams: list[np.ndarray]) -> None:
    """Training steps of ``model`` whose output's gradient is ``upstream`` (the loss ``sum(out * upstream)``),
    the weights kept (SGD at learning rate 0): only delayed scaling's state moves."""
    optimizer = keras.optimizers.SGD(0.0)
    variables = list(model.trainable_variables)
    optimizer.build(variables)
    for x, upstream in zip(xs, upstreams, strict=True):
        xb, ub = ops.convert_to_tensor(x), ops.convert_to_tensor(upstream)

        def loss(xb: Any = xb, ub: Any = ub) -> Any:
            return ops.sum(ops.cast(model(xb, training=True), "float32") * ub)

        _, grads = gradients(loss, variables, optimizer, scaled=False)
        apply(optimizer, list(grads), variables)


def test_the_float8_state_dict_is_plain_data_that_loads_into_a_fresh_model() -> None:
    _, ours = _pair("mixed_bfloat16", spec="float8_delayed[amax_history_length=8]")
    x, y = _data(5)
    ours.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ours.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    state = polyamp_keras.float8_state_dict(ours)
    assert json.loads(json.dumps(state)) == state
    assert state["format"] == "polyamp.float8/1" and Float8Recipe.from_dict(state["recipe"]).amax_history_length == 8
    dense = _inner(ours).layers[1]
    assert list(state["layers"]) == [layer.name for layer in _inner(ours).layers]
    assert (
        state["layers"][dense.name]["grad_output"]["amax_history"] == _numpy(dense.outputs_grad_amax_history).tolist()
    )
    assert state["layers"][dense.name]["weight"]["scale"] == float(_numpy(dense.kernel_scale))

    with polyamp.policy_scope("mixed_bfloat16"):
        fresh = _mlp(4)
    resumed = polyamp_keras.apply_policy(fresh, "mixed_bfloat16+float8_delayed[amax_history_length=8]")
    for layer, source in zip(_inner(resumed).layers, _inner(ours).layers, strict=True):
        layer.kernel.assign(source.kernel)
        layer.bias.assign(source.bias)
    renamed = {new.name: state["layers"][old.name] for new, old in zip(fresh.layers, _inner(ours).layers, strict=True)}
    polyamp_keras.load_float8_state_dict(resumed, {**state, "layers": renamed})
    ours_weights = _weights(_inner(ours))
    _assert_bitwise(_weights(_inner(resumed)), ours_weights)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.update(format="other"), "format 'polyamp.float8/1'"),
        (lambda s: s["layers"].pop("second"), r"missing \['second'\], unknown \[\]"),
        (lambda s: s["layers"]["first"]["input"].update(amax_history=[0.0] * 3), "amax history of 3 values"),
        (lambda s: s["layers"]["second"]["weight"].update(scale=0.0), "finite scale > 0"),
        (lambda s: s["layers"]["second"]["grad_output"].update(scale=float("nan")), "finite scale > 0"),
    ],
)
def test_a_bad_float8_state_dict_is_refused_and_nothing_is_loaded(change: Any, match: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, name="first"), keras.layers.Dense(16, name="second")]
    )
    model = polyamp_keras.apply_policy(model, "float8_delayed[amax_history_length=4]")
    x, _ = _data(6, 16)
    _linear_steps(_inner(model), [x], [np.ones((16, 16), np.float32)])
    state = copy.deepcopy(polyamp_keras.float8_state_dict(model))
    before = _weights(_inner(model))
    state["layers"]["first"]["input"]["scale"] = 2.0  # a change that would show if anything were loaded
    change(state)
    with pytest.raises(polyamp.StateDictError, match=match):
        polyamp_keras.load_float8_state_dict(model, state)
    _assert_bitwise(_weights(_inner(model)), before)
    with pytest.raises(PolyampValueError, match="dynamic recipes keep no state"):
        polyamp_keras.float8_state_dict(polyamp_keras.apply_policy(_dense_model(), "float8_tensorwise"))


def test_a_torch_run_resumes_on_keras_bitwise() -> None:
    # The state depends on the operands only; the weights stay in the continued steps because the two
    # frameworks' FP8 matmuls round their products differently, which would move the weights apart.
    torch = pytest.importorskip("torch")
    polyamp_torch = pytest.importorskip("polyamp_torch")
    policy = "float32+float8_delayed[amax_history_length=4]"
    rng = np.random.default_rng(8)
    xs = [rng.normal(size=(16, 64)).astype(np.float32) * (30.0 if i == 4 else 1.0) for i in range(6)]
    upstreams = [rng.normal(size=(16, 32)).astype(np.float32) for _ in range(6)]
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    torch_model = polyamp_torch.apply_policy(torch.nn.Sequential(linear), policy)
    optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.1)

    def torch_step(x: np.ndarray, upstream: np.ndarray) -> None:
        optimizer.zero_grad()
        torch_model(torch.from_numpy(x)).backward(torch.from_numpy(upstream))
        optimizer.step()

    for x, upstream in zip(xs[:3], upstreams[:3], strict=True):
        torch_step(x, upstream)
    saved = polyamp_torch.float8_state_dict(torch_model)
    kernel = linear.weight.detach().numpy().T.copy()
    optimizer.param_groups[0]["lr"] = 0.0
    for x, upstream in zip(xs[3:], upstreams[3:], strict=True):
        torch_step(x, upstream)

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, use_bias=False, name="dense")])
    model = polyamp_keras.apply_policy(model, policy)
    _inner(model).layers[0].kernel.assign(kernel)
    polyamp_keras.load_float8_state_dict(model, {**saved, "layers": {"dense": saved["layers"]["0"]}})
    _linear_steps(_inner(model), xs[3:], upstreams[3:])
    expected = polyamp_torch.float8_state_dict(torch_model)
    assert polyamp_keras.float8_state_dict(model)["layers"] == {"dense": expected["layers"]["0"]}
    assert expected["layers"]["0"] != saved["layers"]["0"]  # the steps moved the state


# -- cast records: what the casts lose, counted on the device ------------------------------------------------


def _recorded(spec: str, *layers: Any) -> tuple[Any, Any]:
    """A model of ``layers`` under ``spec`` (on float32) and its `polyamp_keras.record_float8` recorder."""
    keras.utils.set_random_seed(2)
    model = polyamp_keras.apply_policy(keras.Sequential([keras.Input((64,)), *layers]), f"float32+{spec}")
    return model, polyamp_keras.record_float8(model)


def _sum_step(model: Any, x: np.ndarray) -> None:
    """One custom-loop step of SGD(0) on the sum of the outputs (each grad-output is ones)."""
    optimizer = keras.optimizers.SGD(0.0)
    variables = list(model.trainable_variables)
    optimizer.build(variables)
    _, grads = gradients(lambda: ops.sum(model(ops.convert_to_tensor(x), training=True)), variables, optimizer, False)
    apply(optimizer, list(grads), variables)


def _reference_record(
    x: np.ndarray, cast: np.ndarray, values: np.ndarray
) -> polyamp.backend_api.records.Float8CastRecord:
    return polyamp.backend_api.records.Float8CastRecord(
        int(np.sum(np.abs(values) > 448.0)),
        int(np.sum((x != 0) & (cast.astype(np.float32) == 0))),
        int(np.sum(x != 0)),
    )


def _current_record(x: np.ndarray) -> polyamp.backend_api.records.Float8CastRecord:
    """The reference counts of ``x``'s tensorwise E4M3 cast with its own scale."""
    scale = ref.current_scale(x, "e4m3")
    return _reference_record(x, ref.quantize(x, scale, "e4m3"), x * scale)


def _sum(*records: Any) -> polyamp.backend_api.records.Float8CastRecord:
    return polyamp.backend_api.records.Float8CastRecord(
        *(sum(getattr(r, field) for r in records) for field in ("saturated", "flushed", "nonzero"))
    )


def test_records_count_saturated_and_flushed_values_per_layer_and_reset_when_read() -> None:
    model, records = _recorded(
        "float8_delayed[amax_history_length=2]", keras.layers.Dense(16, use_bias=False, name="a")
    )
    x = np.random.default_rng(0).normal(size=(8, 64)).astype("float32")
    x[0, :5] = 1000.0  # past E4M3's 448 with the initial scale of 1
    x[1, :3] = 1e-12  # below E4M3's smallest subnormal: flushed
    _sum_step(model, x)
    read = records.read()
    assert list(read) == ["a"]
    assert read["a"]["input"] == polyamp.backend_api.records.Float8CastRecord(5, 3, int((x != 0).sum()))
    assert read["a"]["grad_output"] == polyamp.backend_api.records.Float8CastRecord(0, 0, 8 * 16)
    assert read["a"]["input"].flushed_fraction == 3 / int((x != 0).sum())
    assert records.read()["a"]["input"].nonzero == 0
    _sum_step(model, x)  # the next step counts from zero; the scale moved, so nothing saturates now
    assert records.read(reset=False)["a"]["input"].nonzero == int((x != 0).sum())
    assert records.read()["a"]["grad_output"].nonzero == 8 * 16


def test_records_of_current_scaling_in_fit_equal_the_reference_counts() -> None:
    model, records = _recorded("float8_tensorwise", keras.layers.Dense(32, name="a"), keras.layers.Dense(16, name="b"))
    x = (np.random.default_rng(1).normal(size=(32, 64)) * np.logspace(-30, 3, 64)).astype("float32")
    kernel = _numpy(_inner(model).layers[0].kernel)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=BACKEND != "torch")
    model.fit(x, np.zeros((32, 16), "float32"), batch_size=16, epochs=1, verbose=0, shuffle=False)
    read = records.read()
    batches = [x[:16], x[16:]]
    want = [_current_record(b) for b in batches]
    assert read["a"]["input"] == _sum(*want) and want[0].flushed > 0
    assert read["a"]["weight"] == _sum(_current_record(kernel), _current_record(kernel))  # SGD(0) kept it
    assert read["b"]["grad_output"].nonzero == 2 * 16 * 16
    assert records.read()["a"]["input"].nonzero == 0


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_records_of_mx_layers_equal_the_reference_counts(rounding: str) -> None:
    model, records = _recorded(
        f"mxfp8[mx_rounding={rounding}]", keras.layers.Dense(32, name="a"), keras.layers.Dense(32, name="b")
    )
    # whole blocks of tiny values beside large ones, all normal float32 (TensorFlow's CPU kernels flush subnormals)
    x = (np.random.default_rng(2).normal(size=(16, 64)) * np.logspace(-30, 3, 64)).astype("float32")
    _sum_step(model, x)
    exponents, cast = ref.mx_quantize(x, "e4m3", rounding=rounding)
    scale = np.exp2(exponents.astype(np.float32) - 127.0).repeat(32, axis=-1)
    expected = _reference_record(x, cast, x / scale)
    read = records.read()
    assert list(read) == ["a", "b"]
    assert read["a"]["input"] == expected and expected.flushed > 0
    if rounding == "floor":  # the OCP rule rounds the block's exponent down: its largest values saturate
        assert expected.saturated > 0
    assert read["b"]["grad_output"] == polyamp.backend_api.records.Float8CastRecord(0, 0, 16 * 32)  # sum()'s ones


def test_records_of_einsum_dense_count_each_operand() -> None:
    layer = keras.layers.EinsumDense("ab,bc->ac", output_shape=16, name="e")
    model, records = _recorded("float8_tensorwise", layer)
    x = np.random.default_rng(3).normal(size=(8, 64)).astype("float32")
    x[0, :4] = 1e-30
    _sum_step(model, x)
    read = records.read()["e"]
    assert read["input"] == _current_record(x) and read["input"].flushed >= 4
    assert read["weight"].nonzero == 64 * 16
    assert read["grad_output"] == polyamp.backend_api.records.Float8CastRecord(0, 0, 8 * 16)


def test_records_count_training_steps_only() -> None:
    model, records = _recorded("float8_rowwise", keras.layers.Dense(16, name="a"))
    x = np.ones((8, 64), "float32")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.predict(x, verbose=0)
    model.evaluate(x, np.zeros((8, 16), "float32"), verbose=0)
    assert records.read()["a"]["input"].nonzero == 0  # documented: a forward without a step counts nothing
    model.train_on_batch(x, np.zeros((8, 16), "float32"))
    assert records.read()["a"]["input"].nonzero == 8 * 64


def test_records_are_refused_once_the_optimizer_is_built_or_accumulates() -> None:
    keras.utils.set_random_seed(2)
    model = polyamp_keras.apply_policy(_dense_model(), "float32+float8_tensorwise")
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(PolyampValueError, match="gradient accumulation"):
        polyamp_keras.record_float8(model)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(np.ones((4, 16), "float32"), np.zeros((4, 16), "float32"))
    before = len(model.trainable_variables)
    with pytest.raises(PolyampValueError, match="before the first training step"):
        polyamp_keras.record_float8(model)
    assert len(model.trainable_variables) == before


def test_record_counts_carry_past_float32_integers() -> None:
    from polyamp.backend_api.rules import fp8
    from polyamp_keras._float8_counts import delivered

    DIGIT = fp8.COUNT_DIGIT
    previous = np.zeros((3, 3, 2), np.float32)
    previous[2, :, 0] = DIGIT - 1
    previous[2, :, 1] = 5
    counts = ops.convert_to_tensor(np.array([1, 2**30 + 3, 0], np.int32))
    out = _numpy(delivered(ops.convert_to_tensor(previous), {2: [counts, counts]}))
    totals = out[..., 0].astype(np.int64) + out[..., 1].astype(np.int64) * DIGIT
    start = DIGIT - 1 + 5 * DIGIT
    assert totals[2].tolist() == [start + 2, start + 2 * (2**30 + 3), start]
    assert not totals[:2].any() and (out[..., 0] < DIGIT).all()


# -- the other backends, in subprocesses -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_on_every_keras_backend(backend: str, run_on_keras_backend: RunOnKerasBackend) -> None:
    run_on_keras_backend(backend, HERE)
