"""The benchmark suite's smoke runs complete and write their JSON; timings are never asserted."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "benchmarks" / "run.py"
#: The conftest fixture run_bounded: a subprocess bounded by POLYAMP_TEST_TIMEOUT.
RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]


def _report() -> Any:
    """benchmarks/report.py (the repository root is on sys.path only when pytest runs from it)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks.report")


def _common() -> Any:
    """benchmarks/_common.py, the timing and summary helpers every target uses."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks._common")


def test_the_bootstrap_interval_brackets_the_median_and_is_reproducible() -> None:
    common = _common()
    values = [1.0 + 0.01 * ((7 * i) % 13) for i in range(41)]  # 1.00 to 1.12, spread over the rounds
    low, high = common.bootstrap_interval(values)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)
    assert low < high
    assert common.bootstrap_interval(values) == (low, high)  # seeded: a result file reproduces from its times
    assert common.bootstrap_interval([1.02] * 9) == (1.02, 1.02)
    assert common.bootstrap_interval([1.5]) == (1.5, 1.5)
    wide_low, wide_high = common.bootstrap_interval(values[:9])
    narrow_low, narrow_high = common.bootstrap_interval(values * 8)
    assert narrow_high - narrow_low < wide_high - wide_low  # more rounds, a narrower interval


def test_summarize_pairs_each_round_with_the_baselines() -> None:
    """A variant 10% slower in every round has ratio 1.1 with a zero-width interval, however much the machine's
    speed moved between rounds; the A/A column is judged the same way."""
    native = [1.0, 2.0, 1.0, 3.0, 1.5, 1.2, 2.5]
    summary = _common().summarize({"native": native, "slower": [1.1 * t for t in native]}, "native")
    assert summary["native"]["ratio"] == summary["native"]["ratio_low"] == summary["native"]["ratio_high"] == 1.0
    assert summary["slower"]["ratio"] == pytest.approx(1.1)
    assert summary["slower"]["ratio_low"] == pytest.approx(1.1)
    assert summary["slower"]["ratio_high"] == pytest.approx(1.1)
    assert summary["slower"]["median_ms"] == pytest.approx(1.1 * statistics.median(native))


def test_interleaved_rounds_run_the_variants_in_orders_that_change_each_variants_neighbour() -> None:
    common = _common()
    names = ["native", "native again", "polyamp", "polyamp lists"]
    orders = common.round_orders(names, 41)
    assert orders == common.round_orders(names, 41)  # seeded: a run repeats
    assert all(sorted(order) == sorted(names) for order in orders)
    for name in names:  # every variant runs after each of the others, and first, in some rounds
        before = {order[order.index(name) - 1] if order.index(name) else None for order in orders}
        assert before == {None, *names} - {name}, (name, before)
    ran: list[str] = []
    variants = {name: (lambda name=name: ran.append(name)) for name in names}
    times = common.interleaved(variants, iters=1, rounds=5, warmup=0)
    assert [len(times[name]) for name in names] == [5] * 4
    assert [ran[index : index + 4] for index in range(0, 20, 4)] == common.round_orders(names, 5)


def run(run_bounded: RunBounded, *args: str) -> str:
    result = run_bounded([sys.executable, str(RUNNER), *args], cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def load(path: Path) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(path.read_text())
    assert payload["quick"] is True and payload["status"] == "measured"
    assert payload["environment"]["cpu_model"] and payload["environment"]["date"]
    assert payload["command"].startswith("python benchmarks/run.py")
    for table in payload["tables"]:
        assert table["rows"] and all(len(row) == len(table["columns"]) for row in table["rows"])
    return payload


@pytest.mark.parametrize(
    ("target", "needs"),
    [
        ("torch-cpu", "torch"),
        pytest.param("scale", "torch", marks=pytest.mark.slow),
        pytest.param("guard", "torch", marks=pytest.mark.slow),
        pytest.param("fp8", "torchao", marks=pytest.mark.slow),
        pytest.param("compiled", "torch", marks=pytest.mark.slow),
        pytest.param("keras", "tensorflow", marks=pytest.mark.slow),
        pytest.param("keras-backends", "keras", marks=pytest.mark.slow),
        pytest.param("jax", "jmp", marks=pytest.mark.slow),
        pytest.param("gpu-recipe", "torch", marks=pytest.mark.slow),
        pytest.param("gpu-compiled", "torch", marks=pytest.mark.slow),
        pytest.param("gpu-bf16", "torch", marks=pytest.mark.slow),
        pytest.param("gpu-syncs", "torch", marks=pytest.mark.slow),
        pytest.param("gpu-cuda-graph", "torch", marks=pytest.mark.slow),
        pytest.param("gpu-training-state", "torch", marks=pytest.mark.slow),
    ],
)
def test_quick_run_writes_its_json(target: str, needs: str, tmp_path: Path, run_bounded: RunBounded) -> None:
    pytest.importorskip(needs)
    extra = ["--device", "cpu"] if target.startswith("gpu-") else []  # the CUDA code, at toy sizes on CPU
    run(run_bounded, target, "--quick", "--out", str(tmp_path), *extra)
    payload = load(tmp_path / f"{target}-quick.json")
    assert payload["target"] == target


@pytest.mark.slow
def test_report_renders_full_results_and_marks_the_rest_not_yet_measured(
    tmp_path: Path, run_bounded: RunBounded
) -> None:
    pytest.importorskip("torch")
    run(run_bounded, "torch-cpu", "--quick", "--out", str(tmp_path))
    quick = json.loads((tmp_path / "torch-cpu-quick.json").read_text())
    quick["quick"] = False  # as a full run would write it
    (tmp_path / "torch-cpu.json").write_text(json.dumps(quick))
    output = tmp_path / "RESULTS.md"
    readme = tmp_path / "README.md"
    report = _report()
    readme.write_text(f"intro\n{report.README_BEGIN}\nold table\n{report.README_END}\nrest\n")
    run(run_bounded, "report", "--results", str(tmp_path), "--output", str(output), "--readme", str(readme))
    text = output.read_text()
    summary = readme.read_text()
    assert summary.startswith("intro\n") and summary.endswith("rest\n") and "old table" not in summary
    row = next(line for line in summary.splitlines() if line.startswith("| `torch-cpu` |"))
    assert "polyamp (CUDA's float32 list on CPU): " in row and quick["environment"]["commit"] in row
    assert "| `gpu-syncs` |" in summary and "| `keras` |" in summary
    assert summary.count("not yet measured") == len(report.ORDER) - 2  # every target but torch-cpu and revisions
    assert quick["title"] in text and quick["command"] in text
    assert "| model | optimizer | native ms |" in text
    for target in [t for t in report.ORDER if t != "torch-cpu"]:  # every target without a result
        command = report.COMMANDS.get(target, f"python benchmarks/run.py {target}")
        assert f"Not yet measured: `{command}`" in text


def _timed_rows(run_bounded: RunBounded, script: str, *args: str) -> tuple[list[str], list[str]]:
    """Run a standalone timing script of benchmarks/; (its lines before the timed rows, the rows' names). Each
    row must end with a positive time in microseconds."""
    pytest.importorskip("torch")
    result = run_bounded([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.endswith(" us")]
    assert rows == lines[len(lines) - len(rows) :]
    assert all(float(row.split()[-2]) > 0 for row in rows)
    return lines[: len(lines) - len(rows)], [row.rsplit(None, 2)[0].strip() for row in rows]


def test_gpu_kernels_times_each_kernel(run_bounded: RunBounded) -> None:
    """benchmarks/gpu_kernels.py runs anywhere torch does (--device cpu here) and prints one time per kernel."""
    head, names = _timed_rows(run_bounded, "gpu_kernels.py", "--device", "cpu", "--size", "32", "--iters", "2")
    assert head == ["3 x 32 x 32 float32 (0 MiB of gradients) on cpu"]
    assert names == [
        "guard check (fused, inverse scale 1)",
        "read-only check (_foreach_norm, ord=inf)",
        "masked commit (copy + where)",
        "its copy",
        "its where",
        "foreach SGD step",
        "host read of a flag",
    ]


def test_region_cost_times_each_spelling(run_bounded: RunBounded) -> None:
    """benchmarks/region_cost.py prints one time per region spelling, torch.autocast's first."""
    head, names = _timed_rows(run_bounded, "region_cost.py", "--number", "20", "--repeat", "1")
    assert head == []
    assert names == [
        'torch.autocast("cpu", dtype=torch.float16)',
        'polyamp_torch.autocast("mixed_float16", device_type="cpu")',
        "the same, cpu_float32_ops=False",
        "polyamp_torch.autocast() (the policy in effect)",
    ]


def test_gpu_targets_refuse_to_run_without_cuda(tmp_path: Path, run_bounded: RunBounded) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    result = run_bounded([sys.executable, str(RUNNER), "gpu-recipe", "--quick", "--out", str(tmp_path)], cwd=ROOT)
    assert result.returncode != 0 and "needs a CUDA device" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_gpu_suite_leaves_out_the_steps_gpu_suite_skip_names(tmp_path: Path, run_bounded: RunBounded) -> None:
    """GPU_SUITE_SKIP names steps not to run (a short lease runs the rest): each is recorded as "skipped", the
    others run as usual, and a suite of only skipped steps exits 0."""
    pytest.importorskip("torch")
    steps = ["conformance", "jax-conformance", "keras-torch-conformance", "keras-jax-conformance", "cuda-tests"]
    gpu = ["gpu-syncs", "gpu-cuda-graph", "gpu-recipe", "gpu-compiled", "gpu-bf16", "gpu-training-state", "jax"]
    gpu += ["fp8-gpu", "fp8-jax-gpu"]
    env = dict(os.environ, PYTHON=sys.executable, GPU_SUITE_SKIP=" ".join(steps + gpu))
    result = run_bounded(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), str(tmp_path)], env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text()) == dict.fromkeys(steps + gpu, "skipped")
    assert "gpu-recipe: skipped (GPU_SUITE_SKIP)" in result.stdout
    assert not (tmp_path / "conformance.txt").exists() and not (tmp_path / "gpu-recipe.json").exists()


