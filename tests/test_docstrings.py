"""The examples in polyamp's docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import polyamp

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(polyamp.__path__, prefix="polyamp.") if not name.endswith("__main__")
)


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def test_docs_settings_table_is_the_configs() -> None:
    """The guide's settings table lists exactly LossScaleConfig's settings, in order, with their defaults."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "overview.md").read_text()
    table = page.split("<!-- settings-table -->")[1].split("<!-- /settings-table -->")[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", table, flags=re.MULTILINE)
    defaults = polyamp.LossScaleConfig.defaults()
    assert [name for name, _ in rows] == list(defaults)
    for name, default in rows:
        assert eval(default) == defaults[name], name


def test_the_default_floor_is_stated_wherever_min_scale_is_documented() -> None:
    """Without a min_scale the floor is 1.0, or init_scale if that is lower (a backoff never raises the scale):
    the setting's line, the guide's settings table and the config's docstring say so, and the docstring says
    how jmp's floor (1 whatever the start) differs."""
    from pathlib import Path

    from polyamp.backend_api.arguments import SETTING_DOCS

    page = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "overview.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith("| `min_scale` |")]
    assert "None: 1.0, or `init_scale` if lower" in row
    assert "None: 1.0, or init_scale if lower" in SETTING_DOCS["min_scale"]
    doc = " ".join((polyamp.LossScaleConfig.__doc__ or "").split())
    assert "a backoff never raises the scale" in doc and "jmp's floor is 1 whatever the start" in doc


def test_no_doc_says_a_loss_scaler_changes_class_when_it_binds() -> None:
    """``polyamp.LossScaler()`` keeps its class when it binds to a framework; the bound subclasses only bind
    up front. No docstring or README line may say that a ``LossScaler()`` "becomes" one of them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    claim = re.compile(r"LossScaler\(\)`*\s+becomes", flags=re.IGNORECASE)
    sources = [
        *sorted((root / "backends").rglob("*.py")),
        *sorted((root / "polyamp").rglob("*.py")),
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
    ]
    offenders = [
        f"{path.relative_to(root)}:{text[: match.start()].count(chr(10)) + 1}"
        for path in sources
        for text in [path.read_text()]
        for match in claim.finditer(text)
    ]
    assert offenders == []
