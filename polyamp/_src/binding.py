"""Binding a scaler to a backend: the device form, and what it can do, read once.

A device form implements `polyamp.backend_api.ImperativeDevice` or `TapeDevice` and any of the optional
protocols of `polyamp._src.backend`. `DeviceCapabilities.of` reads which ones, once, when a scaler binds; the
core consults the frozen record from then on and never probes a device for a method by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from polyamp._src import registry
from polyamp._src.backend import (
    AdvancingTapeDevice,
    ClippingDevice,
    CompilingDevice,
    DeviceSkippingDevice,
    Float16HintDevice,
    Float16ProbeDevice,
    GuardingDevice,
    ImperativeDevice,
    ImperativeGuardingDevice,
    ImperativeProvenanceDevice,
    OwnScalingDevice,
    ParameterCheckDevice,
    ProcessGroupDevice,
    ProvenanceDevice,
    RecordingDevice,
    ReplicaDevice,
    ScalerDevice,
    SpikeDevice,
    TapeClippingDevice,
    TapeDevice,
    UncompiledDevice,
    UnscaledLossWarningDevice,
)
from polyamp._src.errors import PolyampTypeError, describe
from polyamp._src.scaling import LossScaleConfig, LossScaleState

__all__ = ["DeviceCapabilities", "LoopStyle", "make_device"]

LoopStyle = Literal["imperative", "tape"]


def _never() -> bool:
    return False


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a bound device form can do, read from the protocols it implements when the scaler binds.

    Attributes:
        style: The loop style: ``"imperative"`` (`ImperativeDevice`) or ``"tape"`` (`TapeDevice`).
        recording: `RecordingDevice`: step records are kept on the device and read in batches.
        guarding: The guard is possible: `GuardingDevice` (tape) or `ImperativeGuardingDevice`.
        device_provenance: `ProvenanceDevice`: non-finite gradients are counted on the device.
        host_provenance: `ImperativeProvenanceDevice` (imperative only): counted on the host's request.
        spike: `SpikeDevice`: a `polyamp.SpikeRule` can be decided on the device.
        compiling: `CompilingDevice.compiling`, or a function answering False.
        run_uncompiled: `UncompiledDevice.run_uncompiled`, or None.
        replica: `ReplicaDevice.replica`, or None (one iteration).
        float16_in_use: `Float16HintDevice.float16_in_use`, or None.
        float16_computed: `Float16ProbeDevice.float16_computed`, or None.
        step_own_scaling: `OwnScalingDevice.step_own_scaling` (imperative only), or None.
        process_groups: `ProcessGroupDevice`: flags can be reduced over a process group.
        unscaled_loss_warning: `UnscaledLossWarningDevice.unscaled_loss_warning`, or None (the iteration rule
            raises).
        unscale_and_clip: `ClippingDevice.unscale_and_clip` (imperative only), or None (clipping after the
            unscale, as two steps).
        unscale_and_clip_values: `TapeClippingDevice.unscale_and_clip_values` (tape only), or None.
        step_on_device: `DeviceSkippingDevice.step_on_device` (imperative only), or None (every step that is
            not fused is decided on the host).
        apply_and_advance: `AdvancingTapeDevice.apply_and_advance` (tape only), or None (``apply``, then
            ``update``).
        non_finite_parameters: `ParameterCheckDevice.non_finite_parameters`, or None.
    """

    style: LoopStyle
    recording: bool = False
    guarding: bool = False
    device_provenance: bool = False
    host_provenance: bool = False
    spike: bool = False
    compiling: Callable[[], bool] = _never
    run_uncompiled: Callable[..., Any] | None = None
    replica: Callable[[], Any] | None = None
    float16_in_use: Callable[..., bool] | None = None
    float16_computed: Callable[[Any], bool] | None = None
    step_own_scaling: Callable[..., Any] | None = None
    process_groups: bool = False
    unscaled_loss_warning: Callable[[str], str] | None = None
    unscale_and_clip: Callable[[Any, float, float], Any] | None = None
    unscale_and_clip_values: Callable[..., Any] | None = None
    step_on_device: Callable[..., Any] | None = None
    apply_and_advance: Callable[..., Any] | None = None
    non_finite_parameters: Callable[[Sequence[Any]], list[Any]] | None = None

    @classmethod
    def of(cls, device: ScalerDevice, backend: str) -> DeviceCapabilities:
        """Read ``device``'s protocols.

        Raises:
            PolyampTypeError: it implements neither `ImperativeDevice` nor `TapeDevice`.
        """
        style: LoopStyle
        if isinstance(device, ImperativeDevice):
            style = "imperative"
        elif isinstance(device, TapeDevice):
            style = "tape"
        else:
            raise PolyampTypeError(
                f"The {backend!r} backend's device form {describe(device)} implements neither "
                "polyamp.backend_api.ImperativeDevice nor TapeDevice."
            )
        imperative = style == "imperative"
        return cls(
            style=style,
            recording=isinstance(device, RecordingDevice),
            guarding=isinstance(device, ImperativeGuardingDevice if imperative else GuardingDevice),
            device_provenance=isinstance(device, ProvenanceDevice),
            host_provenance=imperative and isinstance(device, ImperativeProvenanceDevice),
            spike=isinstance(device, SpikeDevice),
            compiling=device.compiling if isinstance(device, CompilingDevice) else _never,
            run_uncompiled=device.run_uncompiled if isinstance(device, UncompiledDevice) else None,
            replica=device.replica if isinstance(device, ReplicaDevice) else None,
            float16_in_use=device.float16_in_use if isinstance(device, Float16HintDevice) else None,
            float16_computed=device.float16_computed if isinstance(device, Float16ProbeDevice) else None,
            step_own_scaling=device.step_own_scaling if imperative and isinstance(device, OwnScalingDevice) else None,
            process_groups=isinstance(device, ProcessGroupDevice),
            unscaled_loss_warning=(
                device.unscaled_loss_warning if isinstance(device, UnscaledLossWarningDevice) else None
            ),
            unscale_and_clip=device.unscale_and_clip if imperative and isinstance(device, ClippingDevice) else None,
            unscale_and_clip_values=(
                device.unscale_and_clip_values if not imperative and isinstance(device, TapeClippingDevice) else None
            ),
            step_on_device=device.step_on_device if imperative and isinstance(device, DeviceSkippingDevice) else None,
            apply_and_advance=(
                device.apply_and_advance if not imperative and isinstance(device, AdvancingTapeDevice) else None
            ),
            non_finite_parameters=(device.non_finite_parameters if isinstance(device, ParameterCheckDevice) else None),
        )


