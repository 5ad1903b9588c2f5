"""Each device rule has one implementation, in `polyamp._src.rules`, and every backend computes with it.

Two checks: patching a core rule changes what every backend's device computes (run on every registered
backend's conformance harness), and no backend module holds a rule's arithmetic of its own (a scan of their
sources for what the rules read from a config or a `SpikeRule`, with the few places that only hand those
values to a framework's fused kernel or API listed and explained).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polyamp.backend_api.rules as backend_rules
from polyamp import LossScaleConfig, Policy, SpikeRule
from polyamp._src import rules
from polyamp._src.records import MODE_CODES
from polyamp._src.rules import loss_scale
from polyamp.conformance import HarnessUnavailable, capabilities_of
from polyamp.conformance._runner import make_harness, targets

ROOT = Path(__file__).resolve().parents[1]

#: Each device rule and the one function that implements it.
RULES = {
    "loss-scale growth": loss_scale.grown,
    "loss-scale back-off": loss_scale.backed_off,
    "loss-scale step (select form)": rules.advance,
    "loss-scale step (branch form: overflow, growth, count)": (
        rules.after_overflow,
        rules.after_growth,
        rules.after_count,
        rules.at_interval,
    ),
    "spike decision": rules.is_spike,
    "spike window": rules.finish,
    "spike statistics": (rules.loss_statistic, rules.grad_norm, rules.statistic_dtype),
    "record code": rules.record_code,
    "non-finite counts": rules.non_finite_counts,
}

#: A pattern of finite (F) and overflowing (O) steps, and settings outside torch's fused kernel (hysteresis),
#: so that every backend runs the core's rule.
PATTERN = "FFOOFF"
SETTINGS = {"init_scale": 4.0, "growth_interval": 1, "hysteresis": 2, "enabled": True}


#: Every registered backend with a harness, on the CPU.
CPU_TARGETS = targets(devices=["cpu"])


@pytest.fixture(params=CPU_TARGETS, ids=[f"{backend}-{device}" for backend, device in CPU_TARGETS])
def harness(request: pytest.FixtureRequest) -> Any:
    try:
        made = make_harness(*request.param)
    except HarnessUnavailable as exc:
        pytest.skip(str(exc))
    if "trainer" not in capabilities_of(made):
        pytest.skip(f"{request.param[0]} has no trainer")
    return made


def _batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(8, 8)).astype(np.float32), rng.integers(0, 4, size=(8,)).astype(np.int64))
        for _ in range(steps)
    ]


def _run(harness: Any, settings: dict[str, Any], pattern: str) -> Any:
    trainer = harness.trainer(Policy("float32"), scaler=settings)
    scales = []
    for (x, y), char in zip(_batches(len(pattern)), pattern, strict=True):
        trainer.step(x, y, overflow=char == "O")
        scales.append(trainer.scaler.state_dict()["scale"])
    return trainer, scales


def test_every_rule_has_one_implementation() -> None:
    for name, functions in RULES.items():
        for function in functions if isinstance(functions, tuple) else (functions,):
            assert function.__module__.startswith("polyamp._src.rules."), (name, function)


def test_a_patched_growth_rule_changes_every_backends_trajectory(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The growth made x3 in the core (the settings say x2): every backend's scales follow x3."""
    monkeypatch.setattr(loss_scale, "grown", lambda ops, config, scale: scale * 3.0)
    _, scales = _run(harness, SETTINGS, PATTERN)
    settings = {key: value for key, value in SETTINGS.items() if key != "enabled"}
    assert scales == LossScaleConfig(**settings, growth_factor=3.0).trajectory(PATTERN)
    assert scales != LossScaleConfig(**settings).trajectory(PATTERN)


def test_a_patched_record_code_changes_every_backends_records(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's record code made to say "guarding" for scaling iterations: every backend's records say so."""
    real = rules.record_code

    def as_guarding(ops: Any, base: Any, overflow: Any = None, spike: Any = None) -> Any:
        shift = MODE_CODES["guarding"] - MODE_CODES["scaling"]  # (base may be a batch of codes)
        return real(ops, base + shift * (base == MODE_CODES["scaling"]), overflow, spike)

    for namespace in (rules, backend_rules):  # the core's module and the backends' view of it
        monkeypatch.setattr(namespace, "record_code", as_guarding)
    trainer, _ = _run(harness, SETTINGS, "FO")
    records = trainer.scaler.records()
    assert [(r.mode, r.skipped, r.reason) for r in records[-2:]] == [
        ("guarding", False, None),
        ("guarding", True, "non_finite"),
    ]


def test_a_patched_spike_decision_changes_every_backends_skips(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's spike decision made to call every finite statistic a spike: every backend skips every
    step for it."""
    for namespace in (rules, backend_rules):
        monkeypatch.setattr(namespace, "is_spike", lambda ops, rule, window, x: ops.isfinite(x))
    settings = {**SETTINGS, "spike": SpikeRule("grad_norm", window=4)}
    trainer, _ = _run(harness, settings, "FFF")
    assert [(r.skipped, r.reason) for r in trainer.scaler.records()[-3:]] == [(True, "grad_spike")] * 3


#: Where a backend names a rule's constants without computing the rule, and why.
ALLOWED = {
    # torch's fused kernel computes the standard rule; polyamp hands it the settings and clamps at the floor.
    ("torch/polyamp_torch/_rule.py", "growth_factor"),
    ("torch/polyamp_torch/_rule.py", "backoff_factor"),
    ("torch/polyamp_torch/_rule.py", "growth_interval"),
    ("torch/polyamp_torch/_rule.py", "floor_f32"),
    # Keras's LossScaleOptimizer API names the growth interval dynamic_growth_steps.
    ("keras/polyamp_keras/_optimizer.py", "growth_interval"),
    ("keras/polyamp_keras/_optimizer_state.py", "growth_interval"),
    # Flax's DynamicScale fields are the settings under Flax's names (its growth_interval counts one more).
    ("jax/polyamp_jax/_dynamic_scale.py", "growth_factor"),
    ("jax/polyamp_jax/_dynamic_scale.py", "backoff_factor"),
    ("jax/polyamp_jax/_dynamic_scale.py", "growth_interval"),
    ("jax/polyamp_jax/_dynamic_scale.py", "hysteresis"),
    ("jax/polyamp_jax/_dynamic_scale.py", "floor_f32"),
    # A new scale given to update() as a symbolic tensor is checked in the graph against the config's bounds.
    ("tensorflow/polyamp_tensorflow/_device.py", "floor_f32"),
    ("tensorflow/polyamp_tensorflow/_device.py", "max_scale_f32"),
}
#: What a rule reads from a `LossScaleConfig` or a `SpikeRule`, and the record code's bits.
RULE_TERMS = re.compile(
    r"\.(growth_factor|backoff_factor|growth_interval|hysteresis|floor_f32|max_scale_f32|ceiling_f32|threshold|"
    r"min_values|consecutive_limit|two_sided)\b|\b(SPIKE_BIT|REBASE_BIT)\b"
)


def test_no_backend_computes_a_rule_of_its_own() -> None:
    found = set()
    sources = [*(ROOT / "backends").rglob("*.py"), *(ROOT / "tests" / "numpy_backend").glob("*.py")]
    for path in sources:
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            for match in RULE_TERMS.finditer(code):
                where = path.relative_to(ROOT / "backends") if "backends" in path.parts else path.relative_to(ROOT)
                found.add((str(where), match.group(1) or match.group(2)))
    assert found - ALLOWED == set(), "a backend computes a device rule itself; call polyamp.backend_api.rules"
