"""What the conformance cases share: the policies, the trajectory vectors, seeded data."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaleConfig

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")

#: Shared trajectory vectors: (name, scaler settings, policy, pattern of F finite / O planted overflow).
TRAJECTORY_VECTORS: list[tuple[str, dict[str, Any], str, str]] = [
    ("default_rule", {"growth_interval": 3}, "mixed_float16", "FFFOFFOOFFFFFF"),
    ("hysteresis", {"growth_interval": 3, "hysteresis": 2}, "float32", "FOFOOOFFFFOFOOOO"),
    (
        "min_max",
        {"init_scale": 64.0, "growth_interval": 2, "min_scale": 16.0, "max_scale": 128.0},
        "float32",
        "FFFFFFOOOOOFF",
    ),
    (
        "odd_factors",
        {"init_scale": 1000.0, "growth_factor": 1.37, "backoff_factor": 0.61, "growth_interval": 2},
        "float32",
        "FFFFOFOOFFFF",
    ),
    ("static", {"init_scale": 512.0, "growth_interval": 1, "dynamic": False}, "float32", "FFOFOOFF"),
    ("growth_guard", {"init_scale": 2.0**100, "growth_factor": 2.0**10, "growth_interval": 1}, "float32", "FFFFF"),
]


def _data(n: int = 256, seed: int = 0) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = x[:, :4].argmax(axis=1).astype("int64")
    return x, y


def _batches(steps: int, size: int = 32) -> list[tuple[Any, Any]]:
    x, y = _data()
    return [(x[(i * size) % len(x) :][:size], y[(i * size) % len(y) :][:size]) for i in range(steps)]


def _mismatch(states: list[Any], expected: list[Any], pattern: str, what: str) -> None:
    for step, (got, want) in enumerate(zip(states, expected, strict=True)):
        if got != want:
            raise AssertionError(
                f"after step {step} ({pattern[: step + 1]}): (scale, tracker, hysteresis)={got}, but should be "
                f"{want} [{what}]"
            )


def _drive(trainer: Any, pattern: str) -> list[tuple[float, int, int]]:
    states = []
    for (x, y), char in zip(_batches(len(pattern)), pattern, strict=True):
        trainer.step(x, y, overflow=char == "O")
        state = trainer.scaler.state_dict()
        states.append((state["scale"], state["_growth_tracker"], state["hysteresis_left"]))
    return states


def _reference(config: dict[str, Any], pattern: str, state: Any = None) -> list[tuple[float, int, int]]:
    reference = LossScaleConfig(**config)
    return [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference.states(pattern, state)]
