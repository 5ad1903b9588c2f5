"""The ``training-state`` benchmark's model and step on PyTorch (see `benchmarks.training_state`)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

import polyamp
import polyamp_torch
from benchmarks.training_state import POLICY_OF, Chain, Config, Run, decayed, initial_weights, run_steps


class GPT(torch.nn.Module):
    def __init__(self, config: Config, weights: dict[str, np.ndarray], dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.names = list(weights)
        self.weights = torch.nn.ParameterDict(
            {name.replace(".", "_"): torch.nn.Parameter(torch.from_numpy(w).to(dtype)) for name, w in weights.items()}
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "_")]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, length = tokens.shape
        x = self["wte"][tokens] + self["wpe"][:length]
        for i in range(c.layers):
            h = F.layer_norm(x, (c.width,), self[f"h{i}.ln1.g"], self[f"h{i}.ln1.b"])
            qkv = h @ self[f"h{i}.attn.w"] + self[f"h{i}.attn.b"]
            q, k, v = (
                t.reshape(batch, length, c.heads, c.width // c.heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
            )
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.width // c.heads)
            mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
            attention = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
            y = (attention @ v).transpose(1, 2).reshape(batch, length, c.width)
            x = x + (y @ self[f"h{i}.proj.w"] + self[f"h{i}.proj.b"])
            h = F.layer_norm(x, (c.width,), self[f"h{i}.ln2.g"], self[f"h{i}.ln2.b"])
            h = F.gelu(h @ self[f"h{i}.fc.w"] + self[f"h{i}.fc.b"])
            x = x + (h @ self[f"h{i}.out.w"] + self[f"h{i}.out.b"])
        x = F.layer_norm(x, (c.width,), self["lnf.g"], self["lnf.b"])
        return x @ self["head.w"]


def train(plan: str, seed: int, config: Config, chain: Chain) -> Run:
    torch.manual_seed(seed)
    policy = polyamp.Policy(POLICY_OF.get(plan, plan))
    dtype = getattr(torch, policy.param_dtype)
    weights = initial_weights(config, seed)
    model = GPT(config, weights, dtype)
    named = dict(zip(model.names, model.weights.values(), strict=True))
    groups = [
        {"params": [p for n, p in named.items() if decayed(n, weights[n])], "weight_decay": config.weight_decay},
        {"params": [p for n, p in named.items() if not decayed(n, weights[n])], "weight_decay": 0.0},
    ]
    inner = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=True)
    optimizer = polyamp_torch.PrecisionOptimizer(inner, policy, seed=seed)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: config.learning_rate(step) / config.lr)

    def one(batch: np.ndarray) -> float:
        tokens = torch.from_numpy(batch).long()
        with polyamp_torch.autocast(policy):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        schedule.step()
        return loss.item()

    losses, seconds = run_steps(config, chain.batches(seed), one)
    measured = polyamp_torch.measure_state_bytes(optimizer)
    timed = config.steps - config.untimed_steps
    return Run(plan, seed, losses, seconds, timed, measured.per_parameter, measured.breakdown())
