"""Llama's shapes: ``ModelArgs``, the named configs, and what follows from the shapes alone.

Pure arithmetic, no model is built: parameter and FLOP counts, and the check of the shapes
against the parallel degrees (the attention heads split over ``--tp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardwise.parallel.dims import ParallelDims
from shardwise.train.errors import ConfigError

__all__ = ["ModelArgs", "CONFIGS", "CONFIG_NOTES", "check_degrees", "flops_per_token", "for_seq_len"]


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Shapes of a Llama-style decoder (torchtitan naming).

    Args:
        dim: model (residual stream) width.
        n_layers: transformer blocks.
        n_heads: query heads; ``dim`` must be divisible by it (head_dim = dim // n_heads).
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        vocab_size: embedding rows and output columns (256 for the byte tokenizer).
        multiple_of: the SwiGLU hidden width is rounded up to a multiple of this.
        ffn_dim_multiplier: optional scale of the SwiGLU hidden width (Llama 3 uses 1.3).
        norm_eps: RMSNorm epsilon.
        rope_theta: rotary embedding base.
        max_seq_len: longest sequence the rotary table covers.

    Example:
        >>> ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4).hidden_dim
        192
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256
    multiple_of: int = 64
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        positive = {k: getattr(self, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                  "multiple_of", "max_seq_len")}
        bad = {k: v for k, v in positive.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ConfigError(f"model shapes must be positive integers, got {bad}")
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"head_dim {self.dim // self.n_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim (same parameter count as a 4x MLP), scaled, rounded up."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no model is built)."""
        kv = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv
        feed_forward = 3 * self.dim * self.hidden_dim
        block = attention + feed_forward + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim


CONFIGS: dict[str, ModelArgs] = {
    # Parity tests: smallest shapes that still divide by tp=4 everywhere (heads, kv heads, hidden).
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=32),
    # Pipeline parity tests: tiny with four blocks (interleaved 1F1B over 2 ranks runs 4 stages).
    "tiny4": ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=32),
    # The default: learns visibly on a CPU (see CONFIG_NOTES for its measured speed).
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=256),
    # Eight blocks of width 512, for a GPU.
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256),
    # Llama 3 8B shapes (GPUs only); the byte tokenizer uses the first 256 embedding rows.
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
}

# What each config is for, shown by --help next to its size. Sizes are never written by hand:
# the CLI computes them from the shapes (a test keeps hand-written ones out). No speed is
# quoted: it depends on the core and its load (``python -m shardwise.train --config debug
# --steps 10`` prints each step's time).
CONFIG_NOTES: dict[str, str] = {
    "tiny": "the parity tests' model",
    "tiny4": "tiny with four blocks, for the pipeline parity tests",
    "debug": "learns on a CPU: one core is enough at the default batch",
    "small": "for a GPU",
    "llama3_8b": "Llama 3 8B shapes, GPUs only",
}


def check_degrees(args: ModelArgs, dims: ParallelDims, config: str) -> None:
    """Tensor parallelism splits whole attention heads: ``--tp`` divides both head counts."""
    if args.n_heads % dims.tp or args.n_kv_heads % dims.tp:
        raise ConfigError(f"--tp {dims.tp} must divide the attention heads of config {config!r}: "
                          f"n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}")


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
    scores and weighted sum over ``seq_len`` positions (12 x layers x dim x seq_len)."""
    return 6 * args.num_params() + 12 * args.n_layers * args.dim * seq_len


def for_seq_len(args: ModelArgs, seq_len: int) -> ModelArgs:
    """The shapes with the rotary table covering at least ``seq_len`` positions."""
    return replace(args, max_seq_len=max(args.max_seq_len, seq_len))
