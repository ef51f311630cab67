"""A mixture-of-experts decoder, written for one device (docs/parallelism.md, "Mixture of experts and expert parallelism").

Llama's decoder (``shardwise.train.models.llama.model``: its attention, norms, rotary table and
dense blocks, imported, not copied) whose feed-forward is, from block ``n_dense_layers`` on,
an ``MoE`` layer:

* ``TokenChoiceRouter``: each token scores every expert (softmax or sigmoid), optionally keeps
  its best groups of experts first (node-limited routing), and picks its top-k experts; the
  routing weights are the chosen scores, optionally normalized and scaled. A per-expert bias
  (auxiliary-loss-free load balancing) shifts only the choice, never the weights.
* ``GroupedExperts``: the routed experts' SwiGLU weights stacked ``[experts, ...]``, run over
  the tokens sorted by expert, one matmul chain per expert (torch's ``_grouped_mm`` has no CPU
  backward in torch 2.13, so the loop is the one path: the same results everywhere).
* an optional shared expert every token goes through.

Dropless: every token reaches all of its k experts, however unbalanced the routing, so every
parallel layout computes exactly what one process computes. Nothing here knows about meshes:
expert parallelism (``shardwise.parallel.expert_parallel``) dispatches the sorted tokens to the
ranks owning their experts around ``GroupedExperts`` from outside, through module hooks.

Host synchronizations: one per MoE layer, ``GroupedExperts`` reading the tokens per expert to
split its input (under expert parallelism the dispatch reads them instead, also once, and
hands the experts host-side counts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.train.models.llama.model import Attention, FeedForward, Transformer
from shardwise.train.models.moe.args import MoEArgs, MoEModelArgs, ScoreFunc

__all__ = ["TokenChoiceRouter", "GroupedExperts", "SharedExpert", "MoE", "MoEBlock", "MoETransformer",
           "route", "split_sizes", "bias_delta", "sequence_aux_loss"]


# ---------------------------------------------------------------------- routing (pure)
def route(scores: torch.Tensor, bias: torch.Tensor | None, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and routing weights from its scores [tokens, experts].

    Returns ``(selected [tokens, top_k] int64, weights [tokens, top_k])``. The bias (load
    balancing) and the group limit change which experts are chosen; the weights are the
    chosen experts' own scores (normalized over the k with ``route_norm``, times ``route_scale``).
    """
    choice = scores.detach() if bias is None else scores.detach() + bias
    if args.num_groups > 1:
        choice = _keep_top_groups(choice, args.num_groups, args.top_groups)
    selected = choice.topk(args.top_k, dim=-1).indices  # [tokens, k]
    weights = scores.gather(-1, selected)
    if args.route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return selected, weights * args.route_scale


def _keep_top_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``keep`` best groups set to -inf.

    A group scores the sum of its two best experts (one, for groups of one expert).
    """
    tokens, experts = choice.shape
    grouped = choice.view(tokens, groups, experts // groups)  # [tokens, groups, per group]
    group_score = grouped.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)  # [tokens, groups]
    best = group_score.topk(keep, dim=-1).indices  # [tokens, keep]
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, experts)


def split_sizes(counts: torch.Tensor, rows: int, experts: int) -> list[int]:
    """Rows per expert from the tokens-per-expert ``counts`` (the layer's one host read).

    On the meta device (a simulated step) the counts hold no values: routing is taken as
    balanced, the rows dealt as evenly as possible.
    """
    if counts.is_meta:
        return [rows // experts + (e < rows % experts) for e in range(experts)]
    return [int(c) for c in counts.tolist()]


def bias_delta(counts: torch.Tensor, coeff: float) -> torch.Tensor:
    """The load-balancing bias change for one layer's tokens per expert [experts].

    Each expert's bias moves by ``coeff`` towards balance (up if it received fewer tokens than
    the mean, down if more); the changes are centred so the biases do not drift together.
    """
    delta = coeff * torch.sign(counts.mean() - counts)
    return delta - delta.mean()


def sequence_aux_loss(scores: torch.Tensor, selected: torch.Tensor, args: MoEArgs, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the ``batch`` sequences.

    Per sequence: ``sum_i f_i * P_i`` with ``f_i`` the fraction of its token-choices that went
    to expert i (times experts / k) and ``P_i`` its tokens' mean normalized score of expert i.
    Computed per sequence, it is the same whichever rank holds the sequence.
    """
    experts, k = args.num_experts, args.top_k
    probs = (scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)).view(batch, -1, experts)  # [batch, seq, E]
    chosen = torch.zeros(batch, experts, device=scores.device, dtype=scores.dtype)
    chosen.scatter_add_(1, selected.view(batch, -1), torch.ones_like(selected.view(batch, -1), dtype=scores.dtype))
    fraction = chosen * experts / (k * probs.shape[1])  # [batch, E]
    return (fraction * probs.mean(dim=1)).sum(dim=-1).mean() * args.aux_loss_coeff


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also starts ``aux``'s gradient (weight 1): the auxiliary
    loss trains the router without changing the model's output or the reported loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


