"""The MoE family's shapes: ``MoEArgs`` (one mixture-of-experts layer), ``MoEModelArgs`` (the
decoder), the named configs, and what follows from the shapes alone.

Pure arithmetic, no model is built: parameter counts (all of them, and the active ones a token
runs through, which set the FLOPs), and the checks of the shapes against the parallel degrees
(attention heads over ``--tp`` as Llama's, experts over ``--ep``). docs/parallelism.md, "Mixture of experts and expert parallelism".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from shardwise.parallel.dims import ParallelDims
from shardwise.train.errors import ConfigError
from shardwise.train.models.llama.args import ModelArgs as LlamaArgs
from shardwise.train.models.llama.args import check_degrees as llama_check_degrees

__all__ = ["ScoreFunc", "MoEArgs", "MoEModelArgs", "CONFIGS", "CONFIG_NOTES", "check_degrees", "flops_per_token",
           "for_seq_len"]


class ScoreFunc(enum.Enum):
    """How the router turns its logits into expert scores."""

    SOFTMAX = "softmax"  # over all experts (Mixtral, DeepSeek-V2, Qwen-MoE)
    SIGMOID = "sigmoid"  # each expert on its own (DeepSeek-V3); usually with normalization


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """One mixture-of-experts feed-forward layer.

    Args:
        num_experts: routed experts.
        top_k: experts each token is sent to.
        hidden_dim: each expert's SwiGLU width.
        num_shared_experts: experts every token goes through (one SwiGLU of
            ``num_shared_experts * hidden_dim``); 0: none.
        score_func: softmax or sigmoid scores.
        route_norm: divide each token's top-k scores by their sum.
        route_scale: multiply the routing weights by this.
        num_groups: node-limited routing: the experts in this many equal groups; each token
            first keeps its ``top_groups`` best groups (a group scores the sum of its two best
            experts), then picks its top_k experts among them. 1: no groups.
        top_groups: groups each token may use (with ``num_groups > 1``).
        load_balance_coeff: auxiliary-loss-free load balancing: after each optimizer step every
            expert's routing bias moves by this towards balance (the sign of mean count minus
            its count); None: no bias.
        aux_loss_coeff: weight of the sequence-wise auxiliary balance loss (DeepSeek-V3's
            complementary loss, per sequence so that every data-parallel layout gives the same
            value); 0: none.

    Example:
        >>> MoEArgs(num_experts=8, top_k=2, hidden_dim=64).active_experts
        2
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 128
    num_shared_experts: int = 1
    score_func: ScoreFunc = ScoreFunc.SIGMOID
    route_norm: bool = True
    route_scale: float = 1.0
    num_groups: int = 1
    top_groups: int = 1
    load_balance_coeff: float | None = 1e-3
    aux_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        counts = {k: getattr(self, k) for k in ("num_experts", "top_k", "hidden_dim", "num_groups", "top_groups")}
        bad = {k: v for k, v in counts.items() if not isinstance(v, int) or v < 1}
        if bad or self.num_shared_experts < 0:
            raise ConfigError(f"MoE shapes must be positive integers (shared experts >= 0), got "
                              f"{bad or {'num_shared_experts': self.num_shared_experts}}")
        if not isinstance(self.score_func, ScoreFunc):
            raise ConfigError(f"score_func must be a ScoreFunc, got {self.score_func!r}")
        if self.num_experts % self.num_groups or self.top_groups > self.num_groups:
            raise ConfigError(f"num_groups {self.num_groups} must divide num_experts {self.num_experts} and be at "
                              f"least top_groups {self.top_groups}")
        if self.top_k > self.top_groups * (self.num_experts // self.num_groups):
            raise ConfigError(f"top_k {self.top_k} exceeds the {self.top_groups} x "
                              f"{self.num_experts // self.num_groups} experts of the groups a token may use")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0 or self.aux_loss_coeff < 0:
            raise ConfigError(f"load_balance_coeff must be None or > 0 and aux_loss_coeff >= 0, got "
                              f"{self.load_balance_coeff}, {self.aux_loss_coeff}")

    @property
    def active_experts(self) -> int:
        return self.top_k

    def num_params(self, dim: int, *, active: bool = False) -> int:
        """Parameters of the layer: router, routed experts (all, or the top_k a token uses), shared."""
        experts = self.top_k if active else self.num_experts
        return dim * self.num_experts + (experts + self.num_shared_experts) * 3 * dim * self.hidden_dim


@dataclass(frozen=True, slots=True)
class MoEModelArgs(LlamaArgs):
    """A Llama-style decoder whose feed-forward is a mixture of experts in all blocks but the
    first ``n_dense_layers``: Llama's shapes (``llama.args.ModelArgs``, whose attention, norms
    and dense blocks it builds; the dense SwiGLU width follows Llama's rule) and these.

    Args:
        n_dense_layers: the first blocks keep a dense SwiGLU (as DeepSeek's first layers).
        moe: the MoE layers' shapes.

    Example:
        >>> CONFIGS["debug_moe"].moe_layers
        [1, 2, 3]
    """

    dim: int = 128
    n_dense_layers: int = 1
    moe: MoEArgs = field(default_factory=MoEArgs)

    def __post_init__(self) -> None:
        LlamaArgs.__post_init__(self)  # the attention and dense shapes' own checks
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"n_dense_layers {self.n_dense_layers} must be between 0 and n_layers {self.n_layers}")

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose feed-forward is a mixture of experts."""
        return list(range(self.n_dense_layers, self.n_layers))

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count from the shapes; ``active``: those one token runs through (top_k experts)."""
        dense_ffn = 3 * self.dim * self.hidden_dim
        attention_and_norms = LlamaArgs.num_params(self) - self.n_layers * dense_ffn
        moe = self.moe.num_params(self.dim, active=active)
        return attention_and_norms + self.n_dense_layers * dense_ffn + len(self.moe_layers) * moe


