"""Binding a scaler to a backend: the device form, and what it can do, read once.

A device form implements `polyamp.backend_api.ImperativeDevice` or `TapeDevice`, any of the capability groups
and any of the `polyamp.backend_api.OptionalMethods`. `DeviceCapabilities.of` reads which, once, when a scaler
binds; the core consults the frozen record from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from polyamp._src import registry
from polyamp._src.backend import (
    GuardingDevice,
    ImperativeDevice,
    ProvenanceDevice,
    RecordingDevice,
    ScalerDevice,
    SpikeDevice,
    TapeDevice,
)
from polyamp._src.errors import PolyampTypeError, describe
from polyamp._src.scaling import LossScaleConfig, LossScaleState

__all__ = ["DeviceCapabilities", "LoopStyle", "make_device"]

LoopStyle = Literal["imperative", "tape"]


def _never() -> bool:
    return False


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a bound device form can do, read when the scaler binds: its loop style, the capability groups it
    implements (`RecordingDevice`, `GuardingDevice`, `ProvenanceDevice`, `SpikeDevice`), and each of the
    `polyamp.backend_api.OptionalMethods` it has, under that method's name (None where it has none;
    ``compiling`` answers False then). ``host_provenance`` is ``non_finite_gradients``, ``process_groups``
    whether it has ``set_process_group``.
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

        def method(name: str, *, only: LoopStyle | None = None) -> Any:
            return getattr(device, name, None) if only in (None, style) else None

        return cls(
            style=style,
            recording=isinstance(device, RecordingDevice),
            guarding=isinstance(device, GuardingDevice)
            and (not imperative or method("check_gradients_finite") is not None),
            device_provenance=isinstance(device, ProvenanceDevice),
            host_provenance=method("non_finite_gradients", only="imperative") is not None,
            spike=isinstance(device, SpikeDevice),
            compiling=method("compiling") or _never,
            run_uncompiled=method("run_uncompiled"),
            replica=method("replica"),
            float16_in_use=method("float16_in_use"),
            float16_computed=method("float16_computed"),
            step_own_scaling=method("step_own_scaling", only="imperative"),
            process_groups=method("set_process_group") is not None,
            unscaled_loss_warning=method("unscaled_loss_warning"),
            unscale_and_clip=method("unscale_and_clip", only="imperative"),
            unscale_and_clip_values=method("unscale_and_clip_values", only="tape"),
            step_on_device=method("step_on_device", only="imperative"),
            apply_and_advance=method("apply_and_advance", only="tape"),
            non_finite_parameters=method("non_finite_parameters"),
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
        device.set_process_group(process_group)  # type: ignore[attr-defined]  # checked: it has the method
    if spike and not capabilities.spike:
        raise PolyampTypeError(
            f"The {backend!r} backend's scaler cannot apply a SpikeRule (its device form does not implement "
            "polyamp.backend_api.SpikeDevice). Construct the LossScaler without spike=."
        )
    return device, capabilities
