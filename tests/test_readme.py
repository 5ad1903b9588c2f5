"""The README answers in one screen: what polyamp is, how to install it, one self-contained example per framework
(tests/test_doc_blocks.py runs each as written), where each combination is tested, what it costs (numbers taken
from the performance page, never written here alone), and the two commands ``.ci/run`` runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.MULTILINE | re.DOTALL)
    assert match is not None, f"the README has no section {title!r}"
    return match.group(1)


def _table(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows if not set(row) <= set("|-: ")]


def test_the_ci_commands_are_the_ones_ci_runs() -> None:
    assert (
        '<!-- ci: demo -->\n```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install ".[all]" && '
        "python examples/quickstart.py\n```" in README
    )
    assert (
        '<!-- ci: tests -->\n```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install ".[test]" && '
        "python -m pytest\n```" in README
    )


def test_it_says_what_polyamp_is_and_how_to_install_each_backend() -> None:
    first = README.split("\n## ")[0]
    assert all(name in first for name in ("PyTorch", "TensorFlow", "Keras 3", "JAX", "policy", "loss scaler"))
    install = _section("Install")
    for extra in ("torch", "tensorflow", "keras", "jax"):
        assert f'pip install "polyamp[{extra}]"' in install
    assert 'pip install ".[all]"' in install  # from a clone


def test_one_self_contained_example_per_framework() -> None:
    """Each example runs as written (no hidden model or optimizer: no setup directive) and ends with the run's
    summary."""
    for title, shown in (
        ("PyTorch", "polyamp_torch.log_summary"),
        ("Keras 3 (`fit`)", "model.optimizer.summary()"),
        ("TensorFlow (`GradientTape`)", "scaler.summary()"),
        ("JAX (optax)", "polyamp_jax.log_summary"),
    ):
        text = _section(title)
        assert len(re.findall(r"```python\n", text)) == 1, title
        assert "doc-test: setup" not in text and "doc-test: skip" not in text, title
        assert "synthetic data" in text and shown in text, title


def test_lossscaler_or_lossscaleoptimizer_in_two_lines() -> None:
    lines = [line for line in _section("LossScaler or LossScaleOptimizer?").splitlines() if line.strip()]
    assert len(lines) == 2 and "LossScaler" in lines[0] and "LossScaleOptimizer" in lines[1]


def test_every_cell_of_the_support_table_links_to_its_evidence_or_says_not_tested() -> None:
    header, *rows = _table(_section("What is tested where"))
    assert header[1:] == ["float16, loss scaling", "bfloat16, guard", "CPU", "CUDA", "compiled", "distributed"]
    assert [row[0].split()[0] for row in rows] == ["PyTorch", "Lightning,", "Keras", "TensorFlow", "JAX:", "FP8"]
    for row in rows:
        for cell in row[1:]:
            links = re.findall(r"\]\(([^)]+)\)", cell)
            assert links or cell == "not tested", (row[0], cell)
            assert all((ROOT / link).exists() for link in links), (row[0], cell)  # a file, or a folder of them


def test_the_costs_are_the_performance_pages_numbers() -> None:
    costs = _section("What it costs")
    assert "(docs/benchmarks.md)" in costs
    rows = _table(costs)[1:]
    assert len(rows) == 6
    numbers = re.findall(r"\d+\.\d+x(?:-\d+\.\d+x)?|\d+\.\d+-\d+\.\d+x", "\n".join(" ".join(row) for row in rows))
    assert len(numbers) >= 12
    assert [n for n in numbers if n not in BENCHMARKS] == []


def test_the_benchmark_prose_lives_on_the_performance_page() -> None:
    """The README keeps tables; the measurements' prose is on docs/benchmarks.md."""
    for fact in (
        "0 syncs per step for SGD and capturable Adam/AdamW against GradScaler's 1",
        "155 Python calls per iteration",
        "Under XLA (`jit_compile=True`) the 64-wide step takes 1.017x-1.024x",
        "the JAX plans step in 0.94-0.97x the master plan's time, torch's in 1.01-1.31x",
    ):
        assert fact in " ".join(BENCHMARKS.split()), fact
        assert fact not in " ".join(README.split()), fact


def test_it_fits_a_screen_or_two() -> None:
    assert len(README.splitlines()) <= 180
