"""polyamp: one automatic-mixed-precision layer for PyTorch, TensorFlow, Keras 3 and JAX.

The core defines the semantics once and imports no framework: precision policies, the loss-scaling rule
and everything around a training step, and the checkpoint doctor. ``polyamp_torch``, ``polyamp_tensorflow``,
``polyamp_keras`` and ``polyamp_jax`` translate them to each framework; ``polyamp.backend_api`` is what a
backend is written against.
"""

import importlib
from typing import Any

from polyamp._src.deprecation import moved
from polyamp._src.doctor import recommended_policy
from polyamp._src.errors import (
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
)
from polyamp._src.float8 import Float8Recipe
from polyamp._src.forward_watch import ForwardReport, NonFiniteOutput
from polyamp._src.functional import FunctionalLossScaler
from polyamp._src.global_policy import get_policy, get_policy_setting, policy_scope, set_policy
from polyamp._src.hazards import Hazard, check_hazards, find_hazards
from polyamp._src.loss_scaler import LossScaler
from polyamp._src.op_classes import OpClass, op_class
from polyamp._src.policy import Policy
from polyamp._src.provenance import NonFiniteGradient
from polyamp._src.records import ScaleCollapseError, StepRecord
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.spikes import SpikeRule
from polyamp._src.training_state import TrainingStateWarning, state_bytes, state_bytes_table
from polyamp._src.versions import UntestedVersionWarning

__version__ = "0.2.0"

__all__ = [
    "BackendMismatchError",
    "BackendNotInstalledError",
    "CheckpointError",
    "Float8Recipe",
    "ForwardReport",
    "FunctionalLossScaler",
    "Hazard",
    "InvalidConfigError",
    "InvalidPolicyError",
    "LossScaleConfig",
    "LossScaleState",
    "LossScaler",
    "NonFiniteGradient",
    "NonFiniteOutput",
    "OpClass",
    "Policy",
    "PolyampError",
    "PolyampTypeError",
    "PolyampValueError",
    "ScaleCollapseError",
    "ScalerUsageError",
    "SpikeRule",
    "StateDictError",
    "StepRecord",
    "TrainingStateWarning",
    "UntestedVersionWarning",
    "check_hazards",
    "find_hazards",
    "get_policy",
    "get_policy_setting",
    "op_class",
    "policy_scope",
    "recommended_policy",
    "set_policy",
    "state_bytes",
    "state_bytes_table",
]


def __getattr__(name: str) -> Any:
    """``polyamp.backend_api`` and ``polyamp.conformance``, imported when first named; and the names that moved
    out of ``polyamp`` (they serve backends, not training code), which still resolve, with a
    `DeprecationWarning` saying where they live now, until the next release."""
    if name in ("backend_api", "conformance"):
        return importlib.import_module(f"{__name__}.{name}")
    return moved(__name__, name)
