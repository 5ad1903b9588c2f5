"""polyamp quickstart: one policy, one loss scaler, the same tiny model in PyTorch and in Keras.

Run: python examples/quickstart.py [--steps 60] [--policy mixed_float16]
A framework that is not installed is skipped with the command that installs it.
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np

import polyamp

# A toy 4-class problem, made in code: the class is the largest of the first four features.
RNG = np.random.default_rng(0)
X = RNG.normal(size=(1024, 16)).astype("float32")
Y = X[:, :4].argmax(axis=1).astype("int64")
BATCH = 64


def batches(steps: int):  # type: ignore[no-untyped-def]
    for step in range(steps):
        start = (step * BATCH) % len(X)
        yield X[start : start + BATCH], Y[start : start + BATCH]


def train_torch(steps: int) -> dict[str, object]:
    import torch

    import polyamp_torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = polyamp_torch.apply_policy(model)  # float32 outputs under mixed policies
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = polyamp.LossScaler()  # binds to torch on first use
    losses = []
    for x, y in batches(steps):
        optimizer.zero_grad(set_to_none=True)
        with polyamp_torch.autocast():
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return {
        "losses": losses,
        "scale": scaler.get_scale(),
        "skipped": int(scaler.skipped_steps()),
        "state": scaler.state_dict(),
    }


def train_keras(steps: int) -> dict[str, object]:
    import keras

    import polyamp_tensorflow

    keras.utils.set_random_seed(0)
    model = polyamp_tensorflow.cast_outputs(
        keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    )
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = [float(model.train_on_batch(x, y)) for x, y in batches(steps)]
    skipped = int(optimizer.skipped_steps.numpy()) if optimizer.built else 0
    return {"losses": losses, "scale": optimizer.get_scale(), "skipped": skipped, "state": optimizer.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args()

    policy = polyamp.set_policy(args.policy)
    print(
        f"policy {policy.name}: params {policy.param_dtype}, compute {policy.compute_dtype}, output {policy.output_dtype}"
    )
    print(
        f"loss scaling {'on' if policy.needs_loss_scaling else 'off'} (LossScaler(): init_scale 2**16, growth_interval 2000)"
    )

    results = {}
    # PyTorch first: in one process, import torch before tensorflow.
    for name, module, extra, train in (
        ("PyTorch", "torch", "torch", train_torch),
        ("Keras", "tensorflow", "tensorflow", train_keras),
    ):
        if importlib.util.find_spec(module) is None:
            print(f"{name}: not installed (pip install 'polyamp[{extra}]')")
            continue
        result = train(args.steps)
        results[name] = result
        losses = result["losses"]
        assert isinstance(losses, list)
        shown = ", ".join(f"{losses[i]:.3f}" for i in range(0, len(losses), max(1, len(losses) // 5)))
        print(
            f"{name:>7}: loss {shown} -> {losses[-1]:.3f}; loss scale {result['scale']:.0f}, skipped steps {result['skipped']}"
        )

    if len(results) == 2:
        torch_state, keras_state = results["PyTorch"]["state"], results["Keras"]["state"]
        assert isinstance(torch_state, dict) and isinstance(keras_state, dict)
        same = {k: torch_state[k] for k in ("scale", "_growth_tracker", "hysteresis_left")} == {
            k: keras_state[k] for k in ("scale", "_growth_tracker", "hysteresis_left")
        }
        print(f"same loss-scale state in both frameworks: {same}; state dicts load into either backend")

    print("the loss-scaling rule, no framework needed (F finite, O overflow, growth_interval=3):")
    pattern = "FFFOFFOOFFFFFF"
    print(
        f"  {pattern}: " + " ".join(f"{s:.0f}" for s in polyamp.LossScaleConfig(growth_interval=3).trajectory(pattern))
    )


if __name__ == "__main__":
    main()
