"""The API reference: every public name of ``polyamp`` and of each backend package (its ``__all__``, read from the
source, so no framework is needed) has its entry in the built pages, and the docstrings render as Python shows
them (their examples and doctests as code, their settings filled in; ``docs/_ext/docstrings.py``)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Each documented module: its source file, and the reference page that documents it.
MODULES = {
    "polyamp": ("polyamp/__init__.py", "polyamp"),
    "polyamp_torch": ("backends/torch/polyamp_torch/__init__.py", "polyamp_torch"),
    "polyamp_torch.lightning": ("backends/torch/polyamp_torch/lightning.py", "polyamp_torch_lightning"),
    "polyamp_torch.accelerate": ("backends/torch/polyamp_torch/accelerate.py", "polyamp_torch_accelerate"),
    "polyamp_torch.transformers": ("backends/torch/polyamp_torch/transformers.py", "polyamp_torch_transformers"),
    "polyamp_keras": ("backends/keras/polyamp_keras/__init__.py", "polyamp_keras"),
    "polyamp_tensorflow": ("backends/tensorflow/polyamp_tensorflow/__init__.py", "polyamp_tensorflow"),
    "polyamp_jax": ("backends/jax/polyamp_jax/__init__.py", "polyamp_jax"),
}


def _public_names(source: str) -> list[str]:
    """The module's ``__all__``, a literal list in its source."""
    for node in ast.parse((ROOT / source).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{source} has no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install '.[test]' brings the docs tools")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_name_has_its_entry_in_the_reference(module: str, site: Path) -> None:
    source, page = MODULES[module]
    names = _public_names(source)
    assert names, module
    html = (site / "reference" / page / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', html))
    assert [name for name in names if f"{module}.{name}" not in anchors] == []


def test_the_integrations_have_reference_pages_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in ("lightning", "accelerate", "transformers"):
        assert f"- polyamp_torch.{name}: reference/polyamp_torch_{name}.md" in nav


def test_docstrings_render_their_examples_as_code_and_their_settings_filled_in(site: Path) -> None:
    """No reStructuredText ``::`` marker shows as text, every "Example:" section is a code block, a doctest is
    code (not Markdown quotes: ``>>>``), and a docstring completed at import (`polyamp.LossScaler`'s settings)
    shows completed, not as one code block."""
    for page in sorted((site / "reference").glob("*/index.html")):
        html = page.read_text()
        assert re.findall(r"[^<>]{0,40}::</p>", html) == [], page.parent.name
        assert "{settings}" not in html and "<blockquote>" not in html, page.parent.name
        for example in re.findall(r'<details class="example" open>(.*?)</details>', html, flags=re.DOTALL):
            assert '<div class="highlight">' in example and "```" not in example, page.parent.name
    html = (site / "reference" / "polyamp" / "index.html").read_text()
    start = html.index('id="polyamp.LossScaler"')
    scaler = html[start : html.index('id="polyamp.LossScaler.', start)]
    assert "<pre><code>The scaler multiplies" not in scaler  # the description is text, not a code block
    assert "<p>The scaler multiplies the loss" in scaler and "growth_interval" in scaler
    assert len(re.findall(r'<details class="example" open>', scaler)) == 1


def test_the_scalers_methods_from_every_part_have_their_entries(site: Path) -> None:
    """`LossScaler` and `FunctionalLossScaler` are joined from parts (a module each): the reference shows the
    public members of every part, not only those the class body defines."""
    import polyamp

    html = (site / "reference" / "polyamp" / "index.html").read_text()
    for cls in (polyamp.LossScaler, polyamp.FunctionalLossScaler):
        members = {name for name in dir(cls) if not name.startswith("_")}
        missing = sorted(name for name in members if f'id="polyamp.{cls.__name__}.{name}"' not in html)
        assert missing == [], cls.__name__
    for name in ("scale", "step", "update", "state_dict", "records", "summary"):
        assert f'id="polyamp.LossScaler.{name}"' in html