def make_device(
    backend: str,
    config: LossScaleConfig,
    state: LossScaleState,
    process_group: Any,
    *,
    spike: bool,
    device: ScalerDevice | None = None,
) -> tuple[ScalerDevice, DeviceCapabilities]:
    """The device form of ``backend`` starting from ``state`` (or ``device``, one made by an adapter from the
    same config and state, e.g. over an optimizer's own variables), and its capabilities.

    Raises:
        UnknownBackendError / BackendNotInstalledError: no such backend, or its framework is missing.
        PolyampTypeError: the device form offers no loop style polyamp knows, cannot reduce over
            ``process_group``, or cannot apply a spike rule when ``spike`` is asked for.
    """
    if device is None:
        device = registry.get_backend(backend).make_device(config, state)
    capabilities = DeviceCapabilities.of(device, backend)
    if process_group is not None:
        if not capabilities.process_groups:
            raise PolyampTypeError(
                f"The {backend!r} backend's scaler cannot reduce its found-inf flag over a process group; "
                "construct the LossScaler without process_group."
            )
        device.set_process_group(process_group)  # type: ignore[attr-defined]  # checked: ProcessGroupDevice
    if spike and not capabilities.spike:
        raise PolyampTypeError(
            f"The {backend!r} backend's scaler cannot apply a SpikeRule (its device form does not implement "
            "polyamp.backend_api.SpikeDevice). Construct the LossScaler without spike=."
        )
    return device, capabilities