@pytest.mark.slow
def test_the_gpu_suite_records_every_step_and_fails_without_cuda(tmp_path: Path, run_bounded: RunBounded) -> None:
    """benchmarks/gpu_suite.sh where torch sees no CUDA device: every step still runs and is recorded, a
    conformance run whose cases were all skipped counts as "nothing ran" (its exit code 0 checked nothing),
    the CUDA targets refuse, and the script exits non-zero."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the suite would run in full")
    result = run_bounded(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), str(tmp_path)], env=dict(os.environ, PYTHON=sys.executable)
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]

    def keras_on(backend: str) -> str:
        found = all(importlib.util.find_spec(name) is not None for name in ("keras", backend))
        return "nothing ran" if found else "skipped"

    gpu = ("gpu-syncs", "gpu-cuda-graph", "gpu-recipe", "gpu-compiled", "gpu-bf16", "gpu-training-state")
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "conformance": "nothing ran",
        "jax-conformance": "skipped",  # JAX without a GPU backend (or not installed): the JAX steps are left out
        "keras-torch-conformance": keras_on("torch"),
        "keras-jax-conformance": keras_on("jax"),
        "cuda-tests": "nothing ran",  # the CUDA cases skip without a device
        **dict.fromkeys(gpu, 1),
        "jax": "skipped",
        "fp8-gpu": 1 if importlib.util.find_spec("torchao") is not None else "skipped",
        "fp8-jax-gpu": "skipped",  # JAX without a GPU backend
    }
    counts = json.loads((tmp_path / "gpu-conformance.json").read_text())["tables"][0]["rows"]
    assert counts[0][:2] == ["torch on cuda", "0"] and int(counts[0][2]) > 0  # every case skipped: none passed
    conformance = json.loads((tmp_path / "conformance.json").read_text())
    assert conformance["command"] == "python -m polyamp.conformance --backend torch --device cuda --verbose"
    assert (conformance["exit_code"], conformance["passed"]) == (0, 0)
    assert "sees no CUDA device" in conformance["output"]
    if keras_on("jax") == "nothing ran":
        keras = json.loads((tmp_path / "keras-jax-conformance.json").read_text())
        assert keras["command"] == (
            "KERAS_BACKEND=jax python -m polyamp.conformance --backend keras --device jax-cuda --verbose"
        )
        assert "Keras on jax sees no CUDA device" in keras["output"]
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert environment["torch"] == torch.__version__ and environment["cuda_available"] is False
    for target in gpu + (("fp8-gpu",) if importlib.util.find_spec("torchao") is not None else ()):
        assert "needs a CUDA device" in (tmp_path / f"{target}.log").read_text()


@pytest.mark.slow
def test_revisions_times_two_revisions_side_by_side(tmp_path: Path, run_bounded: RunBounded) -> None:
    """Each revision's own code runs in its worker (the worker checks where polyamp came from)."""
    pytest.importorskip("torch")
    if subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout with history")
    run(run_bounded, "revisions", "--quick", "--range", "HEAD~1..HEAD", "--out", str(tmp_path))
    payload = load(tmp_path / "revisions-quick.json")
    (table,) = payload["tables"]
    assert table["caption"] == "HEAD~1 -> HEAD" and [row[1] for row in table["rows"]] == ["sgd"]
    (entry,) = payload["raw"]
    assert set(entry["head_over_base"]) == {"GradScaler", "polyamp scaler"}


