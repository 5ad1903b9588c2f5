"""An inner Keras optimizer's ``global_clipnorm`` folded into polyamp's unscale, in ``model.fit`` and in custom
steps, against Keras's own LossScaleOptimizer over the same inner optimizer, run side by side.

polyamp's `LossScaleOptimizer` applies the inner optimizer's global-norm clip in the unscale's multiply (one
pass over the gradients instead of a division and a clipping multiply) and takes the skip from the norm; the
weights must be Keras's bit for bit (the default scales are powers of two). The tests run on this process's
Keras backend; `test_on_every_keras_backend` runs the module again in a subprocess per other backend (the
stateful ``apply`` on TensorFlow and torch, the jitted ``stateless_apply`` on JAX).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp_keras.testing import keras_backend  # noqa: E402

if TYPE_CHECKING:
    from conftest import RunOnKerasBackend

BACKEND = keras_backend()
HERE = Path(__file__).resolve()
INF_BATCHES = (3, 7)  # batches whose inputs hold an inf: every gradient is NaN there, the step is skipped


def _model(policy: str) -> Any:
    keras.utils.set_random_seed(0)
    with polyamp.policy_scope(policy):
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4, dtype="float32")]
        )


def _data(batches: int = 12, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((batches * batch, 8)) * 3).astype("float32")
    y = rng.standard_normal((batches * batch, 4)).astype("float32")
    for index in INF_BATCHES:
        x[index * batch, 0] = np.inf
    return x, y


class _ClipSpy:
    """Wraps an optimizer's ``_clip_gradients``: the ``global_clipnorm`` it saw at each call."""

    def __init__(self, optimizer: Any) -> None:
        self.seen: list[Any] = []
        original = optimizer._clip_gradients

        def spy(grads: Any) -> Any:
            self.seen.append(optimizer.global_clipnorm)
            return original(grads)

        optimizer._clip_gradients = spy


def _fit(ours: bool, policy: str, clip: float, *, jit: bool, **inner_kwargs: Any) -> tuple[list[np.ndarray], Any]:
    model = _model(policy)
    inner = keras.optimizers.Adam(1e-2, global_clipnorm=clip, **inner_kwargs)
    spy = _ClipSpy(inner)
    settings = {"initial_scale": 2.0**12, "dynamic_growth_steps": 2}
    optimizer = (
        polyamp_keras.LossScaleOptimizer(inner, **settings)
        if ours
        else keras.optimizers.LossScaleOptimizer(inner, **settings)
    )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit and BACKEND != "torch")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables], (optimizer, spy)


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", [pytest.param("float32", marks=pytest.mark.slow), "mixed_float16"])
@pytest.mark.parametrize("clip", [0.05, 1e6])  # clipping on every step / never
def test_fit_with_a_clipping_inner_optimizer_equals_keras(policy: str, clip: float, jit: bool) -> None:
    theirs, _ = _fit(False, policy, clip, jit=jit)
    ours, (optimizer, spy) = _fit(True, policy, clip, jit=jit)
    for a, b in zip(ours, theirs, strict=True):
        if clip < 1 and (BACKEND == "jax" or jit):
            # Compiled by XLA (JAX always: Keras's own wrapper runs the division, norm and clip inside a cond,
            # one XLA computation), the reduction and multiplies fuse their own way there, so the last bits differ
            # from polyamp's folded multiply done beside the cond, by a few ulps; eagerly they are the same bits.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        else:
            np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in ours)
    # The clip ran in the unscale: the inner optimizer never clipped, and its setting is back.
    assert spy.seen and all(seen is None for seen in spy.seen)
    assert optimizer.inner_optimizer.global_clipnorm == clip
    skipped = [r.iteration for r in optimizer.scaler.records() if r.skipped]
    assert skipped == list(INF_BATCHES)
    assert all(r.reason == "overflow" for r in optimizer.scaler.records() if r.skipped)


def test_a_skipped_folded_step_names_the_non_finite_gradients() -> None:
    """The folded clip makes every gradient NaN on a bad step; the records still name the ones that were."""
    model = _model("float32")
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0))
    optimizer.build(model.trainable_variables)
    grads = [keras.ops.ones(v.shape) for v in model.trainable_variables]
    grads[1] = keras.ops.where(
        keras.ops.arange(32) == 5, keras.ops.full((32,), np.inf), grads[1]
    )  # the first layer's bias
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables]
    optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))  # the iteration's loss, scaled (the gradients stand in)
    optimizer.apply(grads, model.trainable_variables)
    after = [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables]
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    record = optimizer.scaler.last_record()
    assert record is not None and record.skipped and record.reason == "overflow"
    named = [(g.name.split("/")[-1], g.inf, g.neg_inf, g.nan, g.size) for g in record.gradients]
    assert named == [("bias", 1, 0, 0, 32)]


@pytest.mark.parametrize(
    "kwargs",
    [{"clipnorm": 0.05}, {"clipvalue": 0.01}, {"global_clipnorm": 0.05, "gradient_accumulation_steps": 2}],
    ids=["clipnorm", "clipvalue", "accumulation"],
)
def test_other_clipping_stays_with_the_inner_optimizer_and_equals_keras(kwargs: dict[str, Any]) -> None:
    """Per-variable clipping, clipping by value and gradient accumulation are not folded: the inner optimizer
    clips, as under Keras's own LossScaleOptimizer."""

    def fit(ours: bool) -> tuple[list[np.ndarray], _ClipSpy]:
        model = _model("float32")
        inner = keras.optimizers.SGD(0.1, **kwargs)
        spy = _ClipSpy(inner)
        wrapper = polyamp_keras.LossScaleOptimizer if ours else keras.optimizers.LossScaleOptimizer
        model.compile(optimizer=wrapper(inner, initial_scale=2.0**12, dynamic_growth_steps=2), loss="mse")
        x, y = _data()
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables], spy

    (theirs, _), (ours, spy) = fit(False), fit(True)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert spy.seen and all(seen == kwargs.get("global_clipnorm") for seen in spy.seen)


def test_folding_decision() -> None:
    """What `folded_clip_norm` folds: a global-norm clip over dense float32 gradients, nothing else."""
    from polyamp_keras.device import folded_clip_norm

    model = _model("float32")
    variables = model.trainable_variables
    grads = [keras.ops.ones(v.shape) for v in variables]
    assert folded_clip_norm(keras.optimizers.SGD(global_clipnorm=2.0), grads, variables) == 2.0
    assert folded_clip_norm(keras.optimizers.SGD(), grads, variables) is None
    assert folded_clip_norm(keras.optimizers.SGD(clipnorm=1.0), grads, variables) is None
    assert folded_clip_norm(keras.optimizers.SGD(global_clipnorm=0.0), grads, variables) is None
    half = [keras.ops.cast(g, "float16") for g in grads]
    assert folded_clip_norm(keras.optimizers.SGD(global_clipnorm=2.0), half, variables) is None

    class OwnClipping(keras.optimizers.SGD):  # type: ignore[misc]
        def _clip_gradients(self, grads: Any) -> Any:
            return grads

    assert folded_clip_norm(OwnClipping(global_clipnorm=2.0), grads, variables) is None
    assert folded_clip_norm(keras.optimizers.SGD(global_clipnorm=2.0), [None] * len(grads), variables) is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_on_every_keras_backend(backend: str, run_on_keras_backend: RunOnKerasBackend) -> None:
    if backend == BACKEND:
        pytest.skip("this process runs that backend")
    run_on_keras_backend(backend, HERE)
