"""Target: the same step timed on two revisions of polyamp in one run (did a change slow the step down?).

Each revision is exported with ``git archive`` into a temporary folder and imported by a worker process of
its own (``PYTHONPATH`` = that folder and its backends). The driver sends both workers the same commands
and interleaves them: in each round every worker times ``--steps`` iterations of every variant, so drift of
the machine hits both revisions alike. Variants, from identical initial weights:

* ``GradScaler``: ``torch.autocast("cpu", dtype=torch.float16)`` + ``torch.amp.GradScaler("cpu")`` (the
  native step, the same code in both workers: the noise floor);
* ``polyamp scaler``: the same region + ``polyamp.LossScaler(enabled=True)``, i.e. the loss-scaler code
  of the revision;
* ``TensorFlow tape``: a ``tf.function`` GradientTape step with ``polyamp.LossScaler(enabled=True)``
  (``scale`` / ``apply_gradients``), when TensorFlow is installed;
* ``Keras optimizer``: the same step through ``polyamp_keras.LossScaleOptimizer`` (``scale_loss`` /
  ``apply``), when TensorFlow is installed.

Reported, per variant: the median over rounds of (head time / base time); 1.00 is no change. The native
variant runs the same code in both workers, so its ratio shows the noise between the two processes. Also each
revision's own polyamp/native ratio, measured within one process.

    python benchmarks/run.py revisions --range 3609599..2844bdc --range 2844bdc..HEAD
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time, os
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
import polyamp
root = os.environ["BENCH_ROOT"]
assert polyamp.__file__.startswith(root), (polyamp.__file__, root)
width, depth, optimizer = int(os.environ["BENCH_WIDTH"]), 4, os.environ["BENCH_OPTIMIZER"]

def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)

def make_opt(params):
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3, fused=optimizer == "adam_fused")

x = torch.randn(32, width)
y = torch.randint(0, width, (32,))

def torch_step(scaler):
    m = model()
    opt = make_opt(m.parameters())
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step

steps = {
    "GradScaler": torch_step(torch.amp.GradScaler("cpu")),
    "polyamp scaler": torch_step(polyamp.LossScaler(enabled=True)),
}
if os.environ.get("BENCH_TF") == "1":
    import tensorflow as tf
    import polyamp_keras
    tf.keras.utils.set_random_seed(0)
    tx, ty = tf.random.normal((32, width)), tf.random.uniform((32,), 0, width, dtype=tf.int32)

    def tf_step_with(scale, apply):
        # The same tf.function GradientTape step on a dense stack of its own; scale/apply name the loop's API.
        dense = [tf.keras.layers.Dense(width) for _ in range(depth)]
        for layer in dense:
            layer.build((None, width))
        variables = [v for layer in dense for v in layer.trainable_variables]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = tx
                for layer in dense:
                    h = tf.nn.gelu(layer(h))
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(ty, h, from_logits=True))
                scaled = scale(loss)
            apply(tape.gradient(scaled, variables), variables)

        return step, variables

    tf_opt, tf_scaler = tf.keras.optimizers.SGD(0.01), polyamp.LossScaler(enabled=True)
    steps["TensorFlow tape"], _ = tf_step_with(
        tf_scaler.scale, lambda grads, variables: tf_scaler.apply_gradients(tf_opt, zip(grads, variables))
    )
    k_opt = polyamp_keras.LossScaleOptimizer(tf.keras.optimizers.SGD(0.01))
    steps["Keras optimizer"], k_variables = tf_step_with(k_opt.scale_loss, k_opt.apply)
    k_opt.build(k_variables)
for step in steps.values():
    for _ in range(20):
        step()
print(json.dumps({"ready": polyamp.__file__}), flush=True)
for line in sys.stdin:
    n = int(line)
    out = {}
    for name, step in steps.items():
        t = time.perf_counter()
        for _ in range(n):
            step()
        out[name] = (time.perf_counter() - t) / n
    print(json.dumps(out), flush=True)
"""


