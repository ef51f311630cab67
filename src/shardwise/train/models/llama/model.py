"""A Llama-style decoder, written for one device.

Nothing here knows about meshes or processes: tensor parallelism, sequence parallelism and
FSDP are applied from outside (this family's ``parallelize.py``, then the trainer's generic
``shardwise.train.parallelize``). The code only has to be written so that it keeps working
when each rank holds a slice of the heads: attention reshapes with ``-1`` head counts
(``view(bs, seqlen, -1, head_dim)``), so a column-sharded ``wq`` that outputs ``n_heads / tp``
heads per rank needs no change here.

Module names follow torchtitan (``tok_embeddings``, ``layers.<i>.attention.wq``,
``feed_forward.w1``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``), which is what the
parallel plans and checkpoints key on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.tensor.random import layout_independent
from shardwise.train.models.llama.args import ModelArgs

__all__ = ["Attention", "FeedForward", "TransformerBlock", "Transformer", "rotary_table", "apply_rotary"]


def rotary_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of each position's rotation angles: [seq_len, head_dim // 2, 2] (float32)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) feature pair of ``x`` [bs, seqlen, heads, head_dim] by its angle.

    The pairing and angles are those of the original Llama complex-number formulation,
    written with real arithmetic so every dtype and backend supports it.
    """
    seqlen = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))  # [bs, seqlen, heads, head_dim/2, 2]
    cos = table[:seqlen, None, :, 0]  # [seqlen, 1, head_dim/2]
    sin = table[:seqlen, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention with grouped key/value heads and rotary positions."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads  # query heads per kv head
        kv_width = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_width, bias=False)
        self.wv = nn.Linear(args.dim, kv_width, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 head counts: under tensor parallelism each rank sees only its share of the heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        # [bs, heads, seqlen, head_dim]; each kv head serves n_rep consecutive query heads.
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, depth_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=depth_std)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, depth_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=depth_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Deeper blocks start with smaller output projections (as torchtitan's depth init).
        self.depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotary)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.depth_std)
        self.feed_forward.init_weights(self.depth_std)


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm, untied output projection.

    Args:
        args: the shapes.

    Example:
        >>> model = Transformer(CONFIGS["tiny"])
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", ... keeps parameter names stable if blocks are removed
        # (pipeline stages), as torchtitan does.
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not a parameter and not saved: every rank recomputes it, whatever the layout.
        self.register_buffer("rotary", torch.empty(args.max_seq_len, args.head_dim // 2, 2), persistent=False)
        self.init_weights()

    def build_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        """Block ``layer_id`` (a family with other blocks, such as the MoE one, overrides this)."""
        return TransformerBlock(layer_id, args)

    def init_weights(self) -> None:
        """Draw every parameter from shardwise's layout-independent stream; recompute the rotary table.

        Seed with ``torch.manual_seed`` / ``shardwise.tensor.random.manual_seed`` on every rank first.
        The values depend on the seed only, not on the layout: the model built whole on one
        device and the same model built on the meta device, parallelized (TP, FSDP, both),
        ``to_empty``'d and initialized here hold the same parameters (every rank draws only its
        own blocks). On the meta device nothing is drawn and no random numbers are consumed.
        """
        with torch.no_grad(), layout_independent():
            if self.tok_embeddings is not None:  # a pipeline stage holds some of the modules (None: not here)
                nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                block.init_weights()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:
                cutoff = 3 / math.sqrt(self.args.dim)
                nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.args.dim ** -0.5, a=-cutoff, b=cutoff)
        # A plain buffer every rank holds whole: to_empty left it uninitialized.
        table = rotary_table(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.register_buffer("rotary", table.to(self.rotary.device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [bs, seqlen, vocab] for token ids [bs, seqlen].

        A pipeline stage (``shardwise.parallel.pipeline_parallel.pipeline``) has some of the modules set to None
        and blocks removed: it takes and returns the hidden states [bs, seqlen, dim] where it
        has no embedding / no output layer.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rotary)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
