"""A Llama-style block written as single-device code (test fixture for the parallel styles).

RMSNorm, attention with grouped KV heads, rotary embeddings and ``view(b, s, -1, head_dim)``
reshapes (as popular model libraries write them), SwiGLU MLP. Nothing here knows about
shardwise: the tests parallelize it from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotary_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, seq, heads, head_dim] (pairs of adjacent features)."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = rotate(q, *rope), rotate(k, *rope)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 8, n_kv_heads: int = 4, hidden: int = 48) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


def make_block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    block = Block()
    with torch.no_grad():  # norms away from 1 so their gradients matter
        for norm in (block.attention_norm, block.ffn_norm):
            norm.weight.uniform_(0.5, 1.5)
    return block
