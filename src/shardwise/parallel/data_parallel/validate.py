"""Checks fully_shard runs before touching anything: one clear error, the same on every rank.

Everything checked is local metadata (module structure, parameter layouts, dtypes), so every
rank of an SPMD program raises the same error before any collective is issued.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.tensor.dtensor import DTensor
from shardwise.parallel.data_parallel.dp_mesh import DataParallelMesh
from shardwise.parallel.data_parallel.owners import ParamOwners, find_owners
from shardwise.parallel.data_parallel.param import MANAGED_ATTR
from shardwise.parallel.data_parallel.policy import MixedPrecisionPolicy
from shardwise.parallel.data_parallel.state import state_of

__all__ = ["group_params", "compute_dtype"]


def group_params(module: nn.Module, dp: DataParallelMesh, where: str) -> list[ParamOwners]:
    """The parameters a new group on ``module`` takes: those not in a group of a submodule.

    Raises ValueError naming the module and parameter when a parameter is already sharded by
    an enclosing fully_shard, is 0-dim, or is a DTensor whose layout cannot gain ``dp``'s
    placements (different meshes within the group, unrelated meshes, Partial placements).
    """
    children = [s for m in module.modules() if m is not module and (s := state_of(m)) is not None]
    taken = {id(p.sharded) for s in children for p in s.group.params}
    entries = find_owners(module, taken)
    inner_mesh, first = None, None
    for entry in entries:
        param = entry.param
        _check_not_managed(param, entry.fqn, where)
        if param.dim() == 0:
            raise ValueError(f"{where}: parameter {entry.fqn!r} is 0-dim; fully_shard shards dim 0, give it shape [1]")
        if not isinstance(param, DTensor):
            continue
        problem = dp.composition_problem(param._spec)
        if problem:
            raise ValueError(f"{where}: parameter {entry.fqn!r} {problem}")
        if inner_mesh is None:
            inner_mesh, first = param.device_mesh, entry.fqn
        elif param.device_mesh != inner_mesh:
            raise ValueError(
                f"{where}: parameters are on different meshes: {first!r} on {inner_mesh.describe()}, "
                f"{entry.fqn!r} on {param.device_mesh.describe()}; one fully_shard group needs one mesh"
            )
    return entries


def _check_not_managed(param: nn.Parameter, fqn: str, where: str) -> None:
    if getattr(param, MANAGED_ATTR, False):
        raise ValueError(
            f"{where}: parameter {fqn!r} is already sharded by fully_shard on an enclosing module "
            "or managed by replicate; apply fully_shard to submodules before their parents, once each"
        )


def compute_dtype(entries: list[ParamOwners], policy: MixedPrecisionPolicy, where: str) -> torch.dtype:
    """The dtype gathered parameters take: the policy's, or the one dtype all parameters share."""
    if policy.param_dtype is not None:
        return policy.param_dtype
    dtypes: dict[torch.dtype, str] = {}
    for entry in entries:
        dtypes.setdefault(entry.param.dtype, entry.fqn)
    if len(dtypes) > 1:
        found = ", ".join(f"{fqn!r} is {dtype}" for dtype, fqn in dtypes.items())
        raise ValueError(
            f"{where}: parameters of one group must share a dtype to travel in one buffer ({found}); "
            "cast them, or set MixedPrecisionPolicy(param_dtype=...)"
        )
    return next(iter(dtypes), torch.get_default_dtype())
