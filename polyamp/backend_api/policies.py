"""What a backend reads of the precision policy: the names and types of policies and overrides, the process-wide
setting and its listeners, and the op-class table a backend maps its ops to."""

from polyamp._src.global_policy import PolicySetting, add_policy_listener, get_policy_overrides, get_policy_setting
from polyamp._src.op_classes import COMPUTE_OPS, FLOAT32_OPS, OP_CLASSES
from polyamp._src.overrides import OverridesLike, PolicyOverrides
from polyamp._src.policy import DTYPE_NAMES, POLICY_NAMES, PRESET_NAMES, ROUNDINGS, PolicyLike

__all__ = [
    "COMPUTE_OPS",
    "DTYPE_NAMES",
    "FLOAT32_OPS",
    "OP_CLASSES",
    "POLICY_NAMES",
    "PRESET_NAMES",
    "ROUNDINGS",
    "OverridesLike",
    "PolicyLike",
    "PolicyOverrides",
    "PolicySetting",
    "add_policy_listener",
    "get_policy_overrides",
    "get_policy_setting",
]
