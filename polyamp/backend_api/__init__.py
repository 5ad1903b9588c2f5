"""The public API for writing a polyamp backend: everything a framework translation may use.

A backend never imports ``polyamp._src``; it imports this package (and ``polyamp``):

* a `BackendSpec` (import-free: a name, a ``"module:attribute"`` target, the framework modules it handles)
  registered with `register_backend` or the ``polyamp.backends`` entry-point group; `backend_specs`,
  `get_backend`, `detect_backend` and `backend_name_for` read the registry;
* a `Backend` whose ``make_device(config, state)`` returns a device form of one loop style, `ImperativeDevice`
  (PyTorch-style) or `TapeDevice` (TensorFlow-style); a `FunctionalBackend` also makes a `FunctionalDevice`
  (state in, state out, for jitted steps);
* four capability groups a device form may add, each with its functional twin: `RecordingDevice` /
  `FunctionalRecordingDevice` (step records on the device), `GuardingDevice` / `FunctionalGuardingDevice`
  (steps without scaling checked), `ProvenanceDevice` / `FunctionalProvenanceDevice` (which gradients held
  inf/NaN), `SpikeDevice` / `FunctionalSpikeDevice` (`polyamp.SpikeRule`); and the `OptionalMethods`, one
  capability each. The core reads which a device has once, when a scaler binds;
* `ArrayDevice`, the stateful device work written once over `rules.ArrayOps` for a framework of eager,
  replaceable arrays (the scale, the skip count, step records, the spike window): such a backend adds only
  its loss scaling, unscaling and step;
* `ScalerAdapter`, for an adapter that runs a `polyamp.LossScaler` inside its framework's machinery (a
  jitted stateless step, variables the framework restores);
* the device rules (`rules`): the loss-scale rule, the spike rule, the record codes and the non-finite counts,
  written once over `rules.ArrayOps`, which a device calls with its framework's namespace;
* the core's helpers, by subject, so that messages and numerics match: `arguments` (checks and wording),
  `checkpoints` (reading files for `polyamp.check_hazards`), `forward_watch`, `policies` (the policy as a
  backend reads it, the op-class table), `records`, `state_dicts`, `training_state` and `versions`
  (`versions.warn_if_untested` when the backend is imported).

`polyamp.LossScaler` owns the semantics (stages, misuse errors, skip records, the enabled rule, state dicts);
the device form only performs device operations. A complete worked example is the NumPy backend in polyamp's
test suite (tests/numpy_backend/).
"""

from polyamp._src.adapter import ScalerAdapter
from polyamp._src.array_device import ArrayDevice
from polyamp._src.backend import (
    Backend,
    Flag,
    FunctionalBackend,
    FunctionalDevice,
    FunctionalGuardingDevice,
    FunctionalProvenanceDevice,
    FunctionalRecordingDevice,
    FunctionalSpikeDevice,
    GuardingDevice,
    ImperativeDevice,
    ProvenanceDevice,
    RecordingDevice,
    ScalerDevice,
    SpikeDevice,
    StepOutcome,
    TapeDevice,
)
from polyamp._src.optional_methods import OptionalMethods
from polyamp._src.registry import (
    BackendSpec,
    backend_name_for,
    backend_specs,
    detect_backend,
    get_backend,
    register_backend,
)
from polyamp.backend_api import (
    arguments,
    checkpoints,
    forward_watch,
    policies,
    records,
    rules,
    state_dicts,
    training_state,
    versions,
)

__all__ = [
    "ArrayDevice",
    "Backend",
    "BackendSpec",
    "Flag",
    "FunctionalBackend",
    "FunctionalDevice",
    "FunctionalGuardingDevice",
    "FunctionalProvenanceDevice",
    "FunctionalRecordingDevice",
    "FunctionalSpikeDevice",
    "GuardingDevice",
    "ImperativeDevice",
    "OptionalMethods",
    "ProvenanceDevice",
    "RecordingDevice",
    "ScalerAdapter",
    "ScalerDevice",
    "SpikeDevice",
    "StepOutcome",
    "TapeDevice",
    "arguments",
    "backend_name_for",
    "backend_specs",
    "checkpoints",
    "detect_backend",
    "forward_watch",
    "get_backend",
    "policies",
    "records",
    "register_backend",
    "rules",
    "state_dicts",
    "training_state",
    "versions",
]
