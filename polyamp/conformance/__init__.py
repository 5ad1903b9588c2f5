"""polyamp's conformance suite: one set of cases that every backend runs on every device.

The cases (`polyamp.conformance.cases`) never import a framework; they drive a backend through its
`Harness` (make tensors and a tiny model under a policy, train it through the loss scaler, plant a
non-finite gradient, read dtypes and values as NumPy). Each backend ships its harness and names it in its
`polyamp.backend_api.BackendSpec` (``harness="package.module:Class"``); the class is called with a device type and
raises `HarnessUnavailable` (a skip with the reason) where it cannot run.

Run it anywhere polyamp is installed, with NumPy:

    python -m polyamp.conformance                              # every backend, cpu and cuda
    python -m polyamp.conformance --backend torch --device cuda

It prints one row per case and exits non-zero if a case fails. A backend lists its known, documented
differences in ``Harness.divergences``; those cases must fail (a passing one is reported as a failure).

A harness may build on `HarnessBase` and its trainers and loops on `TrainerBase`, `FunctionalTrainerBase` and
`LoopBase`, which hold what every harness shares (the device check, ``trainer()``, each step under the
trainer's policy, parameters and optimizer state as NumPy) and leave it what is its framework's.
"""

from polyamp.conformance._context import (
    CaseSkipped,
    Reporter,
    assert_close,
    assert_dtype,
    assert_equal_arrays,
    expect_divergence,
    missing_capabilities,
    parametrize,
    reporting,
    requires,
    skip,
    stop_reporting,
)
from polyamp.conformance._harness import (
    FunctionalScalerView,
    FunctionalTrainerBase,
    HarnessBase,
    LoopBase,
    TrainerBase,
    TrainerSettings,
)
from polyamp.conformance._protocol import (
    CAPABILITIES,
    COMPUTE_OPS,
    OPS,
    Harness,
    HarnessUnavailable,
    Loop,
    Trainer,
    capabilities_of,
)
from polyamp.conformance._runner import (
    CaseResult,
    case_functions,
    expand,
    format_table,
    harness_class,
    make_harness,
    run,
    skip_reason,
    targets,
)

__all__ = [
    "CAPABILITIES",
    "COMPUTE_OPS",
    "OPS",
    "CaseResult",
    "CaseSkipped",
    "FunctionalScalerView",
    "FunctionalTrainerBase",
    "Harness",
    "HarnessBase",
    "HarnessUnavailable",
    "Loop",
    "LoopBase",
    "Reporter",
    "Trainer",
    "TrainerBase",
    "TrainerSettings",
    "assert_close",
    "assert_dtype",
    "assert_equal_arrays",
    "capabilities_of",
    "case_functions",
    "expand",
    "expect_divergence",
    "format_table",
    "harness_class",
    "make_harness",
    "missing_capabilities",
    "parametrize",
    "reporting",
    "requires",
    "run",
    "skip",
    "skip_reason",
    "stop_reporting",
    "targets",
]