def test_docs_performance_table_is_the_committed_results() -> None:
    """The performance page's summary is generated from benchmarks/results/ (``python benchmarks/run.py report``)."""
    report = _report()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = text.split(report.README_BEGIN, 1)[1].split(report.README_END, 1)[0]
    assert block.strip() == report.summary(report.load(ROOT / "benchmarks" / "results")).strip()


@pytest.mark.parametrize(
    ("backend", "needs"),
    [
        pytest.param("torch", "torch", marks=pytest.mark.slow),
        pytest.param("jax", "optax", marks=pytest.mark.slow),
        pytest.param("keras-torch", "keras", marks=pytest.mark.slow),
    ],
)
def test_training_state_quick_run_counts_each_plans_bytes(
    backend: str, needs: str, tmp_path: Path, run_bounded: RunBounded
) -> None:
    pytest.importorskip(needs)
    if backend == "keras-torch":
        pytest.importorskip("torch")
    run(run_bounded, "training-state", "--quick", "--backend", backend, "--out", str(tmp_path))
    payload = load(tmp_path / "training-state-quick.json")
    rows = {row[1]: row for row in payload["tables"][0]["rows"]}
    assert {plan: float(row[3]) for plan, row in rows.items()} == {
        "bfloat16_float32_master": 16.0,
        "bfloat16": 8.0,
        "bfloat16_stochastic": 8.0,
        "bfloat16_kahan": 10.0,
    }
    assert all(row[0] == backend for row in rows.values())
    assert rows["bfloat16_float32_master"][5] == "1.000x"


