"""The public API for writing a polyamp backend: everything a framework translation may use.

A backend never imports ``polyamp._src``; it imports this module (and ``polyamp``). It provides:

* a `polyamp.BackendSpec` (import-free: a name, a ``"module:attribute"`` target, the framework modules it
  handles) registered with `polyamp.register_backend` or the ``polyamp.backends`` entry-point group;
* a `Backend` object whose ``make_device(config, state)`` returns a device form implementing
  `ImperativeDevice` (PyTorch-style loops) or `TapeDevice` (TensorFlow-style loops); a backend with jitted,
  stateless steps is also a `FunctionalBackend` (``make_functional(config)`` returning a `FunctionalDevice`,
  which may also implement `FunctionalRecordingDevice`, `FunctionalGuardingDevice`, `FunctionalSpikeDevice` and
  `FunctionalProvenanceDevice` (the records' ring, the guard and the spike window as trees of arrays in the
  functional state), `FunctionalRunDevice` (records per run, its id in the ring), `FunctionalCeilingDevice` (a scale kept at or below a ceiling such as
  `RECIPROCAL_CEILING`) and `FunctionalTracingDevice` (whether a compiler traced the rule's settings));
* optional protocols a device form may also implement, each one capability: `RecordingDevice` (step records
  on the device), `GuardingDevice` / `ImperativeGuardingDevice` (the guard), `ProvenanceDevice` /
  `ImperativeProvenanceDevice` (which gradients were non-finite), `SpikeDevice` (`polyamp.SpikeRule`),
  `CompilingDevice` / `UncompiledDevice` (a compiler traces the step), `ReplicaDevice` (one step per replica),
  `ProcessGroupDevice` (flags reduced over a process group), `Float16HintDevice` / `Float16ProbeDevice`
  (float16 computation outside polyamp's policy), `UnscaledLossWarningDevice` (the iteration rule warns
  instead of raising, in loops of the framework's own), `OwnScalingDevice` (optimizers that scale by
  themselves), `ParameterCheckDevice` (which parameters hold inf/NaN, asked once per run of skipped steps), `ClippingDevice` / `TapeClippingDevice` (clipping folded into the unscale) and
  `DeviceSkippingDevice` (a step that is not fused, skipped on the device: ``skip_on_device=True``) and
  `AdvancingTapeDevice` (a tape step and the loss-scale rule's advance in one device branch).
  The core reads which ones a device implements once, at binding (`DeviceCapabilities`);
* optionally a conformance harness (see `polyamp.conformance.Harness`) named in the spec;
* optionally a tensor reader for `polyamp.check_hazards` named in the spec (``tensor_reader``), which checks
  a file before reading it (`read_safetensors_header`, `check_zip_archive`, `check_declared_bytes` against
  ``max_bytes``, default `DEFAULT_MAX_BYTES`) and computes max |w| over blocks of `chunk_indices` (arrays
  NumPy reads: `summarize_array`), saying `CORRUPT_FILE` of a file it cannot read as its format;
* op classes from the core's table (`polyamp.OP_CLASSES`, `polyamp.op_class`; `COMPUTE_OPS` and `FLOAT32_OPS`
  here): a backend maps its own ops to the table's names and takes their class, never a list of its own;
* optionally a forward watch: the framework's layer calls fed to a `ForwardPass` (which checks each tensor once
  and assembles the `WatchedCall` records), which `forward_report` turns into a `polyamp.ForwardReport` (the
  decision of which layer produced a non-finite output is the core's);
* `warn_if_untested`, called when the backend's package is imported with the framework versions it uses: one
  `polyamp.UntestedVersionWarning` for a framework older than `polyamp.MINIMUM_VERSIONS` says so.

`polyamp.LossScaler` owns the semantics (stages, misuse errors, skip records, the enabled rule, state
dicts); the device form only performs device operations. The helpers below give backends the same
wording and the same numerics as the core. A complete worked example is the NumPy backend in polyamp's
test suite (tests/numpy_backend/).
"""

