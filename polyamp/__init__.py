"""polyamp: one automatic-mixed-precision layer for PyTorch and TensorFlow/Keras.

The core defines the semantics once and imports no framework: precision policies, the loss-scaling
state machine and everything around a training step, the backend registry and the conformance protocol.
``polyamp_torch`` and ``polyamp_tensorflow`` translate them to each framework; ``polyamp.backend_api`` is
what a backend is written against.
"""

from polyamp._src.backend import Backend
from polyamp._src.doctor import recommended_policy
from polyamp._src.errors import (
    BackendConflictError,
    BackendMismatchError,
    BackendNotInstalledError,
    CheckpointError,
    InvalidConfigError,
    InvalidPolicyError,
    PolyampError,
    PolyampTypeError,
    PolyampValueError,
    ScalerUsageError,
    StateDictError,
    UnknownBackendError,
)
from polyamp._src.forward_watch import ForwardReport, NonFiniteOutput
from polyamp._src.functional import FunctionalLossScaler
from polyamp._src.global_policy import (
    PolicySetting,
    add_policy_listener,
    get_policy,
    get_policy_overrides,
    get_policy_setting,
    policy_scope,
    set_policy,
)
from polyamp._src.hazards import Hazard, check_hazards, find_hazards
from polyamp._src.loss_scaler import LossScaler
from polyamp._src.op_classes import OP_CLASSES, OpClass, op_class
from polyamp._src.overrides import OverridesLike, PolicyOverrides
from polyamp._src.policy import DTYPE_NAMES, POLICY_NAMES, PRESET_NAMES, ROUNDINGS, Policy, PolicyLike
from polyamp._src.provenance import NonFiniteGradient
from polyamp._src.records import SKIP_REASONS, ScaleCollapseError, SkipReason, StepRecord
from polyamp._src.registry import BackendSpec, backend_specs, get_backend, register_backend
from polyamp._src.scaling import LossScaleConfig, LossScaleSettings, LossScaleState
from polyamp._src.spikes import SpikeRule
from polyamp._src.training_state import (
    MeasuredStateBytes,
    StateBytes,
    TrainingStateWarning,
    state_bytes,
    state_bytes_table,
)
from polyamp._src.versions import MINIMUM_VERSIONS, UntestedVersionWarning

__version__ = "0.1.0"

__all__ = [
    "DTYPE_NAMES",
    "MINIMUM_VERSIONS",
    "OP_CLASSES",
    "POLICY_NAMES",
    "PRESET_NAMES",
    "ROUNDINGS",
    "SKIP_REASONS",
    "Backend",
    "BackendConflictError",
    "BackendMismatchError",
    "BackendNotInstalledError",
    "BackendSpec",
    "CheckpointError",
    "ForwardReport",
    "FunctionalLossScaler",
    "Hazard",
    "InvalidConfigError",
    "InvalidPolicyError",
    "LossScaleConfig",
    "LossScaleSettings",
    "LossScaleState",
    "LossScaler",
    "MeasuredStateBytes",
    "NonFiniteGradient",
    "NonFiniteOutput",
    "OpClass",
    "OverridesLike",
    "Policy",
    "PolicyLike",
    "PolicyOverrides",
    "PolicySetting",
    "PolyampError",
    "PolyampTypeError",
    "PolyampValueError",
    "ScaleCollapseError",
    "ScalerUsageError",
    "SkipReason",
    "SpikeRule",
    "StateBytes",
    "StateDictError",
    "StepRecord",
    "TrainingStateWarning",
    "UnknownBackendError",
    "UntestedVersionWarning",
    "add_policy_listener",
    "backend_specs",
    "check_hazards",
    "find_hazards",
    "get_backend",
    "get_policy",
    "get_policy_overrides",
    "get_policy_setting",
    "op_class",
    "policy_scope",
    "recommended_policy",
    "register_backend",
    "set_policy",
    "state_bytes",
    "state_bytes_table",
]
