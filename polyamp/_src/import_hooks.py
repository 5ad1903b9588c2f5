"""Run a callback once a module has been imported, without importing it and without waiting for it.

polyamp's core never imports a framework, yet a policy set before ``import keras`` must still reach Keras.
`when_imported` calls back once the module is *fully* imported:

* at once, in the calling thread, if it already is;
* right after the module body has run, in the importing thread and before its ``import`` statement
  returns, if the import has not started yet: a meta-path finder wraps that module's loader. The finder is
  on ``sys.meta_path`` only while some callback is pending, and removes itself afterwards;
* from a short-lived helper thread once the import ends, if the module is half imported (in
  ``sys.modules`` with its body still running, typically in another thread) and the finder did not see
  that import start. Waiting there instead of in the caller is what keeps polyamp out of import deadlocks:
  the importing thread holds the module's import lock, and may need a lock the caller holds.

Nothing here ever imports the module it waits for. A failing callback never breaks the user's import: it
becomes a ``RuntimeWarning`` that says what failed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Literal

__all__ = ["Callback", "import_state", "pending_modules", "when_imported"]

Callback = Callable[[ModuleType], None]
ImportState = Literal["absent", "importing", "imported"]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}
_executing: set[str] = set()  # modules polyamp's loader was handed out for, not fired yet


def import_state(name: str) -> ImportState:
    """Whether ``name`` is not in ``sys.modules``, half imported (its body still running), or imported."""
    module = sys.modules.get(name)
    if module is None:
        return "absent"
    return "importing" if _initializing(module) else "imported"


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is fully imported (see the module docstring for where)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or name in _executing:  # not started, or polyamp's loader will fire at its end
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    if _initializing(module):
        _call_after_import(name, module, [callback])
    else:
        _call(name, module, callback)


def pending_modules() -> tuple[str, ...]:
    """The module names some callback is still waiting for."""
    with _lock:
        return tuple(_pending)


def _initializing(module: ModuleType) -> bool:
    # importlib sets ModuleSpec._initializing while a module body runs (its own `import` fast path reads
    # it the same way to tell a half-imported module from a finished one).
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _call(name: str, module: ModuleType, callback: Callback) -> None:
    try:
        callback(module)
    except Exception as exc:  # an import must not fail because of polyamp
        warnings.warn(
            f"polyamp could not finish setting up after {name!r} was imported: {exc!r}. "
            f"{name} works as usual, but without polyamp's setting; call polyamp.set_policy(...) "
            "again after the import to apply it.",
            RuntimeWarning,
            stacklevel=3,
        )


def _call_after_import(name: str, module: ModuleType, callbacks: list[Callback]) -> None:
    """Call back from a helper thread once the half-imported ``module`` is done, never blocking the caller."""

    def wait_then_call() -> None:
        delay = 0.0005
        while sys.modules.get(name) is module and _initializing(module):
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        for callback in callbacks:
            if sys.modules.get(name) is module:
                _call(name, module, callback)
            else:  # that import failed (importlib removed the module): wait for the next one
                when_imported(name, callback)

    try:
        threading.Thread(target=wait_then_call, name=f"polyamp-after-import-{name}", daemon=True).start()
    except RuntimeError:  # interpreter shutdown: no new threads, and nothing left to set up
        pass


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
        _executing.discard(name)
        if not _pending and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for callback in callbacks:
        _call(name, module, callback)


def _adopt_unseen_imports() -> None:
    """Hand pending modules that got imported without the finder seeing it (it joined the meta path just
    after another thread looked the module up) to a helper thread."""
    with _lock:
        adopted = [
            (name, sys.modules[name], _pending.pop(name))
            for name in list(_pending)
            if name in sys.modules and name not in _executing
        ]
        if adopted and not _pending and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for name, module, callbacks in adopted:
        _call_after_import(name, module, callbacks)


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
        with _lock:
            _executing.add(self._name)
        try:
            self._loader.exec_module(module)
        except BaseException:
            with _lock:  # the callbacks stay pending for the next attempt to import the module
                _executing.discard(self._name)
            raise
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
            if any(name in sys.modules and name not in _executing for name in list(_pending)):
                _adopt_unseen_imports()
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
        with _lock:  # from here on the import is polyamp's to fire, even before the module body starts
            _executing.add(fullname)
        return spec


_FINDER = _PostImportFinder()