from polyamp._src import rules
from polyamp._src.array_readers import is_array, summarize_array
from polyamp._src.backend import (
    AdvancingTapeDevice,
    Backend,
    ClippingDevice,
    CompilingDevice,
    DeviceSkippingDevice,
    Flag,
    Float16HintDevice,
    Float16ProbeDevice,
    FunctionalBackend,
    FunctionalCeilingDevice,
    FunctionalDevice,
    FunctionalGuardingDevice,
    FunctionalProvenanceDevice,
    FunctionalRecordingDevice,
    FunctionalRunDevice,
    FunctionalSpikeDevice,
    FunctionalTracingDevice,
    GradientCounts,
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
    StepOutcome,
    TapeClippingDevice,
    TapeDevice,
    UncompiledDevice,
    UnscaledLossWarningDevice,
)
from polyamp._src.binding import DeviceCapabilities
from polyamp._src.checkpoints import (
    CHUNK_BYTES,
    CORRUPT_FILE,
    DEFAULT_MAX_BYTES,
    MAX_CONFIG_BYTES,
    SafetensorsEntry,
    check_declared_bytes,
    check_zip_archive,
    chunk_indices,
    read_safetensors_header,
)
from polyamp._src.enabling import check_enabled, resolve_enabled
from polyamp._src.errors import describe, type_error
from polyamp._src.forward_watch import (
    LOGGER_NAME,
    ForwardPass,
    WatchedCall,
    check_watch_every,
    forward_report,
    join_dtype_names,
    log_forward_report,
)
from polyamp._src.functional import FunctionalLossScaler
from polyamp._src.iteration import NOT_SCALED_RULE, UnscaleStages, no_gradients_error, not_scaled_error
from polyamp._src.loss_scaler import bind_arguments
from polyamp._src.op_classes import COMPUTE_OPS, FLOAT32_OPS
from polyamp._src.provenance import layer_of, non_finite_gradients
from polyamp._src.records import (
    MODE_CODES,
    REBASE_BIT,
    SPIKE_BIT,
    Recorder,
    check_guard,
    check_history,
    check_on_min_scale,
    ring_codes,
    ring_values,
)
from polyamp._src.registry import (
    ENTRY_POINT_GROUP,
    BackendSpec,
    backend_name_for,
    backend_specs,
    detect_backend,
    get_backend,
    load_target,
    register_backend,
    wrong_object_error,
)
from polyamp._src.rules import ArrayOps
from polyamp._src.scaling import (
    INT32_MAX,
    NOT_GIVEN,
    RECIPROCAL_CEILING,
    SETTING_DOCS,
    LossScaleConfig,
    LossScaleSettings,
    LossScaleState,
    NotGiven,
    to_float32,
)
from polyamp._src.spikes import check_spike
from polyamp._src.state_dict import (
    FORMAT_VERSION,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    to_state_dict,
)
from polyamp._src.tensor_reading import TensorSummary
from polyamp._src.training_state import (
    COUNTER_KEYS,
    ITEMSIZE,
    KAHAN_KEY,
    MASTER_KEY,
    CheckpointChanges,
    checkpoint_changes,
    conversion_note,
    is_state_slot,
    round_to,
    stochastic_round_bfloat16,
    unplanned_hazard_message,
    write_update,
)
from polyamp._src.versions import warn_if_untested

__all__ = [
    "CHUNK_BYTES",
    "COMPUTE_OPS",
    "CORRUPT_FILE",
    "COUNTER_KEYS",
    "DEFAULT_MAX_BYTES",
    "ENTRY_POINT_GROUP",
    "FLOAT32_OPS",
    "FORMAT_VERSION",
    "INT32_MAX",
    "ITEMSIZE",
    "KAHAN_KEY",
    "LOGGER_NAME",
    "MASTER_KEY",
    "MAX_CONFIG_BYTES",
    "MODE_CODES",
    "NOT_GIVEN",
    "NOT_SCALED_RULE",
    "REBASE_BIT",
    "RECIPROCAL_CEILING",
    "SETTING_DOCS",
    "SPIKE_BIT",
    "AdvancingTapeDevice",
    "ArrayOps",
    "Backend",
    "BackendSpec",
    "CheckpointChanges",
    "ClippingDevice",
    "CompilingDevice",
    "DeviceCapabilities",
    "DeviceSkippingDevice",
    "Flag",
    "Float16HintDevice",
    "Float16ProbeDevice",
    "ForwardPass",
    "FunctionalBackend",
    "FunctionalCeilingDevice",
    "FunctionalDevice",
    "FunctionalGuardingDevice",
    "FunctionalLossScaler",
    "FunctionalProvenanceDevice",
    "FunctionalRecordingDevice",
    "FunctionalRunDevice",
    "FunctionalSpikeDevice",
    "FunctionalTracingDevice",
    "GradientCounts",
    "GuardingDevice",
    "ImperativeDevice",
    "ImperativeGuardingDevice",
    "ImperativeProvenanceDevice",
    "LossScaleConfig",
    "LossScaleSettings",
    "LossScaleState",
    "NotGiven",
    "OwnScalingDevice",
    "ParameterCheckDevice",
    "ProcessGroupDevice",
    "ProvenanceDevice",
    "Recorder",
    "RecordingDevice",
    "ReplicaDevice",
    "SafetensorsEntry",
    "ScalerDevice",
    "SpikeDevice",
    "StepOutcome",
    "TapeClippingDevice",
    "TapeDevice",
    "TensorSummary",
    "UncompiledDevice",
    "UnscaleStages",
    "UnscaledLossWarningDevice",
    "WatchedCall",
    "backend_name_for",
    "backend_specs",
    "bind_arguments",
    "check_declared_bytes",
    "check_enabled",
    "check_guard",
    "check_history",
    "check_on_min_scale",
    "check_spike",
    "check_watch_every",
    "check_zip_archive",
    "checkpoint_changes",
    "chunk_indices",
    "conversion_note",
    "describe",
    "detect_backend",
    "forward_report",
    "get_backend",
    "is_array",
    "is_state_slot",
    "join_dtype_names",
    "layer_of",
    "load_target",
    "log_forward_report",
    "no_gradients_error",
    "non_finite_gradients",
    "not_scaled_error",
    "parse_spike_run",
    "parse_spike_window",
    "parse_state_dict",
    "read_safetensors_header",
    "register_backend",
    "resolve_enabled",
    "ring_codes",
    "ring_values",
    "round_to",
    "rules",
    "stochastic_round_bfloat16",
    "summarize_array",
    "to_float32",
    "to_state_dict",
    "type_error",
    "unplanned_hazard_message",
    "warn_if_untested",
    "write_update",
    "wrong_object_error",
]
