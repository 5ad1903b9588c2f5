"""The device protocol is fully typed: everything the core reads off a device form is a member of a protocol in
`polyamp.backend_api`, capabilities are read once at binding (no probing for methods by name), and the
scaler's signature and pickles are derived, not restated."""

from __future__ import annotations

import ast
import inspect
import pickle
import typing
from pathlib import Path

import pytest

import polyamp
from polyamp import backend_api as api
from polyamp._src.binding import DeviceCapabilities

CORE = Path(polyamp.__file__).resolve().parent / "_src"

#: Every protocol a device form (or a functional form) may implement, and its optional methods.
DEVICE_PROTOCOLS = (
    api.ScalerDevice,
    api.ImperativeDevice,
    api.TapeDevice,
    api.FunctionalDevice,
    api.FunctionalRecordingDevice,
    api.FunctionalGuardingDevice,
    api.FunctionalProvenanceDevice,
    api.FunctionalSpikeDevice,
    api.RecordingDevice,
    api.GuardingDevice,
    api.ProvenanceDevice,
    api.SpikeDevice,
    api.OptionalMethods,
)
#: Where the core reads which optional methods a device has: once, when it binds (or is made).
CAPABILITY_READERS = {"binding.py": "of", "functional.py": "_read_capabilities"}


def _members(protocol: type) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_")} - set(dir(typing.Protocol))


def _is_device(node: ast.expr) -> bool:
    """``device`` or ``<anything>._device``: how the core names a device form."""
    return (isinstance(node, ast.Name) and node.id == "device") or (
        isinstance(node, ast.Attribute) and node.attr == "_device"
    )


def _device_reads() -> dict[str, list[str]]:
    reads: dict[str, list[str]] = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and _is_device(node.value):
                reads.setdefault(node.attr, []).append(f"{path.name}:{node.lineno}")
    return reads


def test_every_attribute_the_core_reads_off_a_device_is_a_protocol_member() -> None:
    members = set().union(*(_members(p) for p in DEVICE_PROTOCOLS))
    reads = _device_reads()
    assert {"apply", "unscale_gradients", "spike_check", "write_history", "init"} <= set(reads)  # the scan sees them
    undeclared = {name: where for name, where in reads.items() if name not in members}
    assert undeclared == {}


def test_the_core_looks_for_a_devices_optional_methods_only_when_it_binds() -> None:
    probes = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        allowed = [
            range(node.lineno, (node.end_lineno or node.lineno) + 1)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and CAPABILITY_READERS.get(path.name) == node.name
        ]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _is_device(node.args[0])
                and not any(node.lineno in lines for lines in allowed)
            ):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == []


def test_veto_is_declared_where_the_core_passes_it() -> None:
    parameter = inspect.signature(api.TapeDevice.apply).parameters["veto"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None


def test_capabilities_are_a_frozen_record_read_at_binding() -> None:
    torch = pytest.importorskip("torch")
    scaler = polyamp.LossScaler(backend="torch")
    capabilities = scaler.capabilities
    assert capabilities is not None and capabilities.style == "imperative"
    assert capabilities.guarding and capabilities.recording and capabilities.spike and capabilities.process_groups
    assert capabilities.float16_in_use is not None and capabilities.float16_computed is not None
    assert capabilities.step_own_scaling is not None and capabilities.run_uncompiled is not None
    assert capabilities.replica is None  # torch runs one iteration per process
    with pytest.raises(AttributeError):
        capabilities.spike = False  # type: ignore[misc]
    assert torch.is_tensor(scaler.scale(torch.ones(())))


def test_a_device_with_no_loop_style_is_refused_at_binding() -> None:
    class Nothing:
        def check_optimizer(self, method: str, optimizer: object) -> None: ...

    with pytest.raises(polyamp.PolyampTypeError, match="implements neither"):
        DeviceCapabilities.of(Nothing(), "nothing")  # type: ignore[arg-type]


def test_the_signature_is_derived_from_the_constructor() -> None:
    parameters = inspect.signature(polyamp.LossScaler).parameters
    assert list(parameters)[:4] == ["init_scale", "growth_factor", "backoff_factor", "growth_interval"]
    own = [
        name
        for name, p in inspect.signature(polyamp.LossScaler.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert own == ["enabled", "backend", "guard", "on_min_scale", "history", "spike", "process_group", "skip_on_device"]
    assert list(parameters)[-len(own) :] == own
    assert parameters["spike"].default is None and parameters["history"].default == 256
    assert parameters["skip_on_device"].default is False
    assert set(polyamp.LossScaleConfig.setting_names()) <= set(parameters)


def test_torch_scaler_signature_and_pickle_keep_its_device_option() -> None:
    torch = pytest.importorskip("torch")
    import polyamp_torch

    parameters = inspect.signature(polyamp_torch.TorchLossScaler).parameters
    # GradScaler's six arguments (device, init_scale, growth_factor, backoff_factor, growth_interval, enabled),
    # in its order: positional calls written for GradScaler mean the same.
    assert list(parameters)[:6] == list(inspect.signature(torch.amp.GradScaler).parameters)
    assert parameters["enabled"].default is True and "spike" in parameters
    scaler = polyamp_torch.TorchLossScaler("cpu", 1024.0, guard=True, history=16, spike=polyamp.SpikeRule("loss"))
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.device == "cpu" and copy.get_scale() == 1024.0
    assert copy.spike == scaler.spike and copy._options() == scaler._options()
