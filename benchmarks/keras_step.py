"""Target: Keras 3 / TensorFlow training-step time, polyamp's loss scaling against Keras's LossScaleOptimizer.

Same model (4 x (Dense gelu + LayerNorm), sparse cross-entropy on float32 logits), same inner Adam, same
``mixed_float16`` policy; variants timed in interleaved rounds in one process:

* GradientTape step in ``tf.function`` and in ``tf.function(jit_compile=True)``:
  ``keras.mixed_precision.LossScaleOptimizer`` (``scale_loss`` + ``apply_gradients``) against
  ``polyamp_tensorflow.LossScaleOptimizer`` (same calls) and ``polyamp.LossScaler`` (``scale`` +
  ``apply_gradients(optimizer, ...)`` around a plain Adam);
* ``model.fit``: steps per second of one epoch, compiled with either LossScaleOptimizer (width 64 only);
* ``Keras again (A/A)``: a second Keras step and ``fit`` model built like the first, whose ratio is what two
  identical steps differ by in the run (the noise a ratio is judged against).

Run: python benchmarks/run.py keras [--quick] [--rounds 11]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import polyamp

polyamp.set_policy("mixed_float16")  # before any layer is built

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import polyamp_tensorflow  # noqa: E402
from benchmarks import _common  # noqa: E402

KERAS = "Keras LossScaleOptimizer"
#: A second Keras step built like the first: what two identical steps differ by in the run (the noise).
AGAIN = "Keras again (A/A)"
STEP_VARIANTS = (KERAS, AGAIN, "polyamp LossScaleOptimizer", "polyamp LossScaler")
FIT_VARIANTS = (KERAS, AGAIN, "polyamp LossScaleOptimizer")


def build(width: int, depth: int) -> Any:
    """The model, from the same seed every call."""
    keras.utils.set_random_seed(0)
    layers: list[Any] = [keras.Input((width,))]
    for _ in range(depth):
        layers += [keras.layers.Dense(width, activation="gelu"), keras.layers.LayerNormalization()]
    return keras.Sequential(layers)


def make_optimizer(variant: str) -> Any:
    inner = keras.optimizers.Adam(1e-4)
    if variant in (KERAS, AGAIN):
        return keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0**16)
    if variant == "polyamp LossScaleOptimizer":
        return polyamp_tensorflow.LossScaleOptimizer(inner)
    return inner


def make_step(variant: str, width: int, depth: int, jit: bool) -> Any:
    """A compiled GradientTape train step of the variant."""
    model = build(width, depth)
    optimizer = make_optimizer(variant)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    scaler = polyamp.LossScaler(backend="tensorflow") if variant == "polyamp LossScaler" else None

    @tf.function(jit_compile=jit)  # type: ignore[untyped-decorator]
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, tf.cast(model(x, training=True), tf.float32))
            scaled = scaler.scale(loss) if scaler is not None else optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if scaler is not None:
            scaler.apply_gradients(optimizer, zip(grads, model.trainable_variables))
        else:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def time_steps(width: int, batch: int, depth: int, jit: bool, args: argparse.Namespace) -> dict[str, Any]:
    print(f"timing GradientTape steps: width {width}, jit_compile={jit}", flush=True)
    x = tf.random.stateless_normal((batch, width), seed=(1, 2))
    y = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=width, dtype=tf.int32)
    steps = {name: make_step(name, width, depth, jit) for name in STEP_VARIANTS}

    def runner(step: Any) -> Any:
        def run() -> None:
            step(x, y)

        return run

    calls = {name: runner(step) for name, step in steps.items()}
    for call in calls.values():  # trace and compile before calibrating
        call()
    iters = 1 if args.quick else _calibrate(calls["Keras LossScaleOptimizer"], args.round_seconds)
    # On CPU a tf.function call returns once its work is done, so no explicit sync is needed.
    times = _common.interleaved(
        calls,
        iters=iters,
        rounds=2 if args.quick else args.rounds,
        warmup=1 if args.quick else 5,
        clock=_clock(args),
    )
    return {"iters_per_round": iters, "summary": _common.summarize(times, STEP_VARIANTS[0]), "times_ms": times}


def time_fit(width: int, batch: int, depth: int, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per ``model.fit`` epoch for each LossScaleOptimizer, interleaved; reported as steps/s."""
    print(f"timing model.fit: width {width}", flush=True)
    n_steps = 2 if args.quick else _fit_steps(width)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_steps * batch, width)).astype("float32")
    y = rng.integers(0, width, size=(n_steps * batch,)).astype("int32")
    models = {}
    for name in FIT_VARIANTS:
        model = build(width, depth)
        model.compile(
            optimizer=make_optimizer(name),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # trace, build
        models[name] = model
    rounds = 1 if args.quick else args.rounds
    times: dict[str, list[float]] = {name: [] for name in models}
    for names in _common.round_orders(list(models), rounds):
        for name in names:
            clock = _clock(args)
            start = clock()
            models[name].fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
            times[name].append((clock() - start) / n_steps * 1e3)
    return {"steps_per_epoch": n_steps, "summary": _common.summarize(times, STEP_VARIANTS[0]), "times_ms": times}


def _clock(args: argparse.Namespace) -> Any:
    return time.process_time if args.clock == "cpu" else time.perf_counter


def _fit_steps(width: int) -> int:
    return 100 if width <= 64 else 20


def _calibrate(call: Any, seconds: float) -> int:
    call()
    start = time.perf_counter()
    call()
    return max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu":
        # CPU time of the whole process (TensorFlow computes on its own pool threads): one thread each,
        # so the clock counts work, not waiting, on a shared machine.
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    configs = [(16, 8, 2)] if args.quick else [(512, 64, 4), (64, 32, 4)]
    step_rows: list[list[str]] = []
    fit_rows: list[list[str]] = []
    interval_rows: list[list[str]] = []
    raw: list[dict[str, Any]] = []
    for width, batch, depth in configs:
        label = f"{depth} x (Dense {width} gelu + LayerNorm), batch {batch}"
        for jit in (False, True):
            measured = time_steps(width, batch, depth, jit, args)
            summary = measured["summary"]
            compiled = "tf.function(jit_compile=True)" if jit else "tf.function"
            step_rows.append(
                [
                    label if not jit else "",
                    compiled,
                    _common.fmt_ms(summary[STEP_VARIANTS[0]]["median_ms"]),
                    *(_common.fmt_ratio(summary[name]["ratio"]) for name in STEP_VARIANTS[1:]),
                ]
            )
            interval_rows.append(
                [label if not jit else "", compiled, *_common.fmt_intervals(summary, STEP_VARIANTS[1:])]
            )
            raw.append({"kind": "gradient_tape", "width": width, "batch": batch, "jit_compile": jit, **measured})
            print(label, compiled, {k: round(v["ratio"], 3) for k, v in summary.items()}, flush=True)
        if width > 64 and not args.quick:
            continue  # fit's per-step overhead shows at width 64; a 512-wide epoch takes minutes on one thread
        measured = time_fit(width, batch, depth, args)
        summary = measured["summary"]
        keras_rate = 1e3 / summary[KERAS]["median_ms"]
        ours_rate = 1e3 / summary[FIT_VARIANTS[2]]["median_ms"]
        fit_rows.append(
            [
                label,
                f"{keras_rate:.1f}",
                f"{ours_rate:.1f}",
                _common.fmt_ratio(summary[FIT_VARIANTS[2]]["ratio"]),
                _common.fmt_ratio(summary[AGAIN]["ratio"]),
            ]
        )
        interval_rows.append([label, "model.fit", *_common.fmt_intervals(summary, STEP_VARIANTS[1:])])
        raw.append({"kind": "fit", "width": width, "batch": batch, **measured})
        print(label, "fit", {k: round(v["ratio"], 3) for k, v in summary.items()}, flush=True)
    env = _common.environment("cpu", threads=None)
    return _common.result(
        "keras",
        "Keras 3 / TensorFlow training step: polyamp vs keras.mixed_precision.LossScaleOptimizer",
        quick=args.quick,
        env=env,
        tables=[
            {
                "caption": "GradientTape train step, mixed_float16, inner Adam: median ms (Keras) and time ratios",
                "columns": ["model", "compiled with", "Keras LSO ms", *STEP_VARIANTS[1:]],
                "rows": step_rows,
            },
            {
                "caption": "model.fit, one epoch per round: steps/s, and polyamp's time ratio",
                "columns": ["model", "Keras LSO steps/s", "polyamp LSO steps/s", "polyamp time ratio", AGAIN],
                "rows": fit_rows,
            },
            {
                "caption": "95% bootstrap intervals of the median ratios above (2000 resamplings of the rounds)",
                "columns": ["model", "step", *STEP_VARIANTS[1:]],
                "rows": interval_rows,
            },
        ],
        notes=[
            "Ratios: median over interleaved rounds of (variant's time / Keras LossScaleOptimizer's in the same "
            "round). "
            + (
                "Clock: CPU time of the process, TensorFlow limited to one intra-op and one inter-op thread."
                if args.clock == "cpu"
                else "Clock: wall time, TensorFlow's default thread pools."
            ),
            f"{AGAIN}: a second Keras step (and `fit` model) built like the first; its ratio is what two identical "
            "steps differ by in this run.",
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}.",
        ],
        raw=raw,
    )
