"""Hugging Face transformers' MoE models made expert-parallel by a module plan
(``TopKExpertParallel``): logits and every parameter's gradient equal the same model run in one
process; a plan that cannot split the experts (6 over 4 ranks, a ModuleList) is refused on every
rank before any collective.

transformers is a declared test dependency (pyproject's ``test`` extra, which CI installs): these
tests import it and fail without it rather than skip. Models are built from small configs with a
fixed seed on every rank; nothing is downloaded. docs/expert_parallel.md.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # in the workers too: they import this module to run its functions

RANKS = 4
BATCH = (2, 6)  # per rank: 2 sequences of 6 tokens (12 tokens x top-2 = 24 token-choices over 8 experts)
VOCAB = 64
PLAN_KEY = "model.layers.*.mlp.experts"


def _model(family: str, experts: int = 8, implementation: str | None = None):
    """A 2-layer causal LM of ``family`` (hidden 32, top-2 of ``experts``), seeded: the same on every rank."""
    import transformers

    shapes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=32)
    if family == "mixtral":
        config = transformers.MixtralConfig(**shapes, intermediate_size=48, num_local_experts=experts)
        build = transformers.MixtralForCausalLM
    else:  # Qwen3-MoE: unnormalized top-k weights (norm_topk_prob False), its own head_dim
        config = transformers.Qwen3MoeConfig(**shapes, head_dim=8, moe_intermediate_size=24, num_experts=experts)
        build = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = build(config)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model


def _batches(groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [groups, 2, 6] (one group per data-parallel rank) and the loss's probe on the logits."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (groups, *BATCH), generator=generator)
    return ids, torch.randn(groups, *BATCH, VOCAB, generator=generator)


LAYOUTS = {  # (model family, experts implementation, ep degree, with FSDP)
    "mixtral-ep4": ("mixtral", None, 4, False),  # transformers' default experts: grouped_mm
    # transformers' activation checkpointing: backward runs each layer again, its exchanges too
    "mixtral-ep4-checkpointed": ("mixtral", None, 4, False),
    "qwen3_moe-ep4-eager": ("qwen3_moe", "eager", 4, False),
    # FSDP over all 4 ranks, experts over ep=2 and FSDP-sharded over the 2 holding the same ones:
    # the trainer's rule (shardwise.train.parallelize.apply_fsdp) on a model it did not build.
    "mixtral-fsdp4-ep2": ("mixtral", None, 2, True),
}


def _expert_parallel_model(layout: str) -> dict:
    """On every rank: its batch's logits, every parameter's gradient (DTensor ones gathered
    whole) and the all_to_alls of forward and backward, under the module plan."""
    from shardwise.debug import CommDebugMode
    from shardwise.parallel import ParallelDims, TopKExpertParallel, parallelize_module
    from shardwise.tensor.dtensor import DTensor
    from shardwise.train.parallelize import apply_fsdp, expert_fsdp

    family, implementation, ep, fsdp = LAYOUTS[layout]
    dims = ParallelDims(dp_shard=RANKS, ep=ep, world_size=RANKS)
    world = dims.build_mesh("cpu")
    model = _model(family, implementation=implementation)
    parallelize_module(model, world["ep"], {PLAN_KEY: TopKExpertParallel()})
    sharded = {name for name, p in model.named_parameters() if isinstance(p, DTensor)}
    if layout.endswith("checkpointed"):
        model.gradient_checkpointing_enable()
    if fsdp:
        apply_fsdp(model, list(model.model.layers), world["dp_shard"], False, experts=expert_fsdp(dims, world))
    rank = torch.distributed.get_rank()
    ids, probe = _batches(RANKS)
    with CommDebugMode() as forward:
        logits = model(ids[rank]).logits
    with CommDebugMode() as backward:
        (logits * probe[rank]).sum().backward()
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()}
    return {"logits": logits.detach(), "grads": grads, "sharded": sharded, "ep_rank": world["ep"].get_local_rank(),
            "all_to_all": [c.get_comm_counts().get("all_to_all", 0) for c in (forward, backward)]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_moe_model_under_a_module_plan_equals_one_process(dist, layout):
    per_rank = dist.run(RANKS, _expert_parallel_model, layout, timeout=180)
    family, implementation, _, fsdp = LAYOUTS[layout]
    model = _model(family, implementation=implementation)
    ids, probe = _batches(RANKS)
    logits = model(ids.flatten(0, 1)).logits.view(*probe.shape)  # every rank's sequences in one batch
    (logits * probe).sum().backward()
    layers = model.config.num_hidden_layers
    assert per_rank[0]["sharded"] == {f"model.layers.{i}.mlp.experts.{w}" for i in range(layers)
                                      for w in ("gate_up_proj", "down_proj")}
    for rank, got in enumerate(per_rank):
        _assert_close(got["logits"], logits[rank].detach(), f"{layout} rank {rank}'s logits")
        # Per MoE layer, forward: counts, dispatch, combine; backward: the two row exchanges
        # (after the forward's three again where the layer is recomputed).
        again = 3 if layout.endswith("checkpointed") else 0
        assert got["all_to_all"] == [3 * layers, (2 + again) * layers], got["all_to_all"]
    for name, param in model.named_parameters():
        if fsdp:  # every gradient averaged over the 4 data-parallel ranks, whole on each
            for rank, got in enumerate(per_rank):
                _assert_close(got["grads"][name] * RANKS, param.grad, f"{layout} rank {rank}'s {name} gradient")
            continue
        # A plain parameter's gradient is this rank's tokens' share; an expert's, gathered over
        # ep, already sums its ep group's tokens: one rank per group counts it.
        counted = [r for r in per_rank if name not in r["sharded"] or r["ep_rank"] == 0]
        _assert_close(sum(r["grads"][name] for r in counted), param.grad, f"{layout} {name}'s gradient")


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within 1e-5 relative, elementwise or to the tensor's largest entry: sums over the
    ranks' tokens add in another order than one process's matmuls, and an entry near zero
    cancels (a 1e-6 difference on an entry of 1e-2 in a gradient whose entries reach 1)."""
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _misfit_plan(case: str) -> tuple[str, int]:
    """On every rank: the plan on experts it cannot split over 4 ranks (6 experts, or a ModuleList
    of per-expert MLPs as transformers 4 held them); the error and the collectives issued."""
    import shardwise as sw
    from shardwise.debug import CommDebugMode
    from shardwise.parallel import TopKExpertParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (RANKS,), mesh_dim_names=("ep",))
    model = _model("mixtral", experts=6 if case == "six" else 8)
    if case == "module_list":
        for layer in model.model.layers:
            layer.mlp.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(8))
    with CommDebugMode() as comms, pytest.raises(ValueError) as refused:
        parallelize_module(model, mesh, {PLAN_KEY: TopKExpertParallel()})
    untouched = not any(hasattr(p, "device_mesh") for p in model.parameters())
    return str(refused.value), comms.get_total_counts() + (0 if untouched else 1)


@pytest.mark.parametrize("case,message", [
    ("six", r"\(MixtralExperts\(\)\): TopKExpertParallel: 6 experts cannot be split evenly over the 4 ranks"),
    ("module_list", r"\(ModuleList\(\)\): TopKExpertParallel needs the experts stacked in the module's own "
                    r"parameters \[experts, ...\]; it holds none \(16 in submodules"),
])
def test_experts_the_plan_cannot_split_are_refused_on_every_rank_before_any_collective(dist, case, message):
    per_rank = dist.run(RANKS, _misfit_plan, case, timeout=180)
    for message_got, collectives in per_rank:
        assert message_got.startswith("parallelize_module: plan['model.layers.*.mlp.experts'] on module "
                                      "'model.layers.0.mlp.experts'"), message_got
        assert re.search(message, message_got), message_got
        assert collectives == 0, "parameters were distributed or collectives issued before the refusal"
