"""polyamp quickstart: one policy, one loss-scaling rule.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import polyamp


def main() -> None:
    policy = polyamp.set_policy("mixed_float16")
    print(
        f"policy {policy.name}: params {policy.param_dtype}, compute {policy.compute_dtype}, output {policy.output_dtype}"
    )
    scaler = polyamp.LossScaler(growth_interval=3)
    print(f"loss scaling enabled: {scaler.enabled}, initial scale {scaler.get_scale():.0f}")
    pattern = "FFFOFFOOFFFFFF"
    print(f"scale after each step of {pattern} (F finite, O overflow):")
    print(" ".join(f"{s:.0f}" for s in scaler.config.trajectory(pattern)))


if __name__ == "__main__":
    main()
