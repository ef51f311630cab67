"""Experts split over tp: ``TensorParallel`` (each expert's SwiGLU column/row sharded over a
tp axis) and ``ExpertTensorParallel`` (experts over ep, each expert over tp).

The experts' input rows are whole on every tp rank (the MoE layer routes the whole residual
stream on each tp rank): ``w1`` and ``w3`` [experts, hidden, dim] are sharded along hidden
(``Shard(1)``), ``w2`` [experts, dim, hidden] too (``Shard(2)``), so each tp rank computes
its slice of every expert's hidden units and a partial sum of its output, summed over tp by
one all_reduce (Megatron's pairing, per expert). In backward the rows' gradient is summed
over tp the same way. docs/parallelism.md, "Mixture of experts and expert parallelism".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Shard
from shardwise.parallel.expert_parallel.all_to_all import copy_to_axis, sum_over_axis
from shardwise.parallel.expert_parallel.style import install_dispatch
from shardwise.parallel.tensor_parallel.style import ParallelStyle, _check_plain, describe_module
from shardwise.tensor.dtensor import DTensor
from shardwise.tensor.factories import distribute_tensor

__all__ = ["TensorParallel", "ExpertTensorParallel"]


class _ExpertsOverTP(ParallelStyle):
    """What both styles share: which parameters are column- and row-sharded over hidden."""

    def __init__(self, *, colwise: Sequence[str] = ("w1", "w3"), rowwise: Sequence[str] = ("w2",)) -> None:
        self.colwise, self.rowwise = tuple(colwise), tuple(rowwise)

    def _hidden_placement(self, name: str) -> Placement:
        return Shard(1) if name in self.colwise else Shard(2)

    def _check_params(self, module: nn.Module) -> None:
        style = type(self).__name__
        for name in (*self.colwise, *self.rowwise):
            param = getattr(module, name, None)
            if not isinstance(param, torch.Tensor) or param.dim() != 3:
                raise ValueError(f"{style} on {describe_module(module)}: needs a 3-D parameter {name!r} "
                                 f"[experts, ...], got {None if param is None else tuple(param.shape)}")
            _check_plain(module, style, name)

    def _distribute(self, module: nn.Module, mesh: DeviceMesh, experts_placement: tuple[Placement, ...]) -> None:
        for name in (*self.colwise, *self.rowwise):
            param = getattr(module, name)
            placements = [*experts_placement, self._hidden_placement(name)]
            dt: DTensor = distribute_tensor(param.data, mesh, placements, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class TensorParallel(_ExpertsOverTP):
    """Every expert's SwiGLU split over the 1-D tp mesh; the rows whole on every tp rank.

    Example:
        >>> parallelize_module(block, world_mesh["tp"], {"moe.experts": TensorParallel()})
    """

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().check(module, mesh)
        self._check_params(module)

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self._distribute(module, mesh, ())

        def before(mod: nn.Module, inputs: tuple) -> tuple:
            rows, *rest = inputs
            return (copy_to_axis(rows, mesh, 0), *rest)

        def after(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            return sum_over_axis(out, mesh, 0)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        return module


class ExpertTensorParallel(_ExpertsOverTP):
    """Experts over the first axis of a 2-D (ep, tp) mesh (``ExpertParallel``'s dispatch and
    combine), each expert split over the second (``TensorParallel``): parameters
    ``[Shard(0), Shard(hidden)]``. Host synchronizations: one per call, as ``ExpertParallel``.

    Example:
        >>> parallelize_module(block, world_mesh["ep", "tp"], {"moe.experts": ExpertTensorParallel()})
    """

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if mesh.ndim != 2:
            raise ValueError(f"ExpertTensorParallel needs a 2-D (ep, tp) mesh, got {mesh}")
        self._check_params(module)
        experts = {getattr(module, n).shape[0] for n in (*self.colwise, *self.rowwise)}
        if len(experts) != 1 or next(iter(experts)) % mesh.size(0):
            raise ValueError(f"ExpertTensorParallel on {describe_module(module)}: the parameters need one number "
                             f"of experts divisible by ep={mesh.size(0)}, got {sorted(experts)}")

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self._distribute(module, mesh, (Shard(0),))
        install_dispatch(module, mesh, ep_axis=0, tp_axis=1)
        return module
