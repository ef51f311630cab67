"""distribute_module: turn a module's parameters into DTensors and hook its inputs/outputs.

The module-level entry point of seed 4.3: model code stays single-device; where its tensors
live is decided from outside by ``partition_fn`` (parameters), ``input_fn`` (a forward
pre-hook) and ``output_fn`` (a forward hook). DDP, for example, is "replicate every
parameter, shard the batch of the input" (seed 6.1).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

from torch import nn

from shardwise.tensor.factories import default_mesh, distribute_tensor
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Replicate

__all__ = ["distribute_module"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]
InputFn = Callable[..., Any]
OutputFn = Callable[..., Any]


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: PartitionFn | None = None,
    input_fn: InputFn | None = None,
    output_fn: OutputFn | None = None,
) -> nn.Module:
    """Distribute ``module``'s parameters and buffers over ``device_mesh`` and install hooks.

    Args:
        module: any nn.Module (changed in place and returned).
        device_mesh: the mesh (default: a 1-D mesh over the world).
        partition_fn: ``fn(name, submodule, mesh)`` called on every submodule to replace its
            parameters with DTensor parameters; whatever it leaves as plain tensors is
            replicated afterwards.
        input_fn: ``fn(module, inputs, mesh) -> inputs`` run before each forward.
        output_fn: ``fn(module, outputs, mesh) -> outputs`` run after each forward.

    Returns:
        The same module.

    Example:
        >>> def shard_batch(mod, inputs, mesh):
        ...     return (DTensor.from_local(inputs[0], mesh, [Shard(0)]),)
        >>> distribute_module(model, mesh, input_fn=shard_batch)  # DDP: params replicated
    """
    if getattr(module, "_shardwise_distributed", False):
        raise RuntimeError(f"distribute_module was already applied to {type(module).__name__}")
    mesh = device_mesh or default_mesh()
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, mesh)
        _replicate_the_rest(submodule, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(_hook(input_fn, mesh, "input_fn"))
    if output_fn is not None:
        module.register_forward_hook(_hook(output_fn, mesh, "output_fn"))
    module._shardwise_distributed = True
    return module


def _replicate_the_rest(submodule: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters and buffers that are still plain tensors become replicated DTensors."""
    replicate = [Replicate()] * mesh.ndim
    for name, param in list(submodule.named_parameters(recurse=False)):
        if param is not None and not isinstance(param, DTensor):
            dt = distribute_tensor(param.data, mesh, replicate)  # rank 0's values everywhere
            submodule.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
    for name, buffer in list(submodule.named_buffers(recurse=False)):
        if buffer is not None and not isinstance(buffer, DTensor):
            submodule._buffers[name] = distribute_tensor(buffer, mesh, replicate)


def _hook(fn: Callable, mesh: DeviceMesh, what: str) -> Callable:
    """Adapt a user ``fn(module, value, mesh)`` (or the older ``fn(value, mesh)``) to a hook."""
    arity = len(inspect.signature(fn).parameters)
    if arity not in (2, 3):
        raise TypeError(f"{what} must take (module, value, mesh) or (value, mesh), got {arity} parameters")
    if arity == 2:  # torch's wording, so filters written for torch's warning match
        warnings.warn(f"Deprecating {what} that takes two arguments (inputs, device_mesh), please use {what} that "
                      "takes in (module, inputs, device_mesh) instead!", FutureWarning, stacklevel=3)
    if what == "input_fn":
        return (lambda mod, inputs: fn(mod, inputs, mesh)) if arity == 3 else (lambda mod, inputs: fn(inputs, mesh))
    return (lambda mod, inputs, out: fn(mod, out, mesh)) if arity == 3 else (lambda mod, inputs, out: fn(out, mesh))