def _export(revision: str, into: Path) -> Path:
    """``revision``'s tracked files under ``into`` (git archive: no worktree, nothing left behind)."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    into.mkdir(parents=True)
    tar_path = into.with_suffix(".tar")
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into


def _worker(root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    paths = [str(root)] + [str(p) for p in sorted((root / "backends").glob("*")) if p.is_dir()]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), BENCH_ROOT=str(root), **env)
    process = subprocess.Popen(
        [sys.executable, "-P", "-c", WORKER],  # -P: no current folder on sys.path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=environment,
        cwd=root,
    )
    assert process.stdout is not None
    ready = json.loads(process.stdout.readline())
    assert ready["ready"].startswith(str(root)), ready
    return process


def _round(process: subprocess.Popen[str], steps: int) -> dict[str, float]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{steps}\n")
    process.stdin.flush()
    result: dict[str, float] = json.loads(process.stdout.readline())
    return result


def compare(base: str, head: str, *, width: int, optimizer: str, rounds: int, steps: int, tf: bool) -> dict[str, Any]:
    """Median per-round time ratios head/base per variant, and the revisions' own polyamp/native ratios."""
    env = {"BENCH_WIDTH": str(width), "BENCH_OPTIMIZER": optimizer, "BENCH_TF": "1" if tf else "0"}
    with tempfile.TemporaryDirectory() as folder:
        roots = {name: _export(rev, Path(folder) / name) for name, rev in (("base", base), ("head", head))}
        workers = {name: _worker(root, env) for name, root in roots.items()}
        try:
            times: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            for index in range(rounds):
                order = ("base", "head") if index % 2 == 0 else ("head", "base")
                for name in order:
                    times[name].append(_round(workers[name], steps))
        finally:
            for process in workers.values():
                assert process.stdin is not None
                process.stdin.close()
                process.wait(timeout=60)
    variants = list(times["base"][0])
    ratios = {
        v: statistics.median(h[v] / b[v] for h, b in zip(times["head"], times["base"], strict=True)) for v in variants
    }
    own = {
        name: statistics.median(r["polyamp scaler"] / r["GradScaler"] for r in times[name]) for name in ("base", "head")
    }
    medians = {name: {v: statistics.median(r[v] for r in times[name]) * 1e6 for v in variants} for name in times}
    return {"head_over_base": ratios, "polyamp_over_native": own, "median_us": medians}


def run(args: Any) -> dict[str, Any]:
    """The ``revisions`` target of benchmarks/run.py: one table per ``--range BASE..HEAD``."""
    from benchmarks import _common

    ranges = args.range or ["HEAD~1..HEAD"]
    widths = [16] if args.quick else [int(w) for w in args.widths.split(",")]
    optimizers = ["sgd"] if args.quick else args.optimizers.split(",")
    rounds, steps = (2, 2) if args.quick else (args.rounds, args.steps)
    with_tf = not args.quick and importlib.util.find_spec("tensorflow") is not None
    tables, raw = [], []
    for revision_range in ranges:
        base, _, head = revision_range.partition("..")
        rows = []
        for width in widths:
            for optimizer in optimizers:
                tf = with_tf and optimizer == "sgd"
                result = compare(
                    base, head or "HEAD", width=width, optimizer=optimizer, rounds=rounds, steps=steps, tf=tf
                )
                ratios, own, medians = result["head_over_base"], result["polyamp_over_native"], result["median_us"]
                rows.append(
                    [
                        f"4 x (Linear {width} + LayerNorm + GELU)" if optimizer == optimizers[0] else "",
                        optimizer,
                        f"{medians['base']['polyamp scaler'] / 1000:.3f}",
                        f"{medians['head']['polyamp scaler'] / 1000:.3f}",
                        _common.fmt_ratio(ratios["GradScaler"]),
                        _common.fmt_ratio(ratios["polyamp scaler"]),
                        _common.fmt_ratio(ratios["TensorFlow tape"]) if "TensorFlow tape" in ratios else "-",
                        _common.fmt_ratio(own["base"]),
                        _common.fmt_ratio(own["head"]),
                    ]
                )
                raw.append({"range": revision_range, "width": width, "optimizer": optimizer, **result})
                print(revision_range, width, optimizer, {k: round(v, 3) for k, v in ratios.items()}, flush=True)
        tables.append(
            {
                "caption": f"{base} -> {head or 'HEAD'}",
                "columns": [
                    "model",
                    "optimizer",
                    "polyamp ms (base)",
                    "polyamp ms (head)",
                    "native head/base",
                    "polyamp scaler head/base",
                    "TF tape head/base",
                    "polyamp/native (base)",
                    "polyamp/native (head)",
                ],
                "rows": rows,
            }
        )
    notes = [
        f"Each revision in its own worker process (git archive), {rounds} interleaved rounds of {steps} steps per "
        "variant; ratios are medians over rounds. The native column runs identical code in both workers: its "
        "spread is the noise between two processes.",
        "float16 torch.autocast region in every variant, so only the loss-scaler code differs between revisions.",
    ]
    return _common.result(
        "revisions",
        "The same training step on two revisions (did a change slow the step down?)",
        quick=args.quick,
        env=_common.environment("cpu", threads=2),
        tables=tables,
        notes=notes,
        raw=raw,
    )
