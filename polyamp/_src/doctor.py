"""``python -m polyamp doctor``: what this machine has, and which policy suits it.

Frameworks are found with ``importlib.util.find_spec`` and their versions with ``importlib.metadata``, from the
distribution that provides the module (``tensorflow-cpu`` or ``tf-nightly`` for ``tensorflow``); a
framework is imported only to ask it about devices (``torch.cuda``, ``tf.config``, ``jax.devices()``), and only
when probing was asked for. The core never imports one at ``import polyamp``: this module names frameworks by
string and imports them through `importlib`.

The recommendation (`recommend`) is one rule, used by the doctor and by the policy name ``"auto"``:

1. CUDA GPUs with a known compute capability (seen by any framework): the lowest capability decides, since a
   policy applies to the whole process. >= 8.0 (Ampere and later: bfloat16 tensor cores) -> ``"mixed_bfloat16"``;
   >= 7.0 (Volta, Turing: float16 tensor cores only) -> ``"mixed_float16"``; below 7.0 (no tensor cores) ->
   ``"float32"``. CUDA GPUs whose capability no framework reports -> ``"float32"``.
2. Otherwise TPUs (JAX or TensorFlow) -> ``"mixed_bfloat16"`` (TPUs multiply in bfloat16 natively).
3. Otherwise the CPU: ``"mixed_bfloat16"`` when it runs bfloat16 natively, that is when ``/proc/cpuinfo`` lists
   ``avx512_bf16`` or ``amx_bf16``, or torch (when probed) reports AVX512-BF16 or AMX tiles
   (``torch.cpu._is_avx512_bf16_supported()``, ``torch.cpu._is_amx_tile_supported()``); else ``"float32"``:
   mixed precision on CPU rarely pays without those instructions.

Apple MPS devices are listed but do not change the choice: ``polyamp_torch.autocast()`` runs on CUDA if
available, else on the CPU (pass ``device_type="mps"`` to use MPS).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from polyamp._src import registry
from polyamp._src.doctor_fp8 import Float8Advice, advise_float8

__all__ = [
    "FRAMEWORKS",
    "CpuInfo",
    "DeviceInfo",
    "Diagnosis",
    "Recommendation",
    "cpu_info",
    "diagnose",
    "recommend",
    "recommended_policy",
]

#: The frameworks the doctor can probe for devices (through their backend's ``BackendSpec.device_probe``), in
#: the order it imports them (torch before TensorFlow).
FRAMEWORKS: Final = ("torch", "tensorflow", "jax")
_REPORTED: Final = ("torch", "tensorflow", "keras", "jax")
_CPU_BF16_FLAGS: Final = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator a framework sees.

    Attributes:
        framework: ``"torch"``, ``"tensorflow"`` or ``"jax"``.
        kind: ``"cuda"``, ``"mps"``, ``"tpu"`` or ``"gpu"`` (a GPU of unknown vendor).
        index: Its index within the framework and kind.
        name: The device name the framework reports.
        compute_capability: CUDA compute capability as (major, minor), None when unknown or not CUDA.
    """

    framework: str
    kind: str
    index: int
    name: str
    compute_capability: tuple[int, int] | None = None

    @property
    def float16_tensor_cores(self) -> bool:
        """A CUDA device with compute capability >= 7.0."""
        return self.kind == "cuda" and self.compute_capability is not None and self.compute_capability >= (7, 0)

    @property
    def bfloat16_tensor_cores(self) -> bool:
        """A CUDA device with compute capability >= 8.0."""
        return self.kind == "cuda" and self.compute_capability is not None and self.compute_capability >= (8, 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, with stable keys."""
        cc = self.compute_capability
        return {
            "framework": self.framework,
            "kind": self.kind,
            "index": self.index,
            "name": self.name,
            "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
            "float16_tensor_cores": self.float16_tensor_cores,
            "bfloat16_tensor_cores": self.bfloat16_tensor_cores,
        }


@dataclass(frozen=True)
class CpuInfo:
    """What decides bfloat16 on the CPU.

    Attributes:
        bfloat16: The CPU runs bfloat16 natively (AVX512-BF16 or AMX).
        evidence: Where that came from, e.g. ``"avx512_bf16 in /proc/cpuinfo"``, or why it is False.
        machine: ``platform.machine()``.
        torch_capability: ``torch.backends.cpu.get_cpu_capability()`` when torch was probed, else None.
    """

    bfloat16: bool
    evidence: str
    machine: str
    torch_capability: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values, with stable keys."""
        return {
            "bfloat16": self.bfloat16,
            "evidence": self.evidence,
            "machine": self.machine,
            "torch_capability": self.torch_capability,
        }


@dataclass(frozen=True)
class Recommendation:
    """The policy for this machine, and why."""

    policy: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain values, with stable keys."""
        return {"policy": self.policy, "reason": self.reason}


def recommend(devices: Iterable[DeviceInfo], cpu: CpuInfo) -> Recommendation:
    """The policy for a machine with these devices and this CPU (the rule is in this module's docstring).

    >>> recommend([DeviceInfo("torch", "cuda", 0, "A100", (8, 0))], CpuInfo(False, "", "x86_64")).policy
    'mixed_bfloat16'
    >>> recommend([DeviceInfo("torch", "cuda", 0, "T4", (7, 5))], CpuInfo(True, "", "x86_64")).policy
    'mixed_float16'
    >>> recommend([], CpuInfo(False, "", "x86_64")).policy
    'float32'
    """
    devices = list(devices)
    cuda = [d for d in devices if d.kind == "cuda"]
    known = [d for d in cuda if d.compute_capability is not None]
    if known:
        weakest = min(known, key=lambda d: d.compute_capability or (0, 0))
        cc = weakest.compute_capability or (0, 0)
        where = f"{weakest.name} (compute capability {cc[0]}.{cc[1]})"
        if len({d.compute_capability for d in known}) > 1:
            where += ", the lowest of the CUDA devices here; a policy applies to all of them"
        if cc >= (8, 0):
            return Recommendation(
                "mixed_bfloat16",
                f"{where} has bfloat16 tensor cores (compute capability >= 8.0): bfloat16 runs at float16's "
                "speed with float32's range, so no loss scaling is needed.",
            )
        if cc >= (7, 0):
            return Recommendation(
                "mixed_float16",
                f"{where} has float16 tensor cores but no bfloat16 ones (those need compute capability >= 8.0): "
                "float16 with loss scaling (polyamp.LossScaler).",
            )
        return Recommendation(
            "float32",
            f"{where} has no tensor cores (float16 ones need compute capability >= 7.0): mixed precision saves "
            "memory there but rarely time.",
        )
    if cuda:
        return Recommendation(
            "float32",
            "no framework reported the compute capability of the CUDA devices "
            f"({', '.join(d.name for d in cuda)}), so their tensor cores are unknown; 'mixed_bfloat16' needs "
            ">= 8.0, 'mixed_float16' >= 7.0.",
        )
    tpus = [d for d in devices if d.kind == "tpu"]
    if tpus:
        return Recommendation(
            "mixed_bfloat16", f"{tpus[0].name} is a TPU: its matrix units multiply in bfloat16 natively."
        )
    if cpu.bfloat16:
        return Recommendation(
            "mixed_bfloat16",
            f"no CUDA device; the CPU runs bfloat16 natively ({cpu.evidence}): bfloat16 matmuls and "
            "convolutions use those instructions, usually faster than float32, and need no loss scaling.",
        )
    return Recommendation(
        "float32",
        f"no CUDA device, and the CPU has no native bfloat16 ({cpu.evidence}): mixed precision on CPU rarely "
        "pays without AVX512-BF16 or AMX (float16 CPU kernels are slow or missing), so stay in float32.",
    )


def _cpuinfo_flags() -> tuple[set[str], str | None]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return set(value.split()), "/proc/cpuinfo"
    return set(), "/proc/cpuinfo"


def cpu_info(torch: Any = None) -> CpuInfo:
    """Whether the CPU runs bfloat16 natively, from ``/proc/cpuinfo`` and, when given, the ``torch`` module."""
    flags, source = _cpuinfo_flags()
    found = sorted(flags & _CPU_BF16_FLAGS)
    evidence = [f"{', '.join(found)} in {source}"] if found else []
    capability = None
    if torch is not None:
        capability = str(torch.backends.cpu.get_cpu_capability())
        checks = (("_is_avx512_bf16_supported", "AVX512-BF16"), ("_is_amx_tile_supported", "AMX tiles"))
        for attr, label in checks:
            probe = getattr(torch.cpu, attr, None)
            if probe is not None and probe():
                evidence.append(f"torch reports {label}")
    if evidence:
        return CpuInfo(True, "; ".join(evidence), platform.machine(), capability)
    where = source or "no /proc/cpuinfo"
    if torch is not None:
        where += f", torch capability {capability}"
    return CpuInfo(False, f"neither avx512_bf16 nor amx_bf16: {where}", platform.machine(), capability)


def _version(module: str, providers: Mapping[str, list[str]] | None = None) -> str | None:
    """The version of the distribution that provides `module`, None when `module` is not installed.

    A module's distribution may be named otherwise (``tensorflow`` comes from ``tensorflow-cpu``,
    ``tensorflow-intel`` or ``tf-nightly``), and several distributions may write files under one top-level name
    (a plugin, or a stale second install): the one whose files hold the ``__init__.py`` that ``import module``
    loads is chosen, else the first that is installed. ``providers`` is
    ``importlib.metadata.packages_distributions()``, passed by a caller asking about several modules.
    """
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if providers is None:
        providers = importlib.metadata.packages_distributions()
    found: list[importlib.metadata.Distribution] = []
    for name in dict.fromkeys([*providers.get(module, []), module]):
        try:
            found.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    if not found:
        return "unknown"
    if len(found) > 1 and spec.origin:
        origin = os.path.realpath(spec.origin)
        init = f"{module}/__init__.py"
        for dist in found:
            for file in dist.files or ():
                if file.as_posix() == init and os.path.realpath(str(dist.locate_file(file))) == origin:
                    return str(dist.version)
    return str(found[0].version)


def _keras_backend() -> tuple[str, str]:
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return str(keras.backend.backend()), "keras is imported"
    env = os.environ.get("KERAS_BACKEND")
    if env:
        return env, "KERAS_BACKEND"
    home = Path(os.environ.get("KERAS_HOME") or Path.home() / ".keras")
    config = home / "keras.json"
    try:
        backend = json.loads(config.read_text()).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if isinstance(backend, str):
        return backend, str(config)
    return "tensorflow", "Keras's default"


@dataclass(frozen=True)
class Diagnosis:
    """What the doctor found: versions, devices, the CPU, and the recommended policy.

    ``to_dict()`` is the ``--json`` output; its keys are stable: ``python``, ``polyamp``, ``platform``,
    ``frameworks`` (each of torch, tensorflow, keras, jax: ``installed``, ``version``, and for keras
    ``backend`` and ``backend_source``), ``probed`` (the frameworks asked about devices), ``devices`` (list of
    `DeviceInfo.to_dict`), ``cuda`` (bool), ``cpu`` (`CpuInfo.to_dict`), ``notes`` (list of str),
    ``recommendation`` (`Recommendation.to_dict`), ``float8`` (`Float8Advice.to_dict`: FP8 native, emulated
    or none, and the FP8 policy to try).
    """

    python: str
    polyamp: str
    platform: str
    frameworks: dict[str, dict[str, Any]]
    probed: tuple[str, ...]
    devices: tuple[DeviceInfo, ...]
    cpu: CpuInfo
    notes: tuple[str, ...]
    recommendation: Recommendation
    float8: Float8Advice | None = None
    cuda: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda", any(d.kind == "cuda" for d in self.devices))

    def to_dict(self) -> dict[str, Any]:
        """Plain values with stable keys (see the class docstring)."""
        return {
            "python": self.python,
            "polyamp": self.polyamp,
            "platform": self.platform,
            "frameworks": self.frameworks,
            "probed": list(self.probed),
            "devices": [d.to_dict() for d in self.devices],
            "cuda": self.cuda,
            "cpu": self.cpu.to_dict(),
            "notes": list(self.notes),
            "recommendation": self.recommendation.to_dict(),
            "float8": None if self.float8 is None else self.float8.to_dict(),
        }

    def format(self) -> str:
        """The human-readable report ``python -m polyamp doctor`` prints."""
        lines = [
            "polyamp doctor",
            f"  Python      {self.python} ({self.platform})",
            f"  polyamp     {self.polyamp}",
            "Frameworks",
        ]
        for name, info in self.frameworks.items():
            if not info["installed"]:
                lines.append(f"  {name:<11} not installed")
                continue
            extra = f" (backend: {info['backend']}, from {info['backend_source']})" if name == "keras" else ""
            lines.append(f"  {name:<11} {info['version']}{extra}")
        probed = ", ".join(self.probed) if self.probed else "none"
        lines.append(f"Devices (probed: {probed})")
        for d in self.devices:
            line = f"  {d.framework:<11} {d.kind}:{d.index} {d.name}"
            if d.compute_capability is not None:
                cc = d.compute_capability
                line += (
                    f", compute capability {cc[0]}.{cc[1]}, tensor cores: "
                    f"float16 {'yes' if d.float16_tensor_cores else 'no'}, "
                    f"bfloat16 {'yes' if d.bfloat16_tensor_cores else 'no'}"
                )
            lines.append(line)
        if not self.cuda:
            lines.append("  no CUDA device: " + ("; ".join(self.notes) if self.notes else "no framework was probed"))
        else:
            lines.extend(f"  note: {note}" for note in self.notes)
        capability = f", torch capability {self.cpu.torch_capability}" if self.cpu.torch_capability else ""
        native = "yes" if self.cpu.bfloat16 else "no"
        lines.append(f"  cpu         {self.cpu.machine}{capability}; native bfloat16: {native} ({self.cpu.evidence})")
        lines.append(f"Recommended policy: {self.recommendation.policy}")
        lines.append(f"  {self.recommendation.reason}")
        if self.float8 is not None:
            lines.append(f"FP8: {self.float8.support}" + (f"; try {self.float8.policy}" if self.float8.policy else ""))
            lines.append(f"  {self.float8.reason}")
        return "\n".join(lines)


def _frameworks() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    providers = importlib.metadata.packages_distributions()
    for name in _REPORTED:
        version = _version(name, providers)
        info: dict[str, Any] = {"installed": version is not None, "version": version}
        if name == "keras":
            backend, source = _keras_backend() if version is not None else (None, None)
            info.update(backend=backend, backend_source=source)
        found[name] = info
    return found


def diagnose(frameworks: Sequence[str] | None = None) -> Diagnosis:
    """Probe this machine: installed frameworks, devices, the CPU, and the recommended policy.

    Args:
        frameworks: The frameworks to import and ask about devices, among ``"torch"``, ``"tensorflow"``,
            ``"jax"``; the installed ones are probed, in that order. None: every installed one.
    """
    from polyamp import __version__

    chosen = FRAMEWORKS if frameworks is None else tuple(frameworks)
    installed = _frameworks()  # before probing: importing TensorFlow imports Keras
    devices, notes, probed, cpu = _probe(chosen, report_missing=frameworks is not None)
    return Diagnosis(
        python=platform.python_version(),
        polyamp=__version__,
        platform=f"{platform.system()} {platform.machine()}",
        frameworks=installed,
        probed=probed,
        devices=devices,
        cpu=cpu,
        notes=notes,
        recommendation=recommend(devices, cpu),
        float8=advise_float8(devices, frameworks=[name for name, found in installed.items() if found["installed"]]),
    )


def _probe(
    frameworks: Sequence[str], *, report_missing: bool
) -> tuple[tuple[DeviceInfo, ...], tuple[str, ...], tuple[str, ...], CpuInfo]:
    unknown = [fw for fw in frameworks if fw not in FRAMEWORKS]
    if unknown:
        from polyamp._src.errors import PolyampValueError

        raise PolyampValueError(
            f"Cannot probe {', '.join(map(repr, unknown))}: the doctor probes {', '.join(FRAMEWORKS)}. "
            "Pass some of those."
        )
    devices: list[DeviceInfo] = []
    notes: list[str] = []
    probed: list[str] = []
    torch = None
    specs = registry.backend_specs()  # read once: it scans the installed packages' entry points
    for name in (fw for fw in FRAMEWORKS if fw in frameworks):
        if importlib.util.find_spec(name) is None:
            if report_missing:
                notes.append(f"{name} is not installed")
            continue
        spec = specs[name]
        try:
            probe = registry.load_target(
                spec.device_probe or "", backend=name, install_hint=spec.install_hint, frameworks=spec.frameworks
            )
            found, said = probe()
        except Exception as exc:  # a broken install is reported, not fatal
            notes.append(f"{name}: could not list devices ({type(exc).__name__}: {exc})")
            continue
        devices.extend(DeviceInfo(name, kind, index, device, cc) for kind, index, device, cc in found)
        notes.extend(said)
        probed.append(name)
        if name == "torch":
            torch = sys.modules["torch"]
    return tuple(devices), tuple(notes), tuple(probed), cpu_info(torch)


def _auto_frameworks() -> tuple[str, ...]:
    imported = tuple(fw for fw in FRAMEWORKS if fw in sys.modules)
    if imported:
        return imported
    installed = [fw for fw in FRAMEWORKS if importlib.util.find_spec(fw) is not None]
    return tuple(installed[:1])


def recommended_policy(frameworks: Sequence[str] | None = None) -> Recommendation:
    """The policy `recommend` gives for this machine: what the name ``"auto"`` resolves to.

    Args:
        frameworks: The frameworks to ask about devices. None (what ``"auto"`` uses): the frameworks among
            torch, TensorFlow and JAX that this process has imported already; when it has imported none, the
            first installed of them (torch, then TensorFlow, then JAX), imported now. A framework the process
            has not imported is never imported beside one it has (so TensorFlow never comes before torch).
    """
    chosen = _auto_frameworks() if frameworks is None else tuple(frameworks)
    devices, _, _, cpu = _probe(chosen, report_missing=False)
    return recommend(devices, cpu)
