"""ExpertParallel: routed experts split over a mesh axis, tokens sent to them and back.

The experts module (``GroupedExperts`` of the MoE family, or any module called as
``experts(rows [tokens, dim] sorted by expert, counts [experts])`` whose parameters stack the
experts along dim 0) keeps its single-device code. This style:

1. shards every parameter ``Shard(0)`` over the 1-D ep mesh: rank s holds experts
   ``s*L .. s*L+L-1`` (L = experts / ep) as DTensors (FSDP then shards them further over the
   ranks that hold the same experts; docs/parallelism.md, "Mixture of experts and expert parallelism");
2. before the module runs (dispatch): exchanges the tokens-per-expert counts (one all_to_all
   of ``experts`` integers), reads them and the local counts to the host in one copy (the
   layer's only host synchronization), sends every row to the rank holding its expert (one
   all_to_all with per-peer counts), and regroups the received rows by expert;
3. after it (combine): undoes the regrouping and sends every row back (one all_to_all).

Autograd runs through both exchanges (``all_to_all.py``), so an expert's gradient on its owner
sums the contributions of every peer's tokens; the ep peers' dense gradients are averaged by
data parallelism as usual.

Why plain tensors and not DTensors for the tokens: the rows each rank sends and receives are
decided by the router at run time and differ per peer, while a DTensor's ``Shard`` placement
derives every rank's block from one global shape (torch.chunk sizes). Expressing the dispatch
as a redistribute would need a ragged placement carrying per-rank sizes (another host
synchronization to agree on the global shape, and sharding rules for ragged blocks in every
op the experts run). What it would buy: ``CommDebugMode``/``explain`` would show the exchange
as a layout change, and the planner could price it; the exchange is counted by
``CommDebugMode`` anyway (it goes through ``shardwise.comm``), so the plain tensors lose little.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

from shardwise import comm
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Shard
from shardwise.parallel.expert_parallel.all_to_all import all_to_all_rows, copy_to_axis, sum_over_axis
from shardwise.parallel.expert_parallel.dispatch import (DispatchPlan, note_exchange, plan_dispatch,
                                                         simulated_exchange)
from shardwise.parallel.tensor_parallel.style import ParallelStyle, _check_plain, _shard_parameter, describe_module

__all__ = ["ExpertParallel", "install_dispatch", "dispatch_rows", "combine_rows", "InFlight"]


@dataclass
class InFlight:
    """What the combine of the call in progress needs from its dispatch."""

    plan: DispatchPlan
    regroup: torch.Tensor  # on the rows' device


class ExpertParallel(ParallelStyle):
    """Split a stacked-experts module over a 1-D mesh axis; dispatch and combine tokens by all_to_all.

    The module is called as ``module(rows, counts)``: ``rows`` [tokens, ...] sorted by expert,
    ``counts`` [experts] the rows per expert (an integer tensor). Every parameter has the
    experts along dim 0, divisible by the mesh size. Host synchronizations: one per call.

    Example:
        >>> parallelize_module(model, world_mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
    """

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().check(module, mesh)
        params = list(module.named_parameters(recurse=False))
        if not params:
            raise ValueError(f"ExpertParallel: {describe_module(module)} holds no parameters to split over experts")
        sizes = {name: p.shape[0] if p.dim() else None for name, p in params}
        for name, _ in params:
            _check_plain(module, "ExpertParallel", name)
        if len(set(sizes.values())) != 1 or None in sizes.values() or next(iter(sizes.values())) % mesh.size():
            raise ValueError(f"ExpertParallel on {describe_module(module)}: every parameter needs the same number "
                             f"of experts along dim 0, divisible by the {mesh.size()} ranks of {mesh}; got {sizes}")

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _shard_parameter(module, name, mesh, Shard(0), self.src_data_rank)
        install_dispatch(module, mesh, ep_axis=0)
        return module


def install_dispatch(module: nn.Module, mesh: DeviceMesh, ep_axis: int, tp_axis: int | None = None) -> None:
    """The hooks around ``module``: dispatch its rows over ``ep_axis`` of ``mesh`` before it,
    combine them after; with ``tp_axis``, the experts' partial results are summed over it."""
    state: dict[str, InFlight] = {}

    def before(mod: nn.Module, inputs: tuple) -> tuple:
        rows, counts, *rest = inputs
        (rows, counts), state["call"] = dispatch_rows(rows, counts, mesh, ep_axis)
        rows = copy_to_axis(rows, mesh, tp_axis) if tp_axis is not None else rows
        return (rows, counts, *rest)

    def after(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        out = sum_over_axis(out, mesh, tp_axis) if tp_axis is not None else out
        return combine_rows(out, state.pop("call"), mesh, ep_axis)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def dispatch_rows(rows: torch.Tensor, counts: torch.Tensor, mesh: DeviceMesh, axis: int) -> tuple[tuple, InFlight]:
    """(rows of this rank's experts sorted by expert, their counts on the host), and the plan."""
    peers, experts = mesh.size(axis), len(counts)
    counts = counts.to(torch.int64)
    per_peer = [experts // peers] * peers
    recv = comm.all_to_all_counts(counts, per_peer, per_peer, mesh, axis)  # [experts]: peer s's counts for mine
    if counts.is_meta:  # a simulated step: no values to read, routing assumed (dispatch.simulated_exchange)
        send_counts, recv_counts = simulated_exchange(rows.shape[0], experts, peers, mesh.get_local_rank(axis))
    else:
        both = torch.cat([counts, recv]).tolist()  # the one host synchronization: [2 * experts]
        send_counts, recv_counts = both[:experts], both[experts:]
        note_exchange(send_counts, recv_counts)
    plan = plan_dispatch(send_counts, recv_counts, peers)
    received = all_to_all_rows(rows, plan.send_splits, plan.recv_splits, mesh, axis)  # [sum(recv_splits), dim]
    regroup = plan.regroup.to(rows.device, non_blocking=True)
    local_counts = torch.tensor(plan.expert_rows, dtype=torch.int64)  # on the host: the experts read no device
    return (received[regroup], local_counts), InFlight(plan, regroup)


def combine_rows(out: torch.Tensor, call: InFlight, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """The experts' output rows back in the by-sender order, then back to their senders."""
    by_sender = torch.empty_like(out).index_copy(0, call.regroup, out)  # [sum(recv_splits), dim]
    return all_to_all_rows(by_sender, call.plan.recv_splits, call.plan.send_splits, mesh, axis)  # [sum(send), dim]
