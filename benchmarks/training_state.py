"""Target ``training-state``: what a training-state plan does to memory, loss and step time.

A small GPT language model (2 layers, width 64, 4 heads, vocabulary 64, sequences of 64 tokens, batch 32) learns
sequences from a fixed random second-order Markov chain (each pair of tokens has 8 possible successors with
Dirichlet(0.3) probabilities). AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices), peak learning
rate 1e-3, 5% linear warmup, cosine decay to 10%, 3000 steps, 2 seeds. Each plan trains the same model from the
same initial weights on the same batches.

The peak learning rate is 1e-3 because of how this model learns the chain: the loss sits near the chain's
first-order entropy until the attention learns to look at the token before the previous one, then falls towards
the chain's entropy. At 1e-3 that transition comes near step 1200, and most of the loss is made in the decaying
part of the schedule, where bfloat16 with nearest rounding loses its updates: the effect the plans are for. At
3e-4 this model (GPT-2 initialisation, normal 0.02) does not reach the transition within 3000 steps, every plan
ends on the same plateau (float32 master 3.78 nats, nearest 1.03x that), and the benchmark shows nothing.

* ``bfloat16_float32_master``: bfloat16 weights and compute, a float32 master copy and float32 moments (the
  reference: what mixed precision keeps today, 16 bytes per parameter);
* ``bfloat16``: pure bfloat16, updates rounded to nearest (8 bytes; small updates round away);
* ``bfloat16_stochastic``: pure bfloat16, stochastic rounding (8 bytes);
* ``bfloat16_kahan``: pure bfloat16, Kahan-compensated updates (10 bytes).

Reported per backend and plan: bytes per parameter of the training state counted from the actual tensors
(weights, gradients, master copies, moments, compensation buffers), the final loss (mean of the last 5% of
steps, averaged over seeds) relative to the float32-master plan's, and the step time relative to it; the loss
curves are drawn to ``training-state.png``. Each backend runs in its own process
(``--backend torch|jax|keras-tensorflow|keras-jax|keras-torch``; ``all`` runs each in turn).

The chain, the batches, the initial weights (drawn in NumPy) and the schedule are made here, once, for every
backend; the backends only build the model and step it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PLANS = ("bfloat16_float32_master", "bfloat16", "bfloat16_stochastic", "bfloat16_kahan")
REFERENCE = "bfloat16_float32_master"
BACKENDS = ("torch", "jax", "keras-tensorflow", "keras-jax", "keras-torch")
# Each backend steps on one CPU thread (torch, TensorFlow and XLA read these at start-up): the step times compare
# the plans, not the frameworks' thread pools, and two backends can run side by side on two cores.
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
# Pure bfloat16 with nearest rounding as a policy: bfloat16 weights, compute and moments, float32 loss.
POLICY_OF = {"bfloat16": "params=bfloat16,compute=bfloat16,output=float32"}


@dataclass(frozen=True)
class Config:
    layers: int = 2
    width: int = 64
    heads: int = 4
    vocab: int = 64
    sequence: int = 64
    batch: int = 32
    steps: int = 3000
    lr: float = 1e-3
    warmup: float = 0.05
    final_lr: float = 0.1  # of the peak
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    successors: int = 8
    alpha: float = 0.3
    chain_seed: int = 1234
    seeds: tuple[int, ...] = (0, 1)
    plans: tuple[str, ...] = PLANS
    score_fraction: float = 0.05
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def untimed_steps(self) -> int:
        """The first steps, left out of the step time (compilation, first allocations)."""
        return min(10, self.steps // 2)

    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): linear warmup, then cosine to ``final_lr`` x peak."""
        warm = max(1, round(self.warmup * self.steps))
        if step < warm:
            return self.lr * (step + 1) / warm
        progress = (step - warm) / max(1, self.steps - warm)
        return self.lr * (self.final_lr + (1 - self.final_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


class Chain:
    """A fixed second-order Markov chain over ``vocab`` tokens."""

    def __init__(self, config: Config) -> None:
        rng = np.random.default_rng(config.chain_seed)
        contexts = config.vocab * config.vocab
        self.successors = np.stack(
            [rng.choice(config.vocab, size=config.successors, replace=False) for _ in range(contexts)]
        )
        probabilities = rng.dirichlet(np.full(config.successors, config.alpha), size=contexts)
        self.cumulative = np.cumsum(probabilities, axis=1)
        self.cumulative[:, -1] = 1.0
        self.probabilities = probabilities
        self.config = config

    def entropy(self) -> float:
        """The chain's mean conditional entropy (nats): the best loss a model can reach, on average."""
        p = self.probabilities
        return float(np.mean(-np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=1)))

    def batches(self, seed: int) -> Iterator[np.ndarray]:
        """Endless batches of ``sequence + 1`` tokens (int32), the same for every backend given ``seed``."""
        config = self.config
        rng = np.random.default_rng(10_000 + seed)
        while True:
            tokens = np.empty((config.batch, config.sequence + 1), dtype=np.int64)
            tokens[:, :2] = rng.integers(0, config.vocab, size=(config.batch, 2))
            for t in range(2, config.sequence + 1):
                context = tokens[:, t - 2] * config.vocab + tokens[:, t - 1]
                u = rng.random(config.batch)[:, None]
                pick = (self.cumulative[context] < u).sum(axis=1)
                tokens[:, t] = self.successors[context, np.minimum(pick, config.successors - 1)]
            yield tokens.astype(np.int32)


def initial_weights(config: Config, seed: int) -> dict[str, np.ndarray]:
    """GPT-2-style initial weights (normal 0.02, residual projections scaled by 1/sqrt(2 x layers)), float32.

    Names and layouts (a backend maps them onto its modules): ``wte`` (vocab, width), ``wpe`` (sequence, width),
    per block ``h{i}.ln1.g/b``, ``h{i}.attn.w`` (width, 3 x width: x @ w), ``h{i}.attn.b``, ``h{i}.proj.w``
    (width, width), ``h{i}.proj.b``, ``h{i}.ln2.g/b``, ``h{i}.fc.w`` (width, 4 x width), ``h{i}.fc.b``,
    ``h{i}.out.w`` (4 x width, width), ``h{i}.out.b``; ``lnf.g/b``, ``head.w`` (width, vocab).
    """
    rng = np.random.default_rng(seed)
    w, v = config.width, config.vocab

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    residual = 0.02 / math.sqrt(2 * config.layers)
    weights = {"wte": normal(v, w), "wpe": normal(config.sequence, w)}
    for i in range(config.layers):
        weights |= {
            f"h{i}.ln1.g": np.ones(w, np.float32),
            f"h{i}.ln1.b": np.zeros(w, np.float32),
            f"h{i}.attn.w": normal(w, 3 * w),
            f"h{i}.attn.b": np.zeros(3 * w, np.float32),
            f"h{i}.proj.w": normal(w, w, std=residual),
            f"h{i}.proj.b": np.zeros(w, np.float32),
            f"h{i}.ln2.g": np.ones(w, np.float32),
            f"h{i}.ln2.b": np.zeros(w, np.float32),
            f"h{i}.fc.w": normal(w, 4 * w),
            f"h{i}.fc.b": np.zeros(4 * w, np.float32),
            f"h{i}.out.w": normal(4 * w, w, std=residual),
            f"h{i}.out.b": np.zeros(w, np.float32),
        }
    weights |= {"lnf.g": np.ones(w, np.float32), "lnf.b": np.zeros(w, np.float32), "head.w": normal(w, v)}
    return weights


def decayed(name: str, array: np.ndarray) -> bool:
    """Weight decay applies to the matrices (embeddings and projections), not to biases or norm gains."""
    return array.ndim >= 2


@dataclass
class Run:
    """One plan, one seed: the loss of every step, the seconds of the timed steps, the state's bytes/parameter."""

    plan: str
    seed: int
    losses: list[float]
    seconds: float
    timed_steps: int
    bytes_per_parameter: float
    breakdown: dict[str, float]


def run_steps(
    config: Config, batches: Iterator[np.ndarray], step: Callable[[np.ndarray], float]
) -> tuple[list[float], float]:
    """``step`` on each of ``config.steps`` batches: the losses it returns, and the seconds taken by the steps after
    the first ``config.untimed_steps``."""
    losses: list[float] = []
    started = 0.0
    for index in range(config.steps):
        if index == config.untimed_steps:
            started = time.perf_counter()
        losses.append(step(next(batches)))
    return losses, time.perf_counter() - started


def plan_rows(
    results: list[dict[str, Any]], cells: Callable[[dict[str, Any], dict[str, Any]], list[str]]
) -> list[list[str]]:
    """One table row per backend and plan of ``results``: the backend, the plan, then ``cells(result, values)`` of
    that backend's result and that plan's values."""
    return [
        [result["backend"], plan, *cells(result, values)]
        for result in results
        for plan, values in result["plans"].items()
    ]


def score(losses: list[float], config: Config) -> float:
    tail = max(1, round(config.score_fraction * len(losses)))
    return float(np.mean(losses[-tail:]))


Trainer = Callable[[str, int, Config, Chain], Run]


def run_backend(backend: str, config: Config, trainer: Trainer) -> dict[str, Any]:
    """Train every plan and seed with ``trainer``; the payload of one backend."""
    chain = Chain(config)
    runs: list[Run] = []
    for plan in config.plans:
        for seed in config.seeds:
            started = time.perf_counter()
            run = trainer(plan, seed, config, chain)
            print(
                f"{backend:<16} {plan:<24} seed {seed}: final loss {score(run.losses, config):.4f}, "
                f"{run.bytes_per_parameter:.2f} B/param, {run.seconds / max(1, run.timed_steps) * 1e3:.2f} ms/step "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            runs.append(run)
    return summarize(backend, config, chain, runs)


def summarize(backend: str, config: Config, chain: Chain, runs: list[Run]) -> dict[str, Any]:
    plans: dict[str, Any] = {}
    for plan in config.plans:
        mine = [run for run in runs if run.plan == plan]
        plans[plan] = {
            "final_loss": float(np.mean([score(run.losses, config) for run in mine])),
            "ms_per_step": float(np.mean([run.seconds / max(1, run.timed_steps) for run in mine]) * 1e3),
            "bytes_per_parameter": mine[0].bytes_per_parameter,
            "breakdown": mine[0].breakdown,
            "curve": _curve([run.losses for run in mine]),
        }
    reference = plans.get(REFERENCE)
    for values in plans.values():
        if reference is not None:
            values["loss_ratio"] = values["final_loss"] / reference["final_loss"]
            values["time_ratio"] = values["ms_per_step"] / reference["ms_per_step"]
    return {
        "backend": backend,
        "environment": _versions(backend),
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "chain_entropy": chain.entropy(),
        "plans": plans,
    }


def _versions(backend: str) -> dict[str, str]:
    import importlib.metadata

    names = {"torch": ["torch"], "jax": ["jax", "optax"]}.get(backend, ["keras", backend.removeprefix("keras-")])
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _curve(all_losses: list[list[float]], points: int = 100) -> list[list[float]]:
    """Mean loss over seeds, averaged over windows: ``points`` (step, loss) pairs for the plot."""
    mean = np.mean(np.asarray(all_losses, dtype=np.float64), axis=0)
    window = max(1, len(mean) // points)
    return [[float(i + window), float(np.mean(mean[i : i + window]))] for i in range(0, len(mean), window)]


def _trainer(backend: str) -> Trainer:
    if backend == "torch":
        from benchmarks import training_state_torch

        return training_state_torch.train
    if backend == "jax":
        from benchmarks import training_state_jax

        return training_state_jax.train
    from benchmarks import training_state_keras

    return training_state_keras.train


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False, sharey=True)
    for ax, result in zip(axes[0], results, strict=True):
        for plan, values in result["plans"].items():
            steps, losses = zip(*values["curve"], strict=True)
            ax.plot(steps, losses, label=f"{plan} ({values.get('loss_ratio', 1):.3f}x)")
        ax.axhline(result["chain_entropy"], color="grey", linestyle=":", linewidth=1, label="chain entropy")
        ax.set_title(result["backend"])
        ax.set_xlabel("step")
        ax.set_ylim(result["chain_entropy"] - 0.05, None)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("training loss (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The ``training-state`` target: each backend in its own process, then one payload and the plot."""
    backends = BACKENDS if args.backend == "all" else tuple(args.backend.split(","))
    out = Path(args.out)
    results = []
    for backend in backends:
        part = out / f"training-state-{backend}.part.json"
        command = [sys.executable, "-m", "benchmarks.training_state", backend, str(part), "--seeds", args.seeds]
        if args.steps:
            command += ["--steps", str(args.steps)]
        if args.quick:
            command.append("--quick")
        env = dict(os.environ, **ONE_THREAD)
        if backend.startswith("keras-"):
            env["KERAS_BACKEND"] = backend.removeprefix("keras-")
        print("::", " ".join(command[3:]), flush=True)
        subprocess.run(command, check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        results.append(json.loads(part.read_text()))  # (the part stays until the result is written)
    earlier = out / "training-state.json"
    if not args.quick and earlier.exists():  # backends measured before, in other runs, are kept
        ran = {result["backend"] for result in results}
        kept = [r for r in json.loads(earlier.read_text()).get("raw") or [] if r["backend"] not in ran]
        results = sorted(kept + results, key=lambda r: BACKENDS.index(r["backend"]))
    return payload(results, out, quick=bool(args.quick))


def payload(results: list[dict[str, Any]], out: Path, *, quick: bool) -> dict[str, Any]:
    """The target's JSON for the per-backend ``results`` (and, for a full run, the plot in ``out``)."""
    notes = []
    if not quick:
        try:
            plot(results, out / "training-state.png")
        except ImportError:
            notes.append("plot not drawn: matplotlib is not installed (pip install matplotlib)")
    from benchmarks import _common

    def cells(result: dict[str, Any], values: dict[str, Any]) -> list[str]:
        return [
            ",".join(map(str, result["config"]["seeds"])),
            f"{values['bytes_per_parameter']:.2f}",
            f"{values['final_loss']:.4f}",
            _common.fmt_ratio(values["loss_ratio"]),
            _common.fmt_ms(values["ms_per_step"]),
            _common.fmt_ratio(values["time_ratio"]),
        ]

    rows = plan_rows(results, cells)
    config = Config()
    return _common.result(
        "training-state",
        "Training-state plans: AdamW on a small GPT, bfloat16 weights (CPU)",
        quick=quick,
        env=_common.environment("cpu"),
        tables=[
            {
                "caption": "Bytes per parameter of the training state counted from the tensors; final loss = mean of "
                "the last 5% of steps over the seeds; ratios against bfloat16 weights with a float32 master copy "
                "(loss, and step time measured in the same process)",
                "columns": [
                    "backend",
                    "plan",
                    "seeds",
                    "bytes/param",
                    "final loss",
                    "vs float32 master",
                    "ms/step",
                    "time vs",
                ],
                "rows": rows,
            }
        ],
        notes=[
            f"{config.layers}-layer GPT, width {config.width}, {config.heads} heads, vocabulary {config.vocab}, "
            f"sequence {config.sequence}, batch {config.batch}; AdamW betas {config.betas}, weight decay "
            f"{config.weight_decay} on matrices, peak lr {config.lr}, {config.warmup:.0%} warmup, cosine to "
            f"{config.final_lr:.0%}; data: a second-order Markov chain, {config.successors} successors per context, "
            f"Dirichlet({config.alpha}); entropy {results[0]['chain_entropy']:.4f} nats (the best loss reachable). "
            "Each backend steps on one CPU thread."
            if results
            else "",
            *notes,
        ],
        raw=results,
    )


def _config(steps: int | None, seeds: str, quick: bool) -> Config:
    chosen = tuple(int(s) for s in seeds.split(","))
    if quick:
        return Config(steps=steps or 20, seeds=chosen[:1])
    return Config(steps=steps or Config.steps, seeds=chosen)


def main(argv: list[str] | None = None) -> int:
    """One backend, in this process: ``python -m benchmarks.training_state BACKEND OUT.json``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_state")
    parser.add_argument("backend", choices=BACKENDS)
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    config = _config(args.steps, args.seeds, args.quick)
    payload = run_backend(args.backend, config, _trainer(args.backend))
    Path(args.out).write_text(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
