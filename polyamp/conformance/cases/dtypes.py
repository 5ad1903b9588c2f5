"""Policies and dtypes: which ops compute in the compute dtype and which in float32, and the model's dtypes."""

from __future__ import annotations

from typing import Any

from polyamp import Policy
from polyamp.conformance._context import (
    assert_dtype,
    expect_divergence,
    parametrize,
    requires,
)
from polyamp.conformance._protocol import COMPUTE_OPS, OPS
from polyamp.conformance.cases._shared import POLICIES

# -- policy -> dtypes ------------------------------------------------------------------------------------


@parametrize("op", OPS)
@parametrize("policy", POLICIES)
@requires("op_dtype")
def test_op_dtype(harness: Any, policy: str, op: str) -> None:
    """matmul/dense/conv run in the compute dtype; softmax, log-softmax, losses, norms, sums in float32."""
    parsed = Policy(policy)
    expected = parsed.compute_dtype if op in COMPUTE_OPS else "float32"
    if parsed.compute_dtype != "float32":
        expect_divergence(harness, f"op:{op}")
    assert_dtype(harness.op_dtype(op, parsed), expected, f"{op}(policy={policy}) on {harness.backend}-{harness.device}")


@parametrize("policy", POLICIES)
@requires("model_dtypes")
def test_model_dtypes(harness: Any, policy: str) -> None:
    """Parameters in the param dtype, model outputs in the output dtype."""
    parsed = Policy(policy)
    params, output = harness.model_dtypes(parsed)
    for index, dtype in enumerate(params):
        assert_dtype(dtype, parsed.param_dtype, f"parameter {index} (policy={policy})")
    assert_dtype(output, parsed.output_dtype, f"model output (policy={policy})")
