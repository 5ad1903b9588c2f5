"""polyamp's PyTorch backend: policies as ``torch.autocast``, loss scaling on the device.

* `autocast` - ``torch.autocast`` with its dtype from a polyamp policy (context manager and decorator).
* `TorchLossScaler` - ``polyamp.LossScaler`` bound to torch from construction, a drop-in for
  ``torch.amp.GradScaler`` (its arguments, its defaults, its results) with hysteresis, bounds and skip
  records on top.
* `apply_policy` - a policy on a model: outputs in the output dtype, chosen submodules in float32, and under
  an FP8 recipe (`polyamp.Float8Recipe`) its linear layers' matmuls in FP8 through ``torch._scaled_mm``.
* `SchedulerGuard` - an LR scheduler that does not advance on skipped steps.
* `RecordWriter` - a scaler's step records as TensorBoard scalars; `log_summary` - the run in one line every N
  steps (printed, or as a tqdm bar's postfix).
* `clip_grad_norm_` - gradient clipping that unscales first, so it never clips scaled gradients.
* `fsdp_mixed_precision` - a policy as FSDP2's ``MixedPrecisionPolicy``.
* `watch_forward` - which module first produced an inf or NaN in a forward pass (forward hooks).
* `record_float8` - what the FP8 layers' casts lose (saturated values, values flushed to zero), counted on
  the device and read in one batch; `float8_state_dict` / `load_float8_state_dict` - delayed scaling's state
  in the form every polyamp backend reads, to move a run between frameworks.
* `PrecisionOptimizer` - any optimizer stepping bfloat16/float16 weights by the policy's training-state plan
  (float32 master copy, Kahan or stochastic rounding, moments in bfloat16); `measure_state_bytes` counts it.

Integrations, imported on demand (``import polyamp_torch`` imports none of their frameworks):
``polyamp_torch.lightning.PolyampPrecision`` (a Lightning precision plugin),
``polyamp_torch.accelerate.prepare_accelerator`` (polyamp's scaler in an Accelerate ``Accelerator``),
``polyamp_torch.transformers.prepare_trainer`` / ``PolyampCallback`` (Hugging Face's ``Trainer``).

Importing this module imports torch; without PyTorch installed it raises ``polyamp.BackendNotInstalledError``
saying ``pip install 'polyamp[torch]'``.
"""

# First: without PyTorch this raises BackendNotInstalledError saying what to install.
from polyamp_torch._framework import TORCH_DTYPES  # isort: split

from polyamp_torch._autocast import PolicyRegion, autocast, policy_in_effect
from polyamp_torch._backend import TorchBackend
from polyamp_torch._clip import clip_grad_norm_
from polyamp_torch._cpu_float32 import FLOAT32_OP_NAMES
from polyamp_torch._distributed import fsdp_mixed_precision
from polyamp_torch._float8 import float8_state_dict, load_float8_state_dict, record_float8
from polyamp_torch._modules import apply_policy, module_policy, remove_policy
from polyamp_torch._precision import PrecisionOptimizer, measure_state_bytes
from polyamp_torch._records import RecordWriter, log_summary
from polyamp_torch._scaler import TorchLossScaler
from polyamp_torch._schedulers import SchedulerGuard
from polyamp_torch._watch import ForwardWatch, watch_forward

__all__ = [
    "FLOAT32_OP_NAMES",
    "TORCH_DTYPES",
    "ForwardWatch",
    "PolicyRegion",
    "PrecisionOptimizer",
    "RecordWriter",
    "SchedulerGuard",
    "TorchBackend",
    "TorchLossScaler",
    "apply_policy",
    "autocast",
    "clip_grad_norm_",
    "float8_state_dict",
    "fsdp_mixed_precision",
    "load_float8_state_dict",
    "log_summary",
    "measure_state_bytes",
    "module_policy",
    "policy_in_effect",
    "record_float8",
    "remove_policy",
    "watch_forward",
]
