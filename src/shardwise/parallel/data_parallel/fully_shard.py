"""fully_shard: shard a module's parameters over a data-parallel mesh (FSDP2 semantics).

Applied to each block and then to the root (``for b in model.layers: fully_shard(b)`` then
``fully_shard(model)``), every call makes one group of the parameters not already in a
submodule's group. Between forward passes a group holds only its shards, as DTensor
parameters the optimizer steps on; forward and backward gather the group with one all_gather,
backward reduces its gradients with one reduce_scatter (plus one all_reduce across HSDP
replicas).
"""

from __future__ import annotations

from torch import nn

from shardwise.tensor.factories import world_mesh
from shardwise.parallel.data_parallel.dp_mesh import DataParallelMesh
from shardwise.parallel.data_parallel.group import ParamGroup
from shardwise.parallel.data_parallel.param import FSDPParam
from shardwise.parallel.data_parallel.policy import MixedPrecisionPolicy
from shardwise.parallel.data_parallel.state import STATE_ATTR, FSDPState, state_of
from shardwise.parallel.data_parallel.validate import compute_dtype, group_params
from shardwise.core.mesh import DeviceMesh
from shardwise.core.torch_errors import ValueAssertionError

__all__ = ["fully_shard", "FSDPModule"]


class FSDPModule:
    """Mixed into the class of every fully_shard'ed module (``isinstance(m, FSDPModule)``)."""

    def unshard(self) -> None:
        """Gather this module's parameters now (the next forward then skips its all_gather)."""
        state_of(self).group.unshard()

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        state_of(self).group.reshard()

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start the all_gather of ``modules`` as soon as this module's parameters are gathered
        in forward, so it runs while this module computes. Default: the module that ran next
        in the previous forward (none in the first); ``[]`` turns prefetching off here."""
        state_of(self).forward_prefetch = _states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start the all_gather of ``modules`` as soon as this module's backward begins.
        Default: the module whose backward comes next (the reverse of the previous forward);
        ``[]`` turns prefetching off here."""
        state_of(self).backward_prefetch = _states(modules, "set_modules_to_backward_prefetch")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction on or off for this module (and, with ``recurse``, every
        fully_shard'ed module below it).

        Off: backward reduces nothing; each rank keeps adding its unsharded gradients locally
        (in the reduce dtype) and ``param.grad`` is left as it was. The next backward with sync
        on reduces the accumulated sum with one reduce_scatter per group (plus one all_reduce
        across HSDP replicas), so gradient accumulation over microbatches costs one reduction.
        Costs the memory of the unsharded gradients meanwhile.
        """
        self._set_on_states("requires_gradient_sync", requires_gradient_sync, recurse)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` (default: the data-parallel ranks).

        For parameters whose local gradient already sums other ranks' contributions: expert
        weights under expert parallelism take the number of all data-parallel ranks (docs/parallelism.md,
        "Mixture of experts and expert parallelism"), as torch's FSDP2 method of the same name.
        """
        state_of(self).group.set_divide_factor(factor)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the gathered parameters (default True), for this module and,
        with ``recurse``, every fully_shard'ed module below it.

        Off: they stay gathered after backward, so that the next forward and backward of the
        same modules (the next microbatch of a pipeline stage, of gradient accumulation) gather
        nothing; costs their unsharded memory meanwhile. A later backward with it on frees
        them, or ``reshard()``. A forward with ``reshard_after_forward`` still frees them after it.
        """
        self._set_on_states("reshard_after_backward", reshard_after_backward, recurse)

    def _set_on_states(self, flag: str, value: bool, recurse: bool) -> None:
        """Set the boolean ``flag`` on this module's fully_shard state (and, with ``recurse``,
        on every fully_shard'ed module's below it)."""
        if not isinstance(value, bool):
            raise TypeError(f"set_{flag} needs a bool, got {value!r}")
        for module in self.modules() if recurse else [self]:
            state = state_of(module)
            if state is not None:
                setattr(state, flag, value)

    def _apply(self, fn, recurse: bool = True):
        """``to_empty`` / ``.to`` / ``.cuda``: move the shards, then rebuild the gathered storage on their device.

        A model built on the meta device and fully_shard'ed holds meta shards; after
        ``to_empty(device=...)`` every rank owns real storage of its shards only, in the same
        layout, ready for ``init_weights()``.
        """
        module = super()._apply(fn, recurse)
        state_of(self).follow_parameters()
        return module


def _states(modules: list, where: str) -> list[FSDPState]:
    """The fully_shard states of ``modules``; a module that is not fully_shard'ed is named."""
    states = []
    for module in modules:
        state = state_of(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise TypeError(f"{where}: {type(module).__name__} is not a fully_shard'ed module")
        states.append(state)
    return states


_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> nn.Module:
    """Shard ``module``'s parameters (those not in a fully_shard'ed submodule) over ``mesh``.

    Every parameter becomes an ``nn.Parameter`` holding a DTensor with ``Shard(0)`` on the
    data-parallel axis (``[Replicate(), Shard(0)]`` on a 2-D HSDP mesh). Uneven dim-0 sizes
    follow ``torch.chunk``: trailing ranks may hold fewer rows or none. The shards are cut
    locally from the parameter every rank holds, so every rank must start from the same values
    (seed before building the model), as with torch's ``fully_shard``. A module built on the
    meta device stays meta (shards are meta tensors, nothing is allocated or sent); then
    ``module.to_empty(device=...)`` gives each rank storage for its shards only, in the same
    layout, and ``init_weights()`` / ``reset_parameters()`` fill them (forward before that
    raises, naming the parameter).

    A parameter that is already a DTensor on another sub-mesh of the same root (tensor
    parallel, e.g. ``mesh2d["tp"]``) keeps its layout: it becomes a DTensor on the combined
    mesh ``root[<its axes>, <dp axes>]`` (its own axes first: TP cut the global tensor, FSDP cuts
    dim 0 of the TP block) with placements ``[<its placements>, Shard(0)]``; the layout is exact,
    so ``full_tensor()`` and checkpoints see the global tensor. Forward sees it gathered as a
    DTensor on its own mesh, so TP code keeps working.

    Args:
        module: the module (changed in place and returned, its class gains ``FSDPModule``).
        mesh: 1-D data-parallel mesh, or 2-D (replicate, shard) for HSDP; default: the world.
        reshard_after_forward: free the gathered parameters after forward and gather them
            again for backward (False keeps them until the gradients are reduced). None (the
            default): True, except for the root (the outermost module run), whose backward
            starts right after its forward, so gathering it again would be wasted.
        mp_policy: dtypes for compute, gradient reduction and outputs.

    Returns:
        ``module``.

    Raises:
        ValueError / TypeError, on every rank before any collective: fully_shard applied twice,
        a mesh that is not 1-D or 2-D, parameters on different meshes or already sharded by an
        enclosing fully_shard, 0-dim parameters, mixed dtypes without ``param_dtype``.

    Example:
        >>> for block in model.layers:
        ...     fully_shard(block, mesh=mesh)
        >>> fully_shard(model, mesh=mesh)
        >>> model(x).sum().backward(); optimizer.step()
    """
    label = type(module).__name__
    where = f"fully_shard({label})"
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard needs an nn.Module, got {label}")
    _refuse_unfit(module)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(f"{where}: reshard_after_forward must be a bool or None, got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    dp = DataParallelMesh.of(mesh if mesh is not None else world_mesh(), where)
    entries = group_params(module, dp, where)
    dtype = compute_dtype(entries, mp_policy, where)
    params = [FSDPParam(entry, dp, dtype) for entry in entries]
    group = ParamGroup(params, dp, dtype, mp_policy.reduce_dtype or dtype)
    group.use_sharded()
    state = FSDPState(module, label, group, reshard_after_forward, mp_policy)
    module.__dict__[STATE_ATTR] = state
    state.install()
    module.__class__ = _fsdp_class(type(module))
    return module


def _refuse_unfit(module: nn.Module) -> None:
    """torch's refusals, with its exception types and wording first: a module sharded twice, a
    container that has no forward of its own (its hooks would never run)."""
    if state_of(module) is not None:
        raise ValueAssertionError(
            "Each distinct composable distributed API can only be applied to a module once. fully_shard has "
            f"already been applied to the following module:\n{module}\n(shardwise: fully_shard was already "
            f"applied to {state_of(module).label}; apply it once per module)")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {module}\n(shardwise: apply "
            f"it to each module the {type(module).__name__} holds, or to the module whose forward runs them)")


def _fsdp_class(cls: type) -> type:
    """``cls`` with FSDPModule mixed in (one class per original class)."""
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _FSDP_CLASSES[cls]


# ``fully_shard.state(module)``, as torch's composable APIs offer: the module's FSDPState, or None
# where fully_shard was not applied. Set as an attribute, so fully_shard stays a plain function.
setattr(fully_shard, "state", state_of)
