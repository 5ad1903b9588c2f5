"""The backend registry: which framework object belongs to which backend, and how to load that backend.

Rules, in the spirit of never costing an import:

* A backend is described by a `BackendSpec`: a name, a ``"module:attribute"`` target and the top-level
  framework modules whose objects it handles. Nothing is imported when a spec is registered.
* An object is matched to a backend by the modules its type (and base classes) come from. Its framework
  is necessarily imported already; polyamp never imports one to find out.
* A backend is imported the first time it is needed, then cached. If its framework is missing, the error
  says what to ``pip install``.
* Third-party backends register through the ``polyamp.backends`` entry-point group: each entry point names
  a `BackendSpec` object (in a module that must not import its framework). Entry points are read only when
  a name or an object matches no known backend.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from polyamp._src.errors import (
    BackendConflictError,
    BackendMismatchError,
    BackendNotInstalledError,
    PolyampTypeError,
    UnknownBackendError,
    describe,
)

if TYPE_CHECKING:
    from polyamp._src.backend import Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "backend_name_for",
    "backend_specs",
    "detect_backend",
    "get_backend",
    "load_target",
    "owner_of_module",
    "register_backend",
    "wrong_object_error",
]

ENTRY_POINT_GROUP: Final = "polyamp.backends"


@dataclass(frozen=True)
class BackendSpec:
    """How to find and load one backend, without importing anything.

    Args:
        name: The backend's name, as users pass it (``LossScaler(backend="torch")``).
        target: ``"package.module:attribute"``; the attribute is a class or factory called with no
            arguments that returns the backend object (see `polyamp.backend_api.Backend`).
        frameworks: Top-level modules whose objects (tensors, optimizers, variables) this backend handles.
        install_hint: What to run when the framework is missing, e.g. ``pip install 'polyamp[torch]'``.
        policy_hook: Optional ``"module:function"`` called as ``hook(policy, overrides)`` (a `Policy` and a
            `PolicyOverrides`) on every policy change (`set_policy`, and `policy_scope` in the thread entering it),
            for frameworks that keep their own global precision setting (Keras). It must import nothing but
            the framework modules in ``policy_modules``.
        policy_modules: Modules whose presence (now, or once imported later) makes ``policy_hook`` run;
            defaults to ``frameworks``.
        harness: Optional ``"module:Class"`` of the backend's conformance harness (see
            `polyamp.conformance.Harness`), called with a device type.
        resolve: Optional ``"module:function"`` for a framework whose objects different backends handle
            depending on how it runs (Keras objects belong to the tensorflow backend when Keras runs on
            TensorFlow): called as ``resolve(cls)`` with the type of an object from ``frameworks``, it
            returns the name of the backend that handles it (or None). It must import nothing but the
            framework; it is called once per type.
        tensor_reader: Optional ``"module:function"`` for ``polyamp.check_hazards``: called as ``reader(source)``
            with a `pathlib.Path` (whose name ends with one of ``checkpoint_suffixes``) or an in-memory object of
            one of ``frameworks`` (a model, a state dict), it returns ``(name, dtype, max_abs)`` triples
            (``polyamp.backend_api.checkpoints.TensorSummary``), ``max_abs`` a float computed with the framework (None
            for non-floating tensors). A reader that accepts a ``max_bytes`` keyword is called
            as ``reader(path, max_bytes=N)`` for files: it refuses a file declaring more than N tensor bytes
            (``polyamp.backend_api.checkpoints.check_declared_bytes``) and reads in bounded blocks
            (``chunk_indices``). For files, any error that is not a `polyamp.PolyampError` becomes a
            `polyamp.CheckpointError`.
        checkpoint_suffixes: File-name endings ``tensor_reader`` opens, such as ``(".pt", ".safetensors")``.
        checkpoint_markers: Names of files that make a directory a checkpoint ``tensor_reader`` opens (it is then
            called with the directory's path), such as orbax's ``("_METADATA", "_CHECKPOINT_METADATA")``.
        reads_trees: Whether ``tensor_reader`` also reads nested containers of arrays that no backend's
            ``frameworks`` own (a framework's pytrees, e.g. Flax's states); asked, while its framework is
            imported, for objects no other reader takes.
        device_probe: Optional ``"module:function"`` for ``polyamp doctor``: called with no arguments once the
            framework is importable, it returns the accelerators the framework sees, as ``(kind, index, name,
            compute capability or None)`` tuples (kind ``"cuda"``, ``"mps"``, ``"tpu"`` or ``"gpu"``), and notes
            saying why there are none.
    """

    name: str
    target: str
    frameworks: tuple[str, ...]
    install_hint: str
    policy_hook: str | None = None
    policy_modules: tuple[str, ...] = field(default=())
    harness: str | None = None
    resolve: str | None = None
    tensor_reader: str | None = None
    checkpoint_suffixes: tuple[str, ...] = field(default=())
    checkpoint_markers: tuple[str, ...] = field(default=())
    reads_trees: bool = False
    device_probe: str | None = None

    def __post_init__(self) -> None:
        for attr in ("name", "target", "install_hint"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise PolyampTypeError(
                    f"BackendSpec.{attr} must be a non-empty string. Received: {describe(getattr(self, attr))}."
                )
        if ":" not in self.target:
            raise PolyampTypeError(
                f"BackendSpec.target must look like 'package.module:attribute'. Received: {self.target!r}."
            )
        object.__setattr__(self, "frameworks", _module_names("frameworks", self.frameworks, allow_empty=False))
        modules = _module_names("policy_modules", self.policy_modules, allow_empty=True)
        object.__setattr__(self, "policy_modules", modules or self.frameworks)
        suffixes = self.checkpoint_suffixes
        if isinstance(suffixes, str) or not isinstance(suffixes, (tuple, list)):
            raise PolyampTypeError(
                "BackendSpec.checkpoint_suffixes must be a tuple of file-name endings, e.g. ('.pt',). "
                f"Received: {describe(suffixes)}."
            )
        if not all(isinstance(s, str) and s.startswith(".") and len(s) > 1 for s in suffixes):
            raise PolyampTypeError(
                "BackendSpec.checkpoint_suffixes must hold endings starting with a dot, e.g. ('.pt',). "
                f"Received: {describe(suffixes)}."
            )
        object.__setattr__(self, "checkpoint_suffixes", tuple(suffixes))
        markers = self.checkpoint_markers
        if (
            isinstance(markers, str)
            or not isinstance(markers, (tuple, list))
            or not all(isinstance(m, str) and m and "/" not in m for m in markers)
        ):
            raise PolyampTypeError(
                "BackendSpec.checkpoint_markers must be a tuple of file names, e.g. ('_METADATA',). "
                f"Received: {describe(markers)}."
            )
        object.__setattr__(self, "checkpoint_markers", tuple(markers))
        if not isinstance(self.reads_trees, bool):
            raise PolyampTypeError(
                f"BackendSpec.reads_trees must be True or False. Received: {describe(self.reads_trees)}."
            )
        for attr in ("policy_hook", "harness", "resolve", "tensor_reader"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or ":" not in value):
                raise PolyampTypeError(
                    f"BackendSpec.{attr} must be None or a 'package.module:attribute' string. "
                    f"Received: {describe(value)}."
                )


def _module_names(attr: str, value: object, *, allow_empty: bool) -> tuple[str, ...]:
    # A bare string would silently become a tuple of its characters.
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise PolyampTypeError(
            f"BackendSpec.{attr} must be a tuple of top-level module names, e.g. {attr}=('mylib',). "
            f"Received: {describe(value)}."
        )
    names = tuple(value)
    if not all(isinstance(name, str) and name and "." not in name for name in names) or (not names and not allow_empty):
        raise PolyampTypeError(
            f"BackendSpec.{attr} must hold non-empty top-level module names (no dots), e.g. {attr}=('mylib',). "
            f"Received: {describe(value)}."
        )
    return names


_FIRST_PARTY: Final = (
    BackendSpec(
        name="torch",
        target="polyamp_torch._backend:TorchBackend",
        frameworks=("torch",),
        install_hint="pip install 'polyamp[torch]'",
        harness="polyamp_torch.testing:TorchHarness",
        tensor_reader="polyamp_torch._tensors:read_tensors",
        checkpoint_suffixes=(".pt", ".pth", ".bin", ".ckpt", ".safetensors"),
        device_probe="polyamp_torch._devices:probe_devices",
    ),
    BackendSpec(
        name="tensorflow",
        target="polyamp_tensorflow._backend:TensorFlowBackend",
        frameworks=("tensorflow",),
        install_hint="pip install 'polyamp[tensorflow]'",
        harness="polyamp_tensorflow.testing:TensorFlowHarness",
        device_probe="polyamp_tensorflow._devices:probe_devices",
    ),
    BackendSpec(
        name="keras",
        target="polyamp_keras._backend:KerasBackend",
        frameworks=("keras",),
        install_hint="pip install 'polyamp[keras]'",
        policy_hook="polyamp_keras:follow_polyamp_policy",
        harness="polyamp_keras.testing:KerasHarness",
        resolve="polyamp_keras._backend:backend_for",
        tensor_reader="polyamp_keras._tensors:read_tensors",
        checkpoint_suffixes=(".keras", ".weights.h5"),
    ),
    BackendSpec(
        name="jax",
        target="polyamp_jax._backend:JaxBackend",
        frameworks=("jax", "jaxlib"),
        install_hint="pip install 'polyamp[jax]'",
        harness="polyamp_jax.testing:JaxHarness",
        tensor_reader="polyamp_jax._tensors:read_tensors",
        checkpoint_markers=("_METADATA", "_CHECKPOINT_METADATA"),  # an orbax checkpoint
        reads_trees=True,
        device_probe="polyamp_jax._devices:probe_devices",
    ),
)

_lock = threading.RLock()
_specs: dict[str, BackendSpec] = {spec.name: spec for spec in _FIRST_PARTY}
_framework_owner: dict[str, str] = {fw: spec.name for spec in _FIRST_PARTY for fw in spec.frameworks}
_loaded: dict[str, Backend] = {}
_type_cache: dict[type, str | None] = {}
_entry_points_read = False


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Make a backend known by name and by the framework modules it handles.

    Raises:
        BackendConflictError: the name is taken (by a different spec) and ``replace`` is False.
    """
    if not isinstance(spec, BackendSpec):
        raise PolyampTypeError(
            f"register_backend() takes a polyamp.backend_api.BackendSpec. Received: {describe(spec)}."
        )
    with _lock:
        if spec.name in _specs and not replace and _specs[spec.name] != spec:
            raise BackendConflictError(
                f"A backend named {spec.name!r} is already registered ({_specs[spec.name].target}). "
                "Pass replace=True to override it."
            )
        _specs[spec.name] = spec
        for framework in spec.frameworks:
            _framework_owner[framework] = spec.name
        _loaded.pop(spec.name, None)
        _type_cache.clear()


def _read_entry_points() -> None:
    global _entry_points_read
    with _lock:
        if _entry_points_read:
            return
        _entry_points_read = True
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            spec = entry_point.load()
            if not isinstance(spec, BackendSpec):
                raise PolyampTypeError(
                    f"Entry point {entry_point.name!r} in group {ENTRY_POINT_GROUP!r} must name a "
                    f"polyamp.backend_api.BackendSpec. It names {describe(spec)}."
                )
            if spec.name not in _specs:
                register_backend(spec)


def backend_specs() -> dict[str, BackendSpec]:
    """Every known backend by name: first-party, registered, and those from entry points."""
    _read_entry_points()
    with _lock:
        return dict(_specs)


def _import(module_name: str) -> Any:
    """``importlib.import_module(module_name)`` through the builtin ``__import__``: a tracer that converts the
    Python functions a traced function calls (TensorFlow's AutoGraph, when a scaler binds inside ``tf.function``)
    calls a builtin as it is, and so leaves the import machinery, whose frozen functions it cannot convert, alone."""
    __import__(module_name)
    return sys.modules[module_name]


def load_target(target: str, *, backend: str, install_hint: str, frameworks: tuple[str, ...]) -> Any:
    """Import ``"module:attribute"`` and return the attribute, turning a missing framework into advice."""
    module_name, _, attribute = target.partition(":")
    try:
        module = _import(module_name)
    except BackendNotInstalledError:
        raise
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing.partition(".")[0] in frameworks:
            raise BackendNotInstalledError(
                f"The {backend!r} backend needs {missing!r}, which is not installed. Install it with: {install_hint}"
            ) from exc
        raise BackendNotInstalledError(
            f"The {backend!r} backend could not be imported ({exc}). If its framework is missing or broken, "
            f"reinstall it with: {install_hint}"
        ) from exc
    return getattr(module, attribute)


def get_backend(name: str) -> Backend:
    """Return the backend object for ``name``, importing it (and so its framework) on first use.

    Raises:
        UnknownBackendError: no backend has that name.
        BackendNotInstalledError: the backend's framework is not installed.
    """
    if not isinstance(name, str):
        raise PolyampTypeError(f"A backend name must be a string such as 'torch'. Received: {describe(name)}.")
    with _lock:
        cached = _loaded.get(name)
        if cached is not None:
            return cached
        spec = _specs.get(name)
        if spec is None:
            _read_entry_points()
            spec = _specs.get(name)
        if spec is None:
            raise UnknownBackendError(
                f"Unknown backend {name!r}. Known backends: {', '.join(sorted(_specs))}. Third-party backends "
                f"register through the {ENTRY_POINT_GROUP!r} entry-point group or polyamp.backend_api.register_backend()."
            )
        factory = load_target(spec.target, backend=name, install_hint=spec.install_hint, frameworks=spec.frameworks)
        backend: Backend = factory()
        _loaded[name] = backend
        return backend


def owner_of_module(module: str) -> str | None:
    """The backend registered for a module's top-level package (``"keras.src.models"`` -> ``"keras"``), or None.

    Unlike `backend_name_for`, it does not ask the backend's ``resolve``: Keras objects belong to ``keras``
    here whatever Keras runs on. Never imports anything.
    """
    _read_entry_points()
    with _lock:
        return _framework_owner.get(module.partition(".")[0])


def _owner_of_type(cls: type) -> str | None:
    for klass in cls.__mro__:
        owner = _framework_owner.get(klass.__module__.partition(".")[0])
        if owner is not None:
            spec = _specs.get(owner)
            if spec is not None and spec.resolve is not None:
                resolve = load_target(
                    spec.resolve, backend=spec.name, install_hint=spec.install_hint, frameworks=spec.frameworks
                )
                return resolve(cls)  # type: ignore[no-any-return]
            return owner
    return None


def backend_name_for(obj: object) -> str | None:
    """The name of the backend that handles ``obj``'s type, or None. Never imports a framework.

    Lock-free once a type has been seen (a dict lookup), so it costs nothing in a training step and is
    traceable by compilers such as ``torch.compile``.
    """
    cls = type(obj)
    cached = _type_cache.get(cls, _UNSEEN)
    if cached is not _UNSEEN:
        return cached  # type: ignore[return-value]
    owner = _owner_of_type(cls)
    if owner is None and not _entry_points_read:
        _read_entry_points()
        owner = _owner_of_type(cls)
    _type_cache[cls] = owner  # one atomic store; racing threads store the same answer
    return owner


_UNSEEN: Final = object()


def detect_backend(obj: object) -> str | None:
    """Like `backend_name_for`, also looking inside lists and tuples (of losses, or of (grad, var) pairs)."""
    owner = backend_name_for(obj)
    if owner is None and isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, (list, tuple)):  # (grad, var) pairs
                item = item[0] if item else None
            if item is not None:
                return detect_backend(item)
    return owner


def wrong_object_error(bound: str, method: str, obj: object, expected: str) -> PolyampTypeError:
    """The error for a scaler bound to ``bound`` that was handed ``obj``.

    Names both frameworks when ``obj`` belongs to another one (`BackendMismatchError`), else says what
    ``method`` takes, e.g. ``wrong_object_error("torch", "step", 3, "a torch.optim.Optimizer")``.
    """
    owner = detect_backend(obj)
    if owner is not None and owner != bound:
        return BackendMismatchError(
            f"This LossScaler is bound to {bound}, but {method}() received a {owner} object: {describe(obj)}. "
            "A LossScaler serves one framework; create one per framework (their state dicts are interchangeable)."
        )
    return PolyampTypeError(f"{method}() takes {expected}. Received: {describe(obj)}.")
