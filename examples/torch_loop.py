"""The classifier loop of the PyTorch AMP tutorial, with polyamp in place of torch.amp.

Run: python examples/torch_loop.py [--epochs 3] [--batches 10] [--policy mixed_float16]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import polyamp
import polyamp_torch


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train_epoch(model, loader, criterion, optimizer, scaler, device):  # type: ignore[no-untyped-def]
    model.train()
    total_loss, correct, total = 0.0, 0, 0
    for inputs, labels in loader:
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with polyamp_torch.autocast():  # dtype from the policy; the accelerator and the CPU
            outputs = model(inputs)
            loss = criterion(outputs, labels)
        scaler.scale(loss).backward()  # a no-op scale under bfloat16 policies
        scaler.step(optimizer)  # skipped if a gradient is inf/NaN
        scaler.update()
        total_loss += loss.item() * inputs.size(0)
        correct += outputs.argmax(1).eq(labels).sum().item()
        total += labels.size(0)
    return total_loss / total, correct / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args()

    polyamp.set_policy(args.policy)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = SimpleModel().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = polyamp.LossScaler()  # enabled iff the policy computes in float16
    loader = [(torch.randn(32, 128), torch.randint(0, 10, (32,))) for _ in range(args.batches)]
    print(f"device {device}, policy {polyamp.get_policy().name}, loss scaling {'on' if scaler.enabled else 'off'}")
    for epoch in range(args.epochs):
        loss, acc = train_epoch(model, loader, criterion, optimizer, scaler, device)
        print(f"epoch {epoch + 1}: loss={loss:.4f} acc={acc:.4f} scale={scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