# ---------------------------------------------------------------------- modules
class TokenChoiceRouter(nn.Module):
    """Scores [tokens, experts] from a bias-free linear gate, and each token's top-k experts."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``(selected [tokens, k], weights [tokens, k], scores [tokens, experts])`` for x [tokens, dim]."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.args.score_func is ScoreFunc.SOFTMAX else logits.sigmoid()
        selected, weights = route(scores, bias, self.args)
        return selected, weights, scores


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The block of the experts this rank holds: under expert parallelism the weights are
    DTensors sharded over experts (the style hands this module its own experts' tokens)."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1, w3 [experts, hidden, dim], w2 [experts, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``w2(silu(w1 x) * w3 x)`` per expert, for x [rows, dim] sorted by expert, ``counts``
        [experts] rows each (of the experts this rank holds)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        pieces = torch.split(x, split_sizes(counts, x.shape[0], w1.shape[0]))
        outs = [(F.silu(p @ w1[e].T) * (p @ w3[e].T)) @ w2[e].T for e, p in enumerate(pieces)]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])

    def init_weights(self, depth_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for weight in (self.w2, self.w3):
            nn.init.trunc_normal_(weight, mean=0.0, std=depth_std)


class SharedExpert(FeedForward):
    """Llama's SwiGLU (its forward and init) at a width of its own: the experts every token uses."""

    def __init__(self, dim: int, hidden: int) -> None:
        nn.Module.__init__(self)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class MoE(nn.Module):
    """Router, routed experts, optional shared expert; dropless token-choice top-k.

    Buffers: ``expert_bias`` [experts] (saved in checkpoints; changed only by
    ``update_expert_bias``), ``tokens_per_expert`` [experts] (not saved): the tokens each expert
    received since the last update, counted outside autograd at every forward, so gradient
    accumulation and pipeline microbatches all count. (Activation checkpointing runs the forward
    twice and counts everything twice: the update reads only signs, so it is unchanged.)
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = TokenChoiceRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        shared = args.num_shared_experts * args.hidden_dim
        self.shared_expert = SharedExpert(dim, shared) if shared else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)  # [tokens, dim]
        bias = self.expert_bias if self.args.load_balance_coeff is not None else None
        selected, weights, scores = self.router(flat, bias)  # [tokens, k] x2, [tokens, experts]
        choices = selected.flatten()  # [tokens * k]
        counts = choices.new_zeros(self.args.num_experts).scatter_add_(0, choices, torch.ones_like(choices))  # [experts]
        with torch.no_grad():
            self.tokens_per_expert += counts
        order = choices.argsort(stable=True)  # token-choices sorted by expert
        token_of = order // self.args.top_k  # [tokens * k]
        routed = self.experts(flat[token_of], counts)  # [tokens * k, dim]
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of, routed)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        if self.args.aux_loss_coeff > 0 and torch.is_grad_enabled():
            out = _AddAuxLoss.apply(out, sequence_aux_loss(scores, selected, self.args, bs))
        return out.view(bs, seqlen, dim)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Move the bias towards balance from ``counts`` (every rank's tokens per expert) and
        start counting again: once per optimizer step (``MoETransformer.after_optimizer_step``)."""
        if self.args.load_balance_coeff is not None:
            self.expert_bias += bias_delta(counts.to(self.expert_bias.dtype), self.args.load_balance_coeff)
        self.tokens_per_expert.zero_()

    def init_weights(self, depth_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=0.02)
        self.experts.init_weights(depth_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(depth_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


class MoEBlock(nn.Module):
    """Pre-norm residual block: Llama's attention, then the mixture of experts."""

    def __init__(self, layer_id: int, args: MoEModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.moe = MoE(args.dim, args.moe)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # as Llama's blocks

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotary)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.depth_std)
        self.moe.init_weights(self.depth_std)


class MoETransformer(Transformer):
    """Llama's ``Transformer`` (embedding, blocks, norm, output, its init and forward) with
    MoE blocks after the first ``n_dense_layers`` dense ones.

    Args:
        args: the shapes.

    Example:
        >>> model = MoETransformer(CONFIGS["tiny_moe"])
        >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def build_block(self, layer_id: int, args: MoEModelArgs) -> nn.Module:
        return MoEBlock(layer_id, args) if layer_id >= args.n_dense_layers else super().build_block(layer_id, args)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model or of a pipeline stage of it, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
