"""The FP8 benchmarks' model and data: a small GPT of ``nn.Linear`` layers (the layers FP8 converts) and
token sequences from a fixed random bigram table (learnable, so the loss falls)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln1(x)).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a final norm and an untied head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(length, width)
        self.blocks = torch.nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.ln(self.blocks(self.wte(tokens) + self.wpe(positions))))


def bigram_batches(vocab: int, batch: int, length: int, seed: int, device: str = "cpu") -> Callable[[], torch.Tensor]:
    """An endless source of ``(batch, length + 1)`` token tensors drawn from one random bigram table."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab, vocab, generator=generator) * 3.0, dim=-1)

    def draw() -> torch.Tensor:
        tokens = torch.empty(batch, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for i in range(length):
            tokens[:, i + 1] = torch.multinomial(table[tokens[:, i]], 1, generator=generator).squeeze(1)
        return tokens.to(device)

    return draw


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
