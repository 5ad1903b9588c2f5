"""Every Python code block of the README and the documentation site runs, as written, in a test.

A page's blocks run in order in one namespace (a later block may use what an earlier one defined), in a fresh
interpreter per page. HTML comments just before a block, invisible on the rendered page, say what the reader
is assumed to have:

* ``<!-- doc-test: setup`` + code + ``-->``: code run before the block (a model, data, a loss function);
* ``<!-- doc-test: then`` + code + ``-->``: code run after it (calling the step a block defines, checks);
* ``<!-- doc-test: requires torch, lightning -->``: the block's page group is skipped where a module is missing;
* ``<!-- doc-test: env KERAS_BACKEND=jax -->``: environment of the interpreter (from this block on, a new one);
* ``<!-- doc-test: fresh -->``: this block and the following ones run in a new interpreter;
* ``<!-- doc-test: slow -->``: the block's interpreter runs with the slow set (``-m slow``): pages whose blocks
  load several frameworks or a Keras backend that the fast set tests in subprocesses only;
* ``<!-- doc-test: skip REASON -->``: the block is not run; REASON says why (a GPU, several processes), and is
  checked to be one of `SKIP_REASONS`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BACKENDS = [ROOT / "backends" / name for name in ("torch", "tensorflow", "keras", "jax")]
#: What may keep a block from running here, and nothing else.
SKIP_REASONS = ("needs a CUDA device", "needs several processes", "needs a download")

_BLOCK = re.compile(r"((?:<!-- doc-test:.*?-->\s*)*)```python\n(.*?)```", flags=re.DOTALL)
_DIRECTIVE = re.compile(r"<!-- doc-test:\s*(\w[\w-]*)(.*?)-->", flags=re.DOTALL)


@dataclass
class _Group:
    """Consecutive blocks of a page that share one interpreter."""

    page: Path
    first_line: int
    env: dict[str, str] = field(default_factory=dict)
    requires: set[str] = field(default_factory=set)
    code: list[str] = field(default_factory=list)
    blocks: int = 0
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.first_line}"


def _groups(page: Path) -> list[_Group]:
    text = page.read_text()
    groups: list[_Group] = []
    env: dict[str, str] = {}
    current: _Group | None = None
    for match in _BLOCK.finditer(text):
        line = text[: match.start(2)].count("\n")
        setup, then, skip, fresh = [], [], None, current is None
        requires: set[str] = set()
        slow = False
        for name, body in _DIRECTIVE.findall(match.group(1)):
            if name == "setup":
                setup.append(textwrap.dedent(body).strip("\n"))
            elif name == "then":
                then.append(textwrap.dedent(body).strip("\n"))
            elif name == "requires":
                requires |= {m.strip() for m in body.split(",") if m.strip()}
            elif name == "env":
                key, _, value = body.strip().partition("=")
                env = {**env, key: value}
                fresh = True
            elif name == "fresh":
                fresh = True
            elif name == "slow":
                slow = True
            elif name == "skip":
                skip = body.strip()
            else:
                raise AssertionError(f"{page.name}:{line}: unknown doc-test directive {name!r}")
        if skip is not None:
            assert skip in SKIP_REASONS, f"{page.name}:{line}: skip reason {skip!r} is not one of {SKIP_REASONS}"
            continue
        if fresh or current is None:
            current = _Group(page, line, dict(env))
            groups.append(current)
        current.requires |= requires
        current.slow |= slow
        location = f"{page.relative_to(ROOT)}:{line}"
        for code in setup:
            current.code.append(f"# setup of {location}\n{code}\n")
        current.code.append(f"print('--- block at {location}', flush=True)\n{match.group(2)}\n")
        for code in then:
            current.code.append(f"# after the block at {location}\n{code}\n")
        current.blocks += 1
    return groups


GROUPS = [group for page in PAGES for group in _groups(page)]


def test_every_python_block_is_run_or_skipped_for_a_reason() -> None:
    for page in PAGES:
        text = page.read_text()
        found = len(re.findall(r"```python\n", text))
        skipped = len(re.findall(r"<!-- doc-test:\s*skip", text))
        ran = sum(group.blocks for group in GROUPS if group.page == page)
        assert ran + skipped == found, f"{page.name}: {found} blocks, {ran} run, {skipped} skipped"
    assert sum(group.blocks for group in GROUPS) >= 30


@pytest.mark.parametrize(
    "group", [pytest.param(group, id=group.id, marks=[pytest.mark.slow] if group.slow else []) for group in GROUPS]
)
def test_the_block_runs(group: _Group, tmp_path: Path) -> None:
    for module in sorted(group.requires):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(group.code))
    paths = [str(ROOT), *map(str, BACKENDS), os.environ.get("PYTHONPATH", "")]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        TF_CPP_MIN_LOG_LEVEL="3",
        CUDA_VISIBLE_DEVICES="",
        **group.env,
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{group.id}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