@pytest.mark.slow
def test_fp8_frameworks_quick_run_starts_the_three_frameworks_from_the_same_loss(
    tmp_path: Path, run_bounded: RunBounded
) -> None:
    """torch, Keras (JAX) and JAX load the same weights and batches: their first losses agree, so the curves
    compare one recipe, not three models. In bfloat16 they agree within 1e-3. Under FP8 a tensorwise scale
    follows its tensor's amax, so the last bit of an upstream difference moves every cast's rounding: the
    first losses agree within 1%."""
    for needs in ("torch", "keras", "flax", "optax"):
        pytest.importorskip(needs)
    script = ROOT / "benchmarks" / "fp8_frameworks.py"
    result = run_bounded([sys.executable, str(script), "--quick", "--out", str(tmp_path)], cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "fp8-frameworks-quick.json").read_text())
    assert payload["target"] == "fp8-frameworks" and payload["quick"] is True
    assert payload["command"] == "python benchmarks/fp8_frameworks.py --quick"
    policies = ["mixed_bfloat16", "float8_tensorwise", "float8_rowwise"]
    raw = payload["raw"]
    assert list(raw["losses"]) == policies and raw["logged_steps"] == [0, 19]
    for policy in policies:
        losses = raw["losses"][policy]
        assert list(losses) == ["torch", "keras", "jax"] and all(len(run) == 20 for run in losses.values())
        first = [run[0] for run in losses.values()]
        # the initial weights give a first loss well away from a uniform prediction's: the weights matter
        assert min(first) > math.log(256) + 0.1
        bound = 1e-3 if policy == "mixed_bfloat16" else 0.01 * min(first)
        assert max(first) - min(first) <= bound, (policy, first)
        assert raw["spread"][policy][0] == pytest.approx((max(first) - min(first)) / min(first))
        for framework, run in losses.items():
            assert raw["final"][policy][framework] == pytest.approx(statistics.mean(run))
            if policy != "mixed_bfloat16":
                ratio = raw["final"][policy][framework] / raw["final"]["mixed_bfloat16"][framework]
                assert raw["ratio"][policy][framework] == pytest.approx(ratio)
    final_table, spread_table = payload["tables"]
    assert [row[0] for row in final_table["rows"]] == ["torch", "keras", "jax"]
    assert [row[0] for row in spread_table["rows"]] == policies
    for table in payload["tables"]:
        assert all(len(row) == len(table["columns"]) for row in table["rows"])


@pytest.mark.slow
def test_fp8_jax_gpu_quick_run_times_every_variant(tmp_path: Path, run_bounded: RunBounded) -> None:
    """benchmarks/fp8_jax_gpu.py at toy sizes: every variant trains and is timed against bfloat16, and the
    result names its command; a full run refuses a JAX without a GPU."""
    for needs in ("flax", "optax"):
        pytest.importorskip(needs)
    script = ROOT / "benchmarks" / "fp8_jax_gpu.py"
    result = run_bounded([sys.executable, str(script), "--quick", "--out", str(tmp_path)], cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "fp8-jax-gpu-quick.json").read_text())
    assert payload["target"] == "fp8-jax-gpu" and payload["command"] == "python benchmarks/fp8_jax_gpu.py --quick"
    rows = payload["tables"][0]["rows"]
    assert [row[0] for row in rows] == [
        "bfloat16",
        "polyamp tensorwise",
        "polyamp rowwise",
        "polyamp delayed",
        "flax delayed",
        "autocast tensorwise",
    ]
    assert rows[0][2] == "1.000x" and all(len(times) == 2 for times in payload["raw"]["times_ms"].values())
    import jax

    if jax.default_backend() != "gpu":
        refused = run_bounded([sys.executable, str(script), "--out", str(tmp_path)], cwd=ROOT)
        assert refused.returncode != 0 and "needs a GPU JAX backend" in refused.stderr
