"""DTensor both ways between shardwise and ``torch.distributed.tensor``, without copying.

The converted tensor wraps the same local block (same storage, same ``data_ptr``) on the
converted mesh with the same placements and the same global shape and stride, so an in-place
update through either one is seen by the other. The conversion is differentiable: a gradient
of the converted tensor flows back to the original in the same layout (Partial gradients stay
Partial, neither side reinterprets them). ``module_to_torch`` / ``module_from_torch`` swap
every parameter and buffer of a model in place (new leaves over the same storage).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor

from shardwise.tensor.dtensor import DTensor
from shardwise.interop.mesh import mesh_from_torch, mesh_to_torch
from shardwise.interop.placements import placements_from_torch, placements_to_torch
from shardwise.redistribute.function import FromLocal
from shardwise.core.spec import DTensorSpec, TensorMeta

__all__ = ["to_torch", "from_torch", "module_to_torch", "module_from_torch"]


def to_torch(dtensor: DTensor) -> TorchDTensor:
    """The same distributed tensor as a ``torch.distributed.tensor.DTensor`` (zero-copy).

    Example:
        >>> x = shardwise.distribute_tensor(t, mesh, [Shard(0), Replicate()])
        >>> y = to_torch(x)    # y.to_local().data_ptr() == x.to_local().data_ptr()
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"to_torch expects a shardwise DTensor, got {type(dtensor).__name__}")
    spec = dtensor._spec
    mesh = mesh_to_torch(spec.mesh)
    placements = placements_to_torch(spec.placements)
    local = dtensor.to_local(grad_placements=spec.placements)
    return TorchDTensor.from_local(
        local, mesh, placements, run_check=False, shape=dtensor.shape, stride=dtensor.stride()
    )


def from_torch(torch_dtensor: TorchDTensor) -> DTensor:
    """The same distributed tensor as a shardwise DTensor (zero-copy; the inverse of to_torch).

    Raises:
        ValueError: a placement shardwise cannot express (torch's ``_StridedShard``,
            ``_MaskPartial``), naming it and its mesh axis; raised on every rank, before any
            communication.
    """
    if not isinstance(torch_dtensor, TorchDTensor):
        raise TypeError(f"from_torch expects a torch.distributed.tensor.DTensor, got {type(torch_dtensor).__name__}")
    placements = placements_from_torch(torch_dtensor.placements)
    mesh = mesh_from_torch(torch_dtensor.device_mesh)
    torch_placements = torch_dtensor.placements
    local = torch_dtensor.to_local(grad_placements=torch_placements)
    meta = TensorMeta(torch_dtensor.shape, tuple(torch_dtensor.stride()), torch_dtensor.dtype)
    # The spec is torch's, already agreed by every rank: nothing to confirm before communicating.
    return FromLocal.apply(local, DTensorSpec(mesh, placements, meta), placements)


def module_to_torch(module: nn.Module) -> nn.Module:
    """Swap every shardwise DTensor parameter and buffer of ``module`` for torch's, in place."""
    return _convert_module(module, DTensor, to_torch)


def module_from_torch(module: nn.Module) -> nn.Module:
    """Swap every torch DTensor parameter and buffer of ``module`` for shardwise's, in place.

    All parameters are checked before any is swapped, so an unconvertible placement leaves
    the module unchanged.
    """
    return _convert_module(module, TorchDTensor, from_torch)


def _convert_module(module: nn.Module, kind: type, convert) -> nn.Module:
    """Replace each ``kind`` parameter / buffer by ``convert`` of it; tied tensors stay tied."""
    _refuse_data_parallel_wrappers(module)
    found = [(owner, slot, name, value) for owner in module.modules()
             for slot in ("_parameters", "_buffers")
             for name, value in getattr(owner, slot).items() if isinstance(value, kind)]
    done: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, _, _, value in found:  # convert all first: a failure leaves the module as it was
            if id(value) not in done:
                done[id(value)] = convert(value.detach())
    for owner, slot, name, value in found:
        new = done[id(value)]
        if slot == "_parameters":
            key = ("param", id(value))
            if key not in done:
                done[key] = nn.Parameter(new, requires_grad=value.requires_grad)
            new = done[key]
        getattr(owner, slot)[name] = new
    return module


def _refuse_data_parallel_wrappers(module: nn.Module) -> None:
    """fully_shard / replicate keep their own parameter state and hooks, tied to one library's
    DTensor: swapping the parameters under them would break the next forward. Say so, naming
    the submodule, before anything changes."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from shardwise.parallel.data_parallel.fully_shard import FSDPModule
    from shardwise.parallel.data_parallel.replicate import STATE_ATTR

    for name, sub in module.named_modules():
        owner = ("torch's fully_shard" if isinstance(sub, TorchFSDPModule) else
                 "shardwise's fully_shard" if isinstance(sub, FSDPModule) else
                 "shardwise's replicate" if sub.__dict__.get(STATE_ATTR) is not None else None)
        if owner is not None:
            raise ValueError(
                f"module {name or type(sub).__name__!r} is managed by {owner}, which owns its parameters; "
                f"convert the model before applying it, or move its state through a checkpoint "
                f"(torch.distributed.checkpoint.save -> shardwise.checkpoint.load, or save(..., format='dcp'))"
            )
