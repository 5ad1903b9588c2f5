"""Run a callback once a module has been imported, without importing it.

polyamp's core never imports a framework, yet a policy set before ``import keras`` must still reach Keras.
`when_imported` calls back at once if the module is already in ``sys.modules``; otherwise a meta-path
finder wraps that module's loader and calls back right after the module body has run. The finder is on
``sys.meta_path`` only while some callback is pending, and removes itself afterwards.

A failing callback never breaks the user's import: it becomes a ``RuntimeWarning`` that says what failed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["pending_modules", "when_imported"]

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after it gets imported."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


def pending_modules() -> tuple[str, ...]:
    """The module names some callback is still waiting for."""
    with _lock:
        return tuple(_pending)


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
        if not _pending and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # an import must not fail because of polyamp
            warnings.warn(
                f"polyamp could not finish setting up after {name!r} was imported: {exc!r}. "
                f"{name} works as usual, but without polyamp's setting; call polyamp.set_policy(...) "
                "again after the import to apply it.",
                RuntimeWarning,
                stacklevel=2,
            )


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader and fires the pending callbacks once the module body has run."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Hand the module its real loader so introspection (importlib.resources, pkgutil) sees no wrapper.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _fire(self._name, module)

    def __getattr__(self, attr: str) -> object:
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._searching = threading.local()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        searching: set[str] = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:  # the lookup below re-enters the meta path; let the real finders answer
            return None
        searching.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            searching.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, fullname)
        return spec


_FINDER = _PostImportFinder()
