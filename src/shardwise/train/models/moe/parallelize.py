"""The MoE family's parallel plans: tensor parallelism (Llama's, with the MoE layer's tokens
whole on every tp rank), the routed experts split over ep and/or tp (``ExpertParallel``,
``TensorParallel``, ``ExpertTensorParallel``), and the load-balancing update after each
optimizer step.

The generic steps after them (activation checkpointing -> compile -> FSDP/HSDP, the experts
sharded over the ranks that hold the same experts) are ``shardwise.train.parallelize``'s.
docs/parallelism.md, "Mixture of experts and expert parallelism".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.core.mesh import DeviceMesh
from shardwise.train.models.llama.parallelize import tp_plans
from shardwise.train.models.moe.model import MoEBlock, moe_layers
from shardwise.train.parallelize import ParallelAPI, ParallelOptions

__all__ = ["apply_tp", "apply_ep", "update_expert_bias"]


def _moe_boundary(between: Any, api: ParallelAPI) -> Any:
    """``api``'s ``PrepareModuleInputOutput`` for the MoE layer (``between``: the residual
    stream's placement). The layer takes the stream whole (plain, the same on every tp rank)
    and hands it back in the stream's layout: every tp rank routes all the layer's tokens, each
    computes its slice of every expert (``apply_ep``: experts split over tp); the router and
    the shared expert run whole on each tp rank."""
    if api.PrepareModuleInputOutput is None:
        raise NotImplementedError("this parallel API has no PrepareModuleInputOutput: the MoE layer's TP boundary needs it")
    return api.PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(api.Replicate(),),
                                        use_local_input=True, output_layouts=(api.Replicate(),),
                                        desired_output_layouts=(between,), use_local_output=True)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, options: ParallelOptions, api: ParallelAPI) -> None:
    """Llama's TP/SP plan for the embedding, attention, dense blocks and output; the MoE layers
    computed whole on each tp rank (``_moe_boundary``)."""
    root, block = tp_plans(options.sequence_parallel, options.loss_parallel, api)
    root = {path: style for path, style in root.items() if getattr(model, path, None) is not None}  # pipeline stage
    api.parallelize_module(model, tp_mesh, root)
    between = api.Shard(1) if options.sequence_parallel else api.Replicate()
    attention_only = {key: style for key, style in block.items() if not key.startswith("feed_forward")}
    for layer in model.layers.values():
        plan = {**attention_only, "moe": _moe_boundary(between, api)} if isinstance(layer, MoEBlock) else block
        api.parallelize_module(layer, tp_mesh, plan)


def apply_ep(model: nn.Module, experts_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """Split every MoE layer's routed experts over ``experts_mesh``: ``ExpertParallel`` on
    ("ep",), ``TensorParallel`` on ("tp",), ``ExpertTensorParallel`` on ("ep", "tp")."""
    from shardwise.parallel import parallelize_module
    from shardwise.parallel.expert_parallel import ExpertParallel, ExpertTensorParallel, TensorParallel

    styles = {("ep",): ExpertParallel, ("tp",): TensorParallel, ("ep", "tp"): ExpertTensorParallel}
    style = styles[tuple(experts_mesh.mesh_dim_names or ())]
    for layer in model.layers.values():
        if isinstance(layer, MoEBlock):
            parallelize_module(layer, experts_mesh, {"moe.experts": style()})


def update_expert_bias(model: nn.Module, dp_mesh: DeviceMesh | None) -> None:
    """After an optimizer step: every MoE layer's load-balancing bias from the tokens per expert
    counted by all data-parallel ranks since the last step (one all_reduce over ``dp_mesh``
    for all layers; tp ranks count the same tokens, so they are not in it)."""
    layers = moe_layers(model)
    if not layers:
        return
    counts = torch.stack([layer.tokens_per_expert for layer in layers])  # [layers, experts]
    if dp_mesh is not None:
        counts = comm.all_reduce(counts, dp_mesh, 0, "sum")
    for layer, layer_counts in zip(layers, counts):
        layer.update_expert_bias(layer_counts)