_DEBUG_MOE = MoEArgs(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, score_func=ScoreFunc.SIGMOID,
                     num_groups=4, top_groups=2, load_balance_coeff=1e-3)

CONFIGS: dict[str, MoEModelArgs] = {
    # Parity tests: one dense block and one MoE block, every router feature on (sigmoid,
    # groups, normalization, bias, auxiliary loss); heads divide by tp 4, experts by ep 8.
    "tiny_moe": MoEModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=32, n_dense_layers=1,
                             moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1,
                                         num_groups=4, top_groups=2, route_scale=1.5, load_balance_coeff=1e-2,
                                         aux_loss_coeff=1e-2)),
    # Context-parallel parity tests: tiny_moe without its auxiliary loss, which is sequence-wise
    # (--cp splits the sequences; check_degrees refuses the two together).
    "tiny_moe_cp": MoEModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=32, n_dense_layers=1,
                                moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1,
                                            num_groups=4, top_groups=2, route_scale=1.5, load_balance_coeff=1e-2)),
    # Learns on a CPU: 8 experts, top-2, width 128 (see CONFIG_NOTES for its measured speed).
    "debug_moe": MoEModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, n_dense_layers=1, moe=_DEBUG_MOE),
    # Eight blocks of width 512, 16 experts: for a GPU.
    "small_moe": MoEModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256, n_dense_layers=1,
                              moe=MoEArgs(num_experts=16, top_k=2, hidden_dim=512, num_shared_experts=1)),
    # DeepSeek-V2-Lite's shapes (its MLA attention replaced by grouped-query attention of the
    # same width): 27 blocks, the first dense (width 10944), 64 experts of
    # width 1408, top-6, 2 shared, softmax scores. For --simulate and shardwise.plan.
    "deepseek_v2_lite": MoEModelArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400,
                                     multiple_of=64, ffn_dim_multiplier=2.004, rope_theta=10000.0, max_seq_len=4096,
                                     n_dense_layers=1,
                                     moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2,
                                                 score_func=ScoreFunc.SOFTMAX, route_norm=False,
                                                 load_balance_coeff=None)),
}

CONFIG_NOTES: dict[str, str] = {
    "tiny_moe": "the MoE parity tests' model",
    "tiny_moe_cp": "tiny_moe without the auxiliary loss, for --cp",
    "debug_moe": "8 experts top-2, learns on a CPU",
    "small_moe": "16 experts top-2, for a GPU",
    "deepseek_v2_lite": "DeepSeek-V2-Lite shapes (64 experts, top-6), for --simulate and shardwise.plan",
}


def check_degrees(args: MoEModelArgs, dims: ParallelDims, config: str) -> None:
    """Llama's head checks for ``--tp``; ``--ep`` divides the routed experts; ``--cp`` would cut
    the sequences the auxiliary loss is computed over."""
    llama_check_degrees(args, dims, config)
    if args.moe.num_experts % dims.ep:
        raise ConfigError(f"--ep {dims.ep} must divide the experts of config {config!r}: "
                          f"num_experts={args.moe.num_experts}")
    if dims.cp > 1 and args.moe.aux_loss_coeff > 0:
        raise ConfigError(f"--cp {dims.cp} splits every sequence over ranks, but config {config!r}'s auxiliary "
                          f"balance loss (aux_loss_coeff={args.moe.aux_loss_coeff}) is computed per whole sequence; "
                          f"use a config without it")


def flops_per_token(args: MoEModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per *active* parameter (a token runs through top_k experts,
    not all) plus attention's scores and weighted sum (12 x layers x dim x seq_len)."""
    return 6 * args.num_params(active=True) + 12 * args.n_layers * args.dim * seq_len


def for_seq_len(args: MoEModelArgs, seq_len: int) -> MoEModelArgs:
    """The shapes with the rotary table covering at least ``seq_len`` positions."""
    return replace(args, max_seq_len=max(args.max_seq_len, seq_len))
