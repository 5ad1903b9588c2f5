"""Target: ``model.fit`` on Keras's JAX and PyTorch backends, polyamp's LossScaleOptimizer against Keras's own.

The same model (4 x (Dense gelu + LayerNorm), width 64 and batch 32, and width 1024 and batch 256, sparse
cross-entropy on float32 logits), the same inner Adam, the ``mixed_float16`` policy. Keras picks its backend once
per process, so each backend and model runs in a worker process of its own (``KERAS_BACKEND``); in it, one epoch
per variant per round, the variants interleaved in a new random order each round. A second Keras model built
like the first (A/A) shows what two identical runs differ by. Keras's JAX backend compiles the train step
(``jax.jit``); its PyTorch backend runs it eagerly, as ``fit`` does by default there. TensorFlow's numbers are the
``keras`` target's.

Run: python benchmarks/run.py keras-backends [--quick] [--rounds 11]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KERAS = "Keras LossScaleOptimizer"
AGAIN = "Keras again (A/A)"
POLYAMP = "polyamp LossScaleOptimizer"
VARIANTS = (KERAS, AGAIN, POLYAMP)
BACKENDS = ("jax", "torch")
ROOT = Path(__file__).resolve().parent.parent


def _worker(rounds: int, steps: int, width: int = 64, batch: int = 32) -> dict[str, list[float]]:
    """In a process whose KERAS_BACKEND is set: ms per step of each variant, one value per round."""
    import polyamp
    from benchmarks import _common

    polyamp.set_policy("mixed_float16")
    import keras
    import numpy as np

    import polyamp_keras

    depth = 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    y = rng.integers(0, width, size=(steps * batch,)).astype("int32")
    models = {}
    for name in VARIANTS:
        keras.utils.set_random_seed(0)
        layers: list[Any] = [keras.Input((width,))]
        for _ in range(depth):
            layers += [keras.layers.Dense(width, activation="gelu"), keras.layers.LayerNormalization()]
        layers.append(keras.layers.Activation("linear", dtype="float32"))
        model = keras.Sequential(layers)
        inner = keras.optimizers.Adam(1e-4)
        optimizer = (
            keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0**16)
            if name != POLYAMP
            else polyamp_keras.LossScaleOptimizer(inner)
        )
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # trace, compile, build
        models[name] = model
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for names in _common.round_orders(VARIANTS, rounds):
        for name in names:
            start = time.perf_counter()
            models[name].fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def run(args: Any) -> dict[str, Any]:
    from benchmarks import _common

    rounds = 1 if args.quick else args.rounds
    # (width, batch, steps per epoch): the small model, where per-step overhead shows, and a wide one, where the
    # work on the gradients does
    shapes = [(64, 32, 2)] if args.quick else [(64, 32, 100), (1024, 256, 10)]
    rows, interval_rows, raw = [], [], []
    missing = [backend for backend in BACKENDS if importlib.util.find_spec(backend) is None]
    for backend, (width, batch, steps) in [(b, shape) for b in BACKENDS if b not in missing for shape in shapes]:
        model = f"4 x (Dense {width} gelu + LayerNorm), batch {batch}"
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        code = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks import keras_backends as k; "
        code += f"print('RESULT', json.dumps(k._worker({rounds}, {steps}, {width}, {batch})))"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"the {backend} worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        times = json.loads(lines[-1][len("RESULT ") :])
        summary = _common.summarize(times, KERAS)
        keras_rate = 1e3 / summary[KERAS]["median_ms"]
        ours_rate = 1e3 / summary[POLYAMP]["median_ms"]
        rows.append(
            [
                backend,
                model,
                f"{keras_rate:.1f}",
                f"{ours_rate:.1f}",
                _common.fmt_ratio(summary[POLYAMP]["ratio"]),
                _common.fmt_ratio(summary[AGAIN]["ratio"]),
            ]
        )
        interval_rows.append([backend, model, *_common.fmt_intervals(summary, (AGAIN, POLYAMP))])
        raw.append(
            {"backend": backend, "model": model, "steps_per_epoch": steps, "summary": summary, "times_ms": times}
        )
        print(backend, model, {k: round(v["ratio"], 3) for k, v in summary.items()}, flush=True)
    notes = [
        f"Steps per epoch: {', '.join(f'{s} at width {w}' for w, _, s in shapes)}; {rounds} interleaved rounds; "
        "ratio: median over rounds of (the variant's epoch time / Keras's in the same round), the variants in a new "
        "random order each round. Wall time.",
        f"{AGAIN}: a second Keras model built like the first; its ratio is what two identical runs differ by. A "
        "ratio is 1.00x within noise when its interval overlaps the A/A interval.",
    ]
    if missing:
        notes.append(f"Not installed, so not measured: {', '.join(missing)}.")
    return _common.result(
        "keras-backends",
        "model.fit on Keras's JAX and PyTorch backends: polyamp vs keras.mixed_precision.LossScaleOptimizer",
        quick=args.quick,
        env=_common.environment("cpu", threads=None),
        tables=[
            {
                "caption": "model.fit, mixed_float16, inner Adam: steps/s, and polyamp's time ratio",
                "columns": [
                    "Keras backend",
                    "model",
                    "Keras LSO steps/s",
                    "polyamp LSO steps/s",
                    "polyamp time ratio",
                    AGAIN,
                ],
                "rows": rows,
            },
            {
                "caption": "95% bootstrap intervals of the median ratios above (2000 resamplings of the rounds)",
                "columns": ["Keras backend", "model", AGAIN, "polyamp time ratio"],
                "rows": interval_rows,
            },
        ],
        notes=notes,
        raw=raw,
    )
