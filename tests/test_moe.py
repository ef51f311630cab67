"""The MoE family on one device: routing (top-k, groups, score functions, normalization, the
balancing bias), the per-expert compute against a naive per-token reference (values and
gradients), the auxiliary loss, shapes and counts. Pure, in this process.

docs/parallelism.md, "Mixture of experts and expert parallelism".
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from shardwise.train import ConfigError
from shardwise.train.models.moe import CONFIGS, MOE, MoE, MoEArgs, MoETransformer, ScoreFunc
from shardwise.train.models.moe.model import TokenChoiceRouter, bias_delta, route

ARGS = MoEArgs(num_experts=8, top_k=2, hidden_dim=12, num_shared_experts=1, load_balance_coeff=None)


# ---------------------------------------------------------------------- routing
def test_top_k_takes_the_best_scores_and_normalizes_and_scales_them():
    scores = torch.tensor([[0.1, 0.7, 0.2, 0.9, 0.0, 0.3, 0.4, 0.5]])
    selected, weights = route(scores, None, replace(ARGS, route_norm=False))
    assert selected.tolist() == [[3, 1]] and torch.allclose(weights, torch.tensor([[0.9, 0.7]]))
    _, weights = route(scores, None, replace(ARGS, route_norm=True, route_scale=2.5))
    torch.testing.assert_close(weights, 2.5 * torch.tensor([[0.9, 0.7]]) / 1.6)


def test_group_limited_routing_chooses_within_the_best_groups_only():
    # 4 groups of 2: group 0 holds the best expert (0.9) but scores 0.9 + 0.0; group 1 scores 1.0.
    scores = torch.tensor([[0.9, 0.0, 0.55, 0.45, 0.1, 0.1, 0.2, 0.3]])
    grouped = replace(ARGS, num_groups=4, top_groups=1, route_norm=False)
    assert sorted(route(scores, None, grouped)[0].tolist()[0]) == [2, 3]
    two_groups = replace(grouped, top_groups=2)
    assert sorted(route(scores, None, two_groups)[0].tolist()[0]) == [0, 2]
    assert sorted(route(scores, None, replace(ARGS, route_norm=False))[0].tolist()[0]) == [0, 2]


def test_the_bias_changes_the_choice_not_the_weights():
    scores = torch.tensor([[0.1, 0.7, 0.2, 0.9, 0.0, 0.3, 0.4, 0.5]])
    bias = torch.zeros(8)
    bias[4] = 1.0  # expert 4 (score 0.0) now wins the choice
    selected, weights = route(scores, bias, replace(ARGS, route_norm=False))
    assert selected.tolist() == [[4, 3]] and torch.allclose(weights, torch.tensor([[0.0, 0.9]]))


@pytest.mark.parametrize("func", list(ScoreFunc))
def test_router_scores_are_softmax_or_sigmoid_of_the_gate(func):
    torch.manual_seed(0)
    router = TokenChoiceRouter(16, replace(ARGS, score_func=func))
    x = torch.randn(5, 16)
    _, _, scores = router(x, None)
    logits = x @ router.gate.weight.T
    want = logits.softmax(-1) if func is ScoreFunc.SOFTMAX else logits.sigmoid()
    torch.testing.assert_close(scores, want)


def test_bias_delta_moves_towards_balance_and_is_centred():
    delta = bias_delta(torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.1)  # mean 5
    assert delta[0] < 0 < delta[1] and abs(float(delta.sum())) < 1e-7


# ---------------------------------------------------------------------- the layer vs a naive reference
def _naive(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the sum of its chosen experts' SwiGLU outputs times their weights, plus the shared expert."""
    selected, weights, _ = layer.router(x, layer.expert_bias if layer.args.load_balance_coeff is not None else None)
    rows = []
    for t in range(x.shape[0]):
        row = layer.shared_expert(x[t]) if layer.shared_expert is not None else torch.zeros_like(x[t])
        for e, w in zip(selected[t].tolist(), weights[t]):
            w1, w2, w3 = (getattr(layer.experts, n)[e] for n in ("w1", "w2", "w3"))
            row = row + w * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("args", [ARGS, replace(ARGS, score_func=ScoreFunc.SOFTMAX, num_shared_experts=0,
                                                 num_groups=2, top_groups=1, load_balance_coeff=1e-3)],
                         ids=["sigmoid_shared", "softmax_groups_bias"])
def test_layer_equals_a_per_token_reference_in_values_and_gradients(args):
    torch.manual_seed(0)
    layer = MoE(16, args)
    layer.init_weights(0.05)
    layer.expert_bias.copy_(torch.linspace(-0.01, 0.01, 8))
    x = torch.randn(2, 7, 16, requires_grad=True)
    out = layer(x)
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x.grad = None
    want_out = _naive(layer, x.flatten(0, 1)).view_as(out)
    (want_out * probe).sum().backward()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for name, p in [*layer.named_parameters(), ("x", x)]:
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert layer.tokens_per_expert.sum() == 14 * args.top_k  # every token-choice of the forward counted once


def test_auxiliary_loss_trains_the_router_without_changing_the_output():
    torch.manual_seed(0)
    plain = MoE(16, ARGS)
    plain.init_weights(0.05)
    with_aux = MoE(16, replace(ARGS, aux_loss_coeff=0.1))
    with_aux.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 16)
    outs = [m(x) for m in (plain, with_aux)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.sum().backward()
    assert not torch.allclose(plain.router.gate.weight.grad, with_aux.router.gate.weight.grad)
    torch.testing.assert_close(plain.experts.w1.grad, with_aux.experts.w1.grad)


# ---------------------------------------------------------------------- shapes and counts
def test_published_shapes_build_on_meta_and_count_active_parameters():
    args = CONFIGS["deepseek_v2_lite"]
    with torch.device("meta"):
        model = MoETransformer(args)
    assert sum(p.numel() for p in model.parameters()) == MOE.num_params(args)
    assert 15e9 < MOE.num_params(args) < 16.5e9 and 2.4e9 < args.num_params(active=True) < 3e9
    expert_params = 3 * args.dim * args.moe.hidden_dim * (args.moe.num_experts - args.moe.top_k)
    assert args.num_params() - args.num_params(active=True) == len(args.moe_layers) * expert_params
    assert MOE.flops_per_token(args, 1) == 6 * args.num_params(active=True) + 12 * args.n_layers * args.dim


def test_dense_and_moe_blocks_follow_the_config():
    args = CONFIGS["tiny_moe"]
    model = MoETransformer(args)
    assert [hasattr(block, "moe") for block in model.layers.values()] == [False, True]
    assert sum(p.numel() for p in model.parameters()) == MOE.num_params(args)
    assert "layers.1.moe.expert_bias" in model.state_dict() and "layers.1.moe.tokens_per_expert" not in model.state_dict()


def test_bad_moe_shapes_are_one_clear_error():
    with pytest.raises(ConfigError, match="num_groups 3 must divide num_experts 8"):
        MoEArgs(num_experts=8, num_groups=3)
    with pytest.raises(ConfigError, match="top_k 3 exceeds the 1 x 2 experts"):
        MoEArgs(num_experts=8, top_k=3, num_groups=4, top_groups=1)
    with pytest.raises(ConfigError, match="score_func must be a ScoreFunc"):
        MoEArgs(score_func="softmax")  # type: ignore[arg-type]
