"""TopKExpertParallel: expert parallelism for experts modules called with the router's top-k choices.

Hugging Face transformers' mixture-of-experts models (Mixtral, Qwen3-MoE and the others whose
experts hold stacked ``gate_up_proj [experts, 2 * hidden, dim]`` / ``down_proj [experts, dim,
hidden]`` weights) call their experts as ``experts(tokens [T, dim], top_k_index [T, k],
top_k_weights [T, k])`` and get back ``[T, dim]``: each token's weighted sum over its k experts.
``ExpertParallel`` (``style.py``) expects rows already sorted by expert with their counts. This
style adapts one convention to the other around the unchanged module, by forward hooks:

1. before the module: the T x k token-choices sorted by expert, their counts, and the same
   dispatch as ``ExpertParallel`` (one all_to_all of counts, one host read, one all_to_all of
   rows); the module is then called on its own experts' rows, each row choosing its local expert
   once with weight 1 (``rows [R, dim], index [R, 1], ones [R, 1]``), so it returns every row's
   unweighted expert output;
2. while it runs, its stacked parameters read as this rank's block (``DTensor.to_local``, the
   gradient flowing back to the sharded parameter) and its ``num_experts`` as the local count,
   so any of its implementations (eager loop, grouped or batched matmul) computes the local
   experts; both are shadowed on the instance for the call only, the class is not touched;
3. after it: the same combine as ``ExpertParallel``, then each row times its routing weight
   (the router's gradient flows from here) and the k rows of a token summed back into it.

docs/expert_parallel.md shows the module plan for a transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Shard
from shardwise.parallel.expert_parallel.style import InFlight, combine_rows, dispatch_rows
from shardwise.parallel.tensor_parallel.style import ParallelStyle, _check_plain, _shard_parameter
from shardwise.tensor.dtensor import DTensor

__all__ = ["TopKExpertParallel"]

COUNT_ATTRIBUTE = "num_experts"  # what transformers' experts implementations read the expert count from


@dataclass
class _Call:
    """What the combine of the call in progress needs from its dispatch."""

    exchange: InFlight
    order: torch.Tensor  # [T * k]: the token-choices sorted by expert
    top_k: int
    weights: torch.Tensor  # [T, k]
    tokens: torch.Tensor  # [T, dim]: the module's input, for the output's shape and dtype


class TopKExpertParallel(ParallelStyle):
    """Split a stacked-experts module called as ``module(tokens, top_k_index, top_k_weights)``
    over a 1-D mesh axis; tokens are dispatched and combined by all_to_all as ``ExpertParallel``.

    Every parameter of the module (its own, not its children's) stacks the experts along dim 0;
    their number divides the mesh size. The module keeps its code: while it runs it sees its
    rank's experts only (see the module docstring). Host synchronizations: one per call.

    Example:
        >>> ep = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        >>> parallelize_module(mixtral, ep, {"model.layers.*.mlp.experts": TopKExpertParallel()})
    """

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().check(module, mesh)
        params = list(module.named_parameters(recurse=False))
        if not params:
            held = sum(1 for _ in module.parameters())
            raise ValueError(f"TopKExpertParallel needs the experts stacked in the module's own parameters "
                             f"[experts, ...]; it holds none ({held} in submodules, e.g. a ModuleList of experts)")
        for name, _ in params:
            _check_plain(module, "TopKExpertParallel", name)
        sizes = {name: p.shape[0] if p.dim() else None for name, p in params}
        experts = set(sizes.values())
        if len(experts) != 1 or None in experts:
            raise ValueError(f"TopKExpertParallel: every parameter needs the experts along dim 0, the same number; "
                             f"got {sizes}")
        count = experts.pop()
        if count % mesh.size():
            raise ValueError(f"TopKExpertParallel: {count} experts cannot be split evenly over the {mesh.size()} "
                             f"ranks of {mesh}")

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _shard_parameter(module, name, mesh, Shard(0), self.src_data_rank)
        _install_hooks(module, mesh)
        return module


def _install_hooks(module: nn.Module, mesh: DeviceMesh) -> None:
    """Dispatch before ``module``, combine after; the local view of it in between."""
    state: dict[str, _Call] = {}
    experts = next(module.parameters(recurse=False)).shape[0]  # the global count: the parameters are DTensors

    def before(mod: nn.Module, inputs: tuple) -> tuple:
        tokens, index, weights = _routing_inputs(mod, inputs)
        local_inputs, state["call"] = _dispatch(tokens, index, weights, experts, mesh)
        _shadow_local(mod, experts // mesh.size())
        return local_inputs

    def after(mod: nn.Module, inputs: tuple, out: torch.Tensor | None) -> torch.Tensor | None:
        _unshadow(mod)
        call = state.pop("call", None)
        return None if out is None or call is None else _combine(out, call, mesh)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)  # the shadows go even if the module raises


def _routing_inputs(module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(inputs) != 3:
        raise TypeError(f"TopKExpertParallel: {type(module).__name__} must be called with three positional "
                        f"arguments (tokens [T, dim], top_k_index [T, k], top_k_weights [T, k]); got {len(inputs)}")
    return inputs


def _dispatch(tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts: int,
              mesh: DeviceMesh) -> tuple[tuple, _Call]:
    """The module's arguments for its local experts' rows, and what the combine needs."""
    top_k = index.shape[-1]
    choices = index.reshape(-1)  # [T * k]
    order = choices.argsort(stable=True)  # the token-choices sorted by expert
    counts = choices.new_zeros(experts).scatter_add_(0, choices, torch.ones_like(choices))  # [experts]
    (rows, local_counts), exchange = dispatch_rows(tokens[order // top_k], counts, mesh, 0)  # rows [R, dim]
    local_index = torch.repeat_interleave(torch.arange(len(local_counts)), local_counts).to(index.device)  # [R]
    ones = weights.new_ones(rows.shape[0], 1)  # [R, 1]: the routing weights are applied after the combine
    return (rows, local_index.unsqueeze(1), ones), _Call(exchange, order, top_k, weights, tokens)


def _combine(out: torch.Tensor, call: _Call, mesh: DeviceMesh) -> torch.Tensor:
    """Every token's weighted sum over its k experts' outputs [T, dim]."""
    rows = combine_rows(out, call.exchange, mesh, 0)  # [T * k, dim] in expert order
    weighted = rows * call.weights.reshape(-1)[call.order].unsqueeze(-1).to(rows.dtype)
    tokens = call.tokens
    return torch.zeros_like(tokens).index_add(0, call.order // call.top_k, weighted.to(tokens.dtype))


def _shadow_local(module: nn.Module, local_experts: int) -> None:
    """For the call: each DTensor parameter reads as this rank's block, ``num_experts`` as the
    local count. Instance attributes take precedence over ``nn.Module.__getattr__``'s lookup of
    parameters, so ``_parameters`` (state dicts, optimizers, FSDP) is untouched."""
    _unshadow(module)  # a call whose forward hook never ran (a recomputation stopped early) left its shadows
    shadows = {name: p.to_local() for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    if isinstance(getattr(module, COUNT_ATTRIBUTE, None), int):
        shadows[COUNT_ATTRIBUTE] = local_experts
    module.__dict__["_shardwise_shadowed"] = {name: module.__dict__.get(name) for name in shadows}
    module.__dict__.update(shadows)


def _unshadow(module: nn.Module) -> None:
    """Undo ``_shadow_local``: the parameters and the expert count as they were."""
    for name, previous in module.__dict__.pop("_shardwise_shadowed", {}).items():
        if previous is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous
