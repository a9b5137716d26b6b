"""A small character-level GPT in plain PyTorch, for the demo and the quality study.

Pre-norm decoder blocks (causal self-attention through ``scaled_dot_product_attention``, GELU
MLP), learned positions, untied output head. Nothing nmcompile-specific: its linear weights
(``blocks.N.attn.qkv``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``, ``head``) are what recipes annotate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharGPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.width), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.width), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, ids, steps: int, generator: torch.Generator | None = None):
        """Sample ``steps`` more characters after ``ids`` ``[1, t]`` (eager; for a look at the model)."""
        for _ in range(steps):
            logits = self(ids[:, -self.cfg.context :])[:, -1]
            probs = torch.softmax(logits.float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
        return ids
