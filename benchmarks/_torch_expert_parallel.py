"""torch's side of train_step.py's MoE modes: expert parallelism written with torch's public API.

torch ships no expert-parallel style, so the benchmark writes one the way torchtitan's is
built: the stacked expert weights ``distribute_tensor(..., Shard(0))`` over the ep mesh, the
tokens sent to the ranks owning their experts by ``all_to_all_single`` with per-peer split
sizes (autograd through torch's functional ``all_to_all_single_autograd``), and sent back the
same way. With tp, every expert is also split over tp (w1, w3 by rows, w2 by columns) and its
partial outputs summed over tp by DTensor redistributes, as the shardwise family's
``ExpertTensorParallel`` arranges them; the rest of the model is the family's own plan applied
through torch's ``parallelize_module`` and ``fully_shard`` (``shardwise.train.parallelize``).

Host synchronizations: one per MoE layer (reading the exchanged counts to size the split), as
torchtitan's. docs/benchmarks.md, "MoE modes".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from shardwise.train.models.moe.model import GroupedExperts, MoEBlock, moe_layers
from shardwise.train.parallelize import ParallelOptions
from shardwise.train.spec import ModelFamily

__all__ = ["TorchExpertParallel", "torch_moe_family", "sum_reduce_experts", "torch_update_expert_bias"]

# Each expert's hidden dim: rows of w1 and w3 [experts, hidden, dim], columns of w2 [experts, dim, hidden].
_HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


@dataclass
class _Routing:
    """One call's split sizes and the by-expert order of the rows it received."""

    send: list[int]  # rows to each ep peer
    recv: list[int]  # rows from each ep peer
    order: torch.Tensor  # received rows, by sender then expert -> by expert then sender


class TorchExpertParallel(ParallelStyle):
    """Stacked experts over the "ep" axis of ``mesh`` (and each over "tp" when the mesh has it);
    the module is called as ``experts(rows sorted by expert, counts [experts])``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = tuple(device_mesh.mesh_dim_names or ())
        if names not in (("ep",), ("ep", "tp")):
            raise NotImplementedError(f"the benchmark's torch expert parallelism runs on ('ep',) or ('ep', 'tp'), "
                                      f"got {names}")
        self.with_tp = names == ("ep", "tp")
        self.ep_group = device_mesh.get_group("ep")  # looked up once, not per call
        self.tp_mesh = device_mesh["tp"] if self.with_tp else None
        self.calls: list[_Routing] = []
        return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0), Shard(_HIDDEN_DIM[pname])] if self.with_tp else [Shard(0)]
            sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts = inputs  # [tokens * k, dim] sorted by expert, [experts]
        group, counts = self.ep_group, counts.to(torch.int64)
        peers, experts = mesh.size(0), counts.numel()
        local = experts // peers
        with torch.no_grad():  # peer s's rows for each of my experts: [peers * local]
            theirs = funcol.all_to_all_single(counts, None, None, group).wait()
            both = torch.cat([counts, theirs]).tolist()  # the host synchronization
        mine, theirs_list = both[:experts], both[experts:]
        send = [sum(mine[s * local:(s + 1) * local]) for s in range(peers)]
        recv = [sum(theirs_list[s * local:(s + 1) * local]) for s in range(peers)]
        received = funcol.all_to_all_single_autograd(rows, recv, send, group)  # [sum(recv), dim] by sender
        per_segment = torch.tensor(theirs_list)  # segment s * local + e: peer s's rows for my expert e
        expert_of_row = torch.arange(experts).remainder(local).repeat_interleave(per_segment)
        order = torch.argsort(expert_of_row, stable=True)
        self.calls.append(_Routing(send, recv, order))
        expert_rows = per_segment.view(peers, local).sum(0)  # [local] on the host
        if self.tp_mesh is not None:  # whole on every tp rank; the gradient is the sum of their parts
            received = _enter_tp(received, self.tp_mesh)
        return received[order], expert_rows

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.tp_mesh is not None:
            out = _sum_tp(out, self.tp_mesh)
        call = self.calls.pop()
        by_sender = torch.empty_like(out).index_copy(0, call.order, out)  # [sum(recv), dim]
        return funcol.all_to_all_single_autograd(by_sender, call.send, call.recv, self.ep_group)


def _enter_tp(rows: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """``rows`` unchanged; its gradient (each tp rank's part) is summed over tp."""
    whole = DTensor.from_local(rows, tp, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])


def _sum_tp(out: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """Every tp rank's partial ``out`` summed (an all_reduce)."""
    return DTensor.from_local(out, tp, [Partial()], run_check=False).redistribute(tp, [Replicate()]).to_local()


def _apply_ep(model: nn.Module, experts_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """The family's expert-parallel step with torch's API: every MoE block's routed experts."""
    for layer in model.layers.values():
        if isinstance(layer, MoEBlock):
            parallelize_module(layer, experts_mesh, {"moe.experts": TorchExpertParallel()})


def torch_moe_family(family: ModelFamily) -> ModelFamily:
    """``family`` (the MoE family) with its experts split by ``TorchExpertParallel``."""
    return replace(family, expert_parallel=_apply_ep)


def sum_reduce_experts(model: nn.Module) -> None:
    """Make the experts' FSDP units reduce with plain sums, then divide.

    Their gradients are divided by every data-parallel rank, not by their own FSDP group
    (``shardwise.train.parallelize.expert_fsdp``); torch's FSDP then reduces with a
    pre-multiplied sum, which gloo lacks. Forcing sum reductions makes it divide in a
    separate step instead (the same result). Only where that FSDP group has more than one rank:
    on one rank no collective runs, and torch 2.13 forced to sum divides by the factor twice
    there (a gradient 1/factor too small)."""
    for module in model.modules():
        if isinstance(module, GroupedExperts) and hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


def torch_update_expert_bias(model: nn.Module, dp_mesh: DeviceMesh | None) -> None:
    """The family's load-balancing update after each optimizer step, its counts summed over
    the data-parallel ranks by torch's all_reduce (one for all layers)."""
    layers = moe_layers(model)
    counts = torch.stack([layer.tokens_per_expert for layer in layers])  # [layers, experts]
    if dp_mesh is not None:
        dist.all_reduce(counts, group=dp_mesh.get_group())
    for layer, layer_counts in zip(layers, counts):
        layer.update_expert_bias(layer_counts)
