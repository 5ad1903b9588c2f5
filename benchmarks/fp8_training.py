"""The FP8 recipes against bfloat16 over a whole run: a small GPT trained for 2,000 steps on the CPU.

Each recipe (and ``"mixed_bfloat16"``, the reference) trains the same GPT (4 blocks, 128 wide, 4 heads, AdamW)
from the same weights on the same bigram-table batches, for two seeds. The result is each run's loss curve
and final loss (the mean of the last 100 steps), its ratio to the bfloat16 run of the same seed (the target
is at most 1.02), written as JSON to ``benchmarks/results/fp8-training.json`` and plotted to
``docs/assets/fp8-training.png`` for the FP8 guide.

    python benchmarks/fp8_training.py                 # 2,000 steps x 6 policies x 2 seeds
    python benchmarks/fp8_training.py --quick         # 20 steps, one seed: a smoke run

Batches are 8 sequences of 32 tokens and torch runs on one thread, so the run is reproducible and fits a
small machine: on one core of a 2-core CPU VM a step takes about 35 ms in bfloat16 and 60-95 ms under FP8
(the casts run without FP8 units), and the whole run (6 x 2 x 2,000 steps) about half an hour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import polyamp_torch  # noqa: E402
from benchmarks import _common  # noqa: E402
from benchmarks._fp8_model import GPT, bigram_batches, loss_of  # noqa: E402

POLICIES = (
    "mixed_bfloat16",
    "float8_tensorwise",
    "float8_rowwise",
    "float8_rowwise_gw_hp",
    "float8_delayed",
    "mxfp8",
)
VOCAB, WIDTH, LAYERS, HEADS, LENGTH, BATCH = 256, 128, 4, 4, 32, 8


def train(policy: str, seed: int, steps: int) -> list[float]:
    torch.manual_seed(seed)
    model = polyamp_torch.apply_policy(
        GPT(VOCAB, WIDTH, LAYERS, HEADS, LENGTH), f"{policy}[skip=head]" if "8" in policy else policy
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    draw = bigram_batches(VOCAB, BATCH, LENGTH, seed=seed)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, draw())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def plot(runs: dict[str, dict[int, list[float]]], path: Path) -> None:
    """The loss curves (mean of the seeds, 50-step average) and each recipe's ratio to the bfloat16 run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 50

    def smooth(by_seed: dict[int, list[float]]) -> list[float]:
        mean = [statistics.mean(step) for step in zip(*by_seed.values(), strict=True)]
        return [statistics.mean(mean[max(0, i - window) : i + 1]) for i in range(len(mean))]

    curves = {policy: smooth(by_seed) for policy, by_seed in runs.items()}
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    for policy, curve in curves.items():
        top.plot(curve, label=policy, linewidth=1.2)
        if policy != "mixed_bfloat16":
            ratio = [a / b for a, b in zip(curve, curves["mixed_bfloat16"], strict=True)]
            bottom.plot(ratio, label=policy, linewidth=1.0)
    bottom.axhline(1.02, color="grey", linestyle="--", linewidth=0.8, label="target 1.02")
    top.set_ylabel(f"loss (mean of seeds, {window}-step average)")
    bottom.set_ylabel("loss / bfloat16's")
    bottom.set_xlabel("step")
    top.set_title(f"GPT {LAYERS} x {WIDTH} on the CPU: FP8 recipes against bfloat16")
    top.legend()
    bottom.legend(fontsize=7, ncol=3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(_common.RESULTS))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "assets" / "fp8-training.png"))
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 20 if args.quick else args.steps
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, list[float]]] = {policy: {} for policy in POLICIES}
    seconds: dict[str, float] = {}
    for policy in POLICIES:
        start = time.perf_counter()
        for seed in seeds:
            runs[policy][seed] = train(policy, seed, steps)
            print(policy, seed, round(statistics.mean(runs[policy][seed][-100:]), 4), flush=True)
        seconds[policy] = time.perf_counter() - start
    tail = min(100, steps)
    final = {p: {s: statistics.mean(losses[-tail:]) for s, losses in by_seed.items()} for p, by_seed in runs.items()}
    rows = [
        [
            policy,
            *(f"{final[policy][s]:.4f}" for s in seeds),
            *(f"{final[policy][s] / final['mixed_bfloat16'][s]:.4f}x" for s in seeds),
        ]
        for policy in POLICIES
    ]
    payload = _common.result(
        "fp8-training",
        f"FP8 recipes vs bfloat16: GPT {LAYERS} x {WIDTH}, {steps} steps",
        quick=args.quick,
        env=_common.environment("cpu", threads=args.threads),
        tables=[
            {
                "caption": f"final loss (mean of the last {tail} steps) and its ratio to bfloat16's, per seed",
                "columns": ["policy", *(f"loss, seed {s}" for s in seeds), *(f"vs bfloat16, seed {s}" for s in seeds)],
                "rows": rows,
            }
        ],
        notes=[f"seconds per policy: {json.dumps({p: round(t) for p, t in seconds.items()})}"],
        raw={"losses": {p: {str(s): v for s, v in by_seed.items()} for p, by_seed in runs.items()}},
    )
    _common.write(Path(args.out), payload)
    if not args.quick:
        plot(runs, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
