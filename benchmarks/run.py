"""polyamp's benchmark suite: one runner, one subcommand per target, JSON results, generated markdown.

CPU targets (run here, results in benchmarks/RESULTS.md):

    python benchmarks/run.py torch-cpu     # eager step time, polyamp vs torch.autocast + GradScaler
    python benchmarks/run.py keras         # GradientTape step (tf.function, XLA) and model.fit steps/s
    python benchmarks/run.py keras-backends  # model.fit steps/s on Keras's JAX and PyTorch backends
    python benchmarks/run.py jax           # jitted JAX step: polyamp_jax vs a jmp-style step and float32 optax
    python benchmarks/run.py scale         # per-step overhead as the model grows, plus a PNG plot
    python benchmarks/run.py guard         # the bfloat16 guard's and the step records' cost
    python benchmarks/run.py compiled      # the whole step under torch.compile: compiles, then step time
    python benchmarks/run.py fp8           # the FP8 training step, polyamp's conversion vs torchao's
    python benchmarks/run.py cpu           # the six above, each in its own process, then `report`
    python benchmarks/run.py revisions --range BASE..HEAD   # the same step on two revisions of polyamp

CUDA targets (need a CUDA device; benchmarks/gpu_suite.sh runs them all):

    python benchmarks/run.py gpu-syncs         # host-device syncs per step (torch.cuda.set_sync_debug_mode)
    python benchmarks/run.py gpu-cuda-graph    # CUDA-graph capture of a capturable-Adam step
    python benchmarks/run.py gpu-recipe        # Linear 4096 x 3, batch 512: float32 / native AMP / polyamp
    python benchmarks/run.py gpu-compiled      # the recipe under torch.compile
    python benchmarks/run.py gpu-bf16          # the recipe in bfloat16, no scaler

    python benchmarks/run.py report            # benchmarks/results/*.json -> benchmarks/RESULTS.md, docs table

Every subcommand takes ``--quick`` (a seconds-long smoke run; its JSON is named ``<target>-quick.json``
and is never rendered into RESULTS.md) and ``--out DIR`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/run.py` from anywhere: `benchmarks` is importable
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CPU_TARGETS = ("torch-cpu", "keras", "keras-backends", "jax", "scale", "guard", "compiled")
GPU_TARGETS = ("gpu-syncs", "gpu-cuda-graph", "gpu-recipe", "gpu-compiled", "gpu-bf16", "gpu-training-state")
GPU_HELP = {
    "gpu-syncs": "host-device syncs per step, polyamp vs GradScaler, per optimizer",
    "gpu-cuda-graph": "CUDA-graph capture and replay of a capturable-Adam step (fused, and foreach with skip_on_device)",
    "gpu-recipe": "the AMP recipe (Linear 4096 x 3, batch 512): time and peak memory",
    "gpu-compiled": "the recipe under torch.compile",
    "gpu-bf16": "the recipe in bfloat16 without a scaler",
    "gpu-training-state": "each training-state plan's step time and memory on a 34M-parameter GPT",
}


def _parser() -> argparse.ArgumentParser:
    from benchmarks import _common

    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="target", required=True)

    def target(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
        p.add_argument("--out", default=str(_common.RESULTS), help="folder for the JSON result")
        return p

    # Target modules import their frameworks at the top, so their options are declared here: building
    # the parser imports no framework.
    p = target("torch-cpu", "eager CPU step time, polyamp vs native torch.amp")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=61)
    p.add_argument("--round-seconds", type=float, default=0.03, help="time per variant per round")
    p.add_argument("--widths", default=None, help="comma-separated widths (default 64,512)")
    p.add_argument("--optimizers", default=None, help="comma-separated, from sgd,adam,adam_fused")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or CPU time of the one computing thread (sets --threads 1; for shared machines)",
    )
    p = target("keras", "Keras/TensorFlow step time, polyamp vs Keras LossScaleOptimizer")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--round-seconds", type=float, default=0.1, help="time per variant per round")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the process's CPU time with TensorFlow on one thread (its float16 kernels without "
        "XLA are then far slower than with its default pools, so `cpu` keeps keras on wall time)",
    )
    p = target("keras-backends", "model.fit on Keras's JAX and PyTorch backends, polyamp vs Keras's LSO")
    p.add_argument("--rounds", type=int, default=11)
    p = target("jax", "jitted JAX step: polyamp_jax vs a hand-written jmp-style step and float32 optax")
    p.add_argument("--rounds", type=int, default=21)
    p = target("guard", "the bfloat16 guard and the step records, vs plain torch and GradScaler")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--round-seconds", type=float, default=0.03, help="time per variant per round")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="as for torch-cpu")
    p = target("compiled", "the whole step under torch.compile, polyamp vs native: compiles and step time")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--round-seconds", type=float, default=0.05, help="time per variant per round")
    p.add_argument("--warmup", type=int, default=40, help="calls timed as the compile phase")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (--quick uses 'eager')")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="as for torch-cpu (the step times)")
    p = target("fp8", "the FP8 training step on the CPU, polyamp's conversion vs torchao's")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--round-seconds", type=float, default=0.2, help="time per variant per round")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="as for torch-cpu")
    p = target("scale", "per-step overhead vs model size, with a plot")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-params", type=float, default=1e8, help="largest model tried (parameters)")
    p.add_argument("--max-step-seconds", type=float, default=20.0, help="stop growing past this step time")
    p.add_argument("--plot", default=None, help="PNG path (default: <out>/scale.png; full runs only)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="as for torch-cpu")
    p = target("training-state", "memory, final loss and step time of each training-state plan (AdamW, a small GPT)")
    p.add_argument(
        "--backend",
        default="all",
        help="torch, jax, keras-tensorflow, keras-jax, keras-torch, comma-separated, or all (the default)",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 3000; --quick: 20)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p = target("revisions", "the same step on two revisions, each imported in its own worker process")
    p.add_argument("--range", action="append", help="BASE..HEAD (repeatable; default HEAD~1..HEAD)")
    p.add_argument("--widths", default="64,512")
    p.add_argument("--optimizers", default="sgd,adam,adam_fused")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=30, help="steps per variant per round")
    for name in GPU_TARGETS:
        p = target(name, GPU_HELP[name])
        # The recipe targets' steps are short and a GPU machine's host is noisy: more rounds (a few seconds).
        p.add_argument("--rounds", type=int, default=31 if name in ("gpu-recipe", "gpu-compiled", "gpu-bf16") else 11)
        p.add_argument("--device", default="cuda", help="cuda (default); cpu only to smoke-test the code")
    everything = target("cpu", "all CPU targets, each in a fresh process, then the markdown report")
    everything.add_argument("--threads", type=int, default=None, help="passed to torch-cpu and scale")
    everything.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="passed to torch-cpu and scale")
    report = sub.add_parser(
        "report", help="render results/*.json as benchmarks/RESULTS.md and the summary table in README.md"
    )
    report.add_argument("--results", default=str(_common.RESULTS))
    report.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    report.add_argument(
        "--readme",
        default=str(ROOT / "docs" / "benchmarks.md"),
        help="the page whose summary table to update (the documentation's performance page)",
    )
    return parser


def _run_cpu(args: argparse.Namespace) -> int:
    """Each CPU target in its own interpreter (torch and TensorFlow never share one), then the report."""
    for name in CPU_TARGETS:
        command = [sys.executable, str(Path(__file__).resolve()), name, "--out", args.out]
        if args.quick:
            command.append("--quick")
        keras_target = name.startswith("keras") or name == "jax"
        if args.threads and not keras_target:
            command += ["--threads", str(args.threads)]
        if args.clock != "wall" and not keras_target:  # one-thread TensorFlow is not representative
            command += ["--clock", args.clock]
        print("::", " ".join(command[1:]), flush=True)
        code = subprocess.run(command, check=False).returncode
        if code:
            return code
    if not args.quick:
        from benchmarks import report

        report.main(Path(args.out), ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md")
    return 0


def _common_write(payload: dict[str, object], args: argparse.Namespace) -> None:
    from benchmarks import _common

    _common.write(Path(args.out), payload)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.target == "cpu":
        return _run_cpu(args)
    if args.target == "report":
        from benchmarks import report

        report.main(Path(args.results), Path(args.output), Path(args.readme))
        return 0
    if args.target == "torch-cpu":
        from benchmarks import torch_cpu

        _common_write(torch_cpu.run(args), args)
    elif args.target == "keras":
        from benchmarks import keras_step

        _common_write(keras_step.run(args), args)
    elif args.target == "keras-backends":
        from benchmarks import keras_backends

        _common_write(keras_backends.run(args), args)
    elif args.target == "jax":
        from benchmarks import jax_step

        _common_write(jax_step.run(args), args)
    elif args.target == "guard":
        from benchmarks import guard

        _common_write(guard.run(args), args)
    elif args.target == "compiled":
        from benchmarks import compiled

        _common_write(compiled.run(args), args)
    elif args.target == "fp8":
        from benchmarks import fp8

        _common_write(fp8.run(args), args)
    elif args.target == "scale":
        from benchmarks import scale

        _common_write(scale.run(args), args)
    elif args.target == "training-state":
        from benchmarks import training_state

        _common_write(training_state.run(args), args)
        for part in Path(args.out).glob("training-state-*.part.json"):
            part.unlink()
    elif args.target == "revisions":
        from benchmarks import revisions

        _common_write(revisions.run(args), args)
    elif args.target == "gpu-training-state":
        from benchmarks import training_state_gpu

        _common_write(training_state_gpu.run(args), args)
    else:
        from benchmarks import gpu

        _common_write(gpu.run(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
