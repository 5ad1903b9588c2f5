"""The framework releases polyamp is tested with, in one table, and the warning for anything older.

`MINIMUM_VERSIONS` is the one place the lower bounds live: ``pyproject.toml``'s extras declare exactly these
(``tests/test_versions.py`` compares the two), and ``.ci/matrix oldest`` installs exactly these. Each backend
package calls `warn_if_untested` when it is imported: a framework older than its minimum gets one
`UntestedVersionWarning` naming what is installed, what is tested and how to fix it; nothing is raised, so a
setup that happens to work keeps working.
"""

from __future__ import annotations

import importlib
import re
import warnings
from typing import Any

from polyamp._src.errors import BackendNotInstalledError

__all__ = [
    "MINIMUM_PYTHON",
    "MINIMUM_VERSIONS",
    "VERSIONS_PAGE",
    "UntestedVersionWarning",
    "import_framework",
    "parse_version",
    "untested",
    "warn_if_untested",
]

#: The oldest release of each dependency the version matrix's ``oldest`` job passes the whole suite with
#: (docs/versions.md has the run). ``jaxlib`` follows ``jax``.
MINIMUM_VERSIONS: dict[str, str] = {
    "torch": "2.13",
    "tensorflow": "2.19.1",
    "keras": "3.12",
    "jax": "0.8",
    "optax": "0.2.4",
    "numpy": "2.0",
}

#: The oldest Python the ``oldest`` job runs on (``requires-python``).
MINIMUM_PYTHON = "3.11"

#: Where the matrix, its last results and the reasons for each bound are written up.
VERSIONS_PAGE = "docs/versions.md in polyamp's source"

#: The pip extra that installs each framework.
_EXTRAS = {"torch": "torch", "tensorflow": "tensorflow", "keras": "keras", "jax": "jax", "optax": "jax"}


class UntestedVersionWarning(UserWarning):
    """A framework older than the oldest release polyamp is tested with (`MINIMUM_VERSIONS`).

    polyamp may work with it, but nothing checks that it does. Upgrade the framework (the message says how),
    or silence it with ``warnings.filterwarnings("ignore", category=polyamp.UntestedVersionWarning)``.
    """


def parse_version(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.13.0+cpu"`` is ``(2, 13, 0)``, ``"0.4.38.dev1"``
    ``(0, 4, 38)``; pre-release and local parts are ignored (a ``2.20.0rc1`` counts as 2.20.0)."""
    numbers = []
    for part in version.strip().split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(numbers)


def _at_least(version: str, minimum: str) -> bool:
    have, need = parse_version(version), parse_version(minimum)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def untested(versions: dict[str, str]) -> dict[str, str]:
    """Of ``{framework: installed version}``, those older than their minimum (frameworks not in
    `MINIMUM_VERSIONS`, and versions that are not numbers, are left out)."""
    return {
        name: version
        for name, version in versions.items()
        if name in MINIMUM_VERSIONS and parse_version(version) and not _at_least(version, MINIMUM_VERSIONS[name])
    }


def warn_if_untested(package: str, versions: dict[str, str], *, stacklevel: int = 2) -> str | None:
    """Warn once (`UntestedVersionWarning`) if any framework in ``versions`` is older than polyamp's tested
    minimum; return the message, or None when everything is within the tested range.

    Args:
        package: the polyamp package being imported (``"polyamp_torch"``), named in the message.
        versions: the installed version of each framework it uses, ``{"torch": torch.__version__}``.
        stacklevel: passed to `warnings.warn`.
    """
    old = untested(versions)
    if not old:
        return None
    found = ", ".join(f"{name} {version}" for name, version in old.items())
    tested = ", ".join(f"{name} >= {MINIMUM_VERSIONS[name]}" for name in old)
    extras = ",".join(dict.fromkeys(_EXTRAS[name] for name in old))
    message = (
        f"{package} is tested with {tested}; found {found}, which polyamp is not tested with and may not "
        f"work with. Upgrade with: pip install -U 'polyamp[{extras}]' (the versions each release is tested "
        f"with: {VERSIONS_PAGE})."
    )
    warnings.warn(message, UntestedVersionWarning, stacklevel=stacklevel + 1)
    return message


def import_framework(module: str, who: str, what: str, hint: str) -> Any:
    """Import the framework ``module`` for the backend package ``who``; its absence (not a broken dependency
    of it) raises `polyamp.BackendNotInstalledError` saying ``who`` needs ``what`` and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != module.partition(".")[0]:
            raise
        raise BackendNotInstalledError(f"{who} needs {what}, which is not installed. {hint}") from exc
