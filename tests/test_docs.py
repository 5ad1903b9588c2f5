"""The documentation site: it builds with warnings as errors, every page is in its navigation, each getting-started
page holds one complete example (tests/test_doc_blocks.py runs it), and the README's links lead to files that
exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BACKEND_PATHS = [ROOT / "backends" / name for name in ("torch", "tensorflow", "keras")]


def _env(**extra: str) -> dict[str, str]:
    paths = [str(ROOT), *map(str, BACKEND_PATHS), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), TF_CPP_MIN_LOG_LEVEL="2", **extra)


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install '.[test]' brings the docs tools")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_env(NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "polyamp" / "index.html").is_file()
    page = (tmp_path / "site" / "reference" / "polyamp" / "index.html").read_text()
    assert "LossScaler" in page and "set_policy" in page  # the API reference comes from the docstrings


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE))
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages == listed


GETTING_STARTED = sorted((DOCS / "getting-started").glob("*.md"))


@pytest.mark.parametrize("page", GETTING_STARTED, ids=[p.stem for p in GETTING_STARTED])
def test_the_getting_started_page_holds_one_complete_example(page: Path) -> None:
    """One Python block, the whole example; tests/test_doc_blocks.py runs it as written."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, f"{page.name} should hold one complete example"


def test_every_framework_has_a_getting_started_page_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {page.stem for page in GETTING_STARTED}
    assert pages == {"pytorch", "keras", "tensorflow", "jax"}
    assert all(f"getting-started/{page}.md" in nav for page in pages)
    jax_page = (DOCS / "getting-started" / "jax.md").read_text()
    assert "On the CPU, use bfloat16" in jax_page and "## On the CPU" in (DOCS / "guide" / "jax.md").read_text()


def test_the_readme_links_lead_to_files() -> None:
    text = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert targets, "the README links to the documentation"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []
    assert len(text.splitlines()) <= 350  # what a newcomer needs first; the rest is on the site


def test_the_changelog_page_is_the_changelog() -> None:
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text()


def test_the_plot_on_the_performance_page_is_the_benchmarks() -> None:
    assert (DOCS / "assets" / "scale.png").read_bytes() == (ROOT / "benchmarks" / "results" / "scale.png").read_bytes()
