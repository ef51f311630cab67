"""Creating DTensors: distribute a whole tensor, or allocate one block per rank (factories)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from shardwise import comm
from shardwise.tensor import random as sw_random
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh, check_mesh, default_mesh, world_mesh
from shardwise.core.placement import Partial, Placement, Replicate, Shard, as_placements
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["distribute_tensor", "default_mesh", "world_mesh", "zeros", "ones", "empty", "full", "rand", "randn"]

def _layout(
    mesh: DeviceMesh | None, placements: Sequence[Placement] | None, device_type: str, what: str
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh (default: the world) and validated placements (default: all Replicate)."""
    if placements is not None:
        placements = as_placements(placements, f"{what}: placements")
    if mesh is None:
        mesh = default_mesh(device_type)
    else:
        check_mesh(mesh, what)
    return mesh, placements if placements is not None else (Replicate(),) * mesh.ndim


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay a whole tensor out over a mesh; each rank keeps only its block.

    Args:
        tensor: the global tensor. Every rank passes a tensor of the same shape and dtype; only
            the source's values are used.
        device_mesh: the mesh (default: a 1-D mesh over the world).
        placements: one per mesh axis (default: all Replicate).
        src_data_rank: index, along every mesh axis, of the rank whose data is used; it reaches
            the others by scatter (Shard axes) and broadcast (Replicate/Partial axes), axis by
            axis. None: every rank already holds the data, nothing is sent.

    A meta ``tensor`` gives a meta DTensor: each rank's block is a meta tensor of its block's
    shape, nothing is allocated or sent (``module.to_empty`` later gives the blocks storage).

    Returns:
        A leaf DTensor with ``requires_grad`` of ``tensor``.

    Example:
        >>> dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])  # rank 1 of 4 holds [2., 3.]
    """
    if isinstance(tensor, DTensor):
        raise ValueError(
            f"distribute_tensor got a DTensor ({tensor._spec.render()} on {tensor.device_mesh}); "
            "use .redistribute() to change its layout"
        )
    mesh, placements = _layout(device_mesh, placements, tensor.device.type, "distribute_tensor")
    if not tensor.is_meta and tensor.device.type != mesh.device_type:
        tensor = tensor.to(mesh.device_type)
    spec = DTensorSpec(mesh, placements, TensorMeta.of(tensor))
    with torch.no_grad():
        local = _local_block(tensor.detach(), spec, src_data_rank)
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


def _local_block(tensor: torch.Tensor, spec: DTensorSpec, src: int | None) -> torch.Tensor:
    """This rank's block, sent axis by axis from the source (or cut locally when src is None)."""
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return tensor.new_empty((0,) * tensor.ndim)
    if src is not None and not 0 <= src < min(mesh.shape):
        raise ValueError(f"src_data_rank {src} is outside {mesh} (axis sizes {mesh.shape})")
    local = tensor
    for axis, placement in enumerate(spec.placements):
        # Ranks whose later coordinates equal the source's hold the data once this axis is done.
        # A meta tensor has no data to send: every rank cuts its (meta) block, nothing is allocated.
        active = src is not None and not tensor.is_meta and all(c == src for c in coordinate[axis + 1 :])
        local = _place_axis(local, mesh, axis, placement, active, src)
    for axis, placement in enumerate(spec.placements):
        if isinstance(placement, Partial):
            local = placement.partition_value(local, coordinate[axis])
    return local.contiguous() if local.data_ptr() != tensor.data_ptr() else local.clone()


def _place_axis(
    block: torch.Tensor, mesh: DeviceMesh, axis: int, placement: Placement, active: bool, src: int | None
) -> torch.Tensor:
    me, n = mesh.get_local_rank(axis), mesh.size(axis)
    if isinstance(placement, Shard):
        lengths = [Shard.chunk(block.shape[placement.dim], n, k)[0] for k in range(n)]
        if active and n > 1:
            return comm.scatter(block, mesh, axis, placement.dim, lengths, src)
        return block.narrow(placement.dim, sum(lengths[:me]), lengths[me])
    if active and n > 1:
        return comm.broadcast(block, mesh, axis, src)
    return block


# ---------------------------------------------------------------------- factories
# A fill takes (global shape, local shape, local offset, tensor options) -> this rank's block.
Fill = Callable[[tuple, tuple, tuple, dict], torch.Tensor]


def _make(
    what: str,
    size: tuple,
    fill: Fill,
    *,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    device: torch.device | str | None = None,
) -> DTensor:
    """A DTensor of global ``size`` whose blocks come from ``fill``; Partial axes hold contributions."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = torch.Size(size)
    mesh, layout = _layout(device_mesh, placements, "cpu", what)
    dtype = dtype or torch.get_default_dtype()
    spec = DTensorSpec(mesh, layout, TensorMeta(shape, contiguous_stride(shape), dtype))
    local_shape, offset = spec.local_shape_and_offset()
    options = {"dtype": dtype, "device": _block_device(mesh, device, what)}
    if options["device"].type == "meta":  # shapes only: no values, no random counters consumed
        local = torch.empty(local_shape, **options)
    else:
        local = fill(tuple(shape), local_shape, offset, options)
    coordinate = mesh.get_coordinate()
    for axis, placement in enumerate(layout):
        if isinstance(placement, Partial) and coordinate is not None:
            local = placement.partition_value(local, coordinate[axis])
    return DTensor(local, spec, requires_grad=requires_grad)


def _block_device(mesh: DeviceMesh, device: torch.device | str | None, what: str) -> torch.device:
    """Where the blocks live: the mesh's device, or "meta" (shapes only, nothing allocated)."""
    if device is None:
        return _device(mesh)
    device = torch.device(device)
    if device.type == "meta":
        return device
    if device.type != mesh.device_type:
        raise ValueError(f"{what}: device={str(device)!r} is not covered by {mesh} (its ranks hold "
                         f"{mesh.device_type} tensors); pass device='meta' or leave device unset")
    return _device(mesh) if device.index is None else device


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _random_block(kind: str) -> Fill:
    """Fill with counter-based random values (shardwise.tensor.random): the same for every layout.

    Each value is a hash of the seed, the stream offset and the element's GLOBAL index, so a
    rank computes only its block (O(local numel), no communication) and the values do not
    depend on the mesh or placements. Every rank, also one holding an empty block, advances
    the stream by the global element count.
    """
    def fill(shape, local_shape, offset, options):
        return sw_random.draw(kind, shape, offset, local_shape, **options)

    return fill


def zeros(*size, **layout) -> DTensor:
    """A DTensor of global ``size`` filled with 0; each rank allocates only its block.

    Keywords: ``device_mesh``, ``placements`` (default: world mesh, Replicate), ``dtype``,
    ``requires_grad``, ``device`` (default: the mesh's; ``"meta"`` gives meta blocks of the
    right shapes, allocating nothing, for a model initialized after ``to_empty``).

    Example:
        >>> zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """
    return _make("zeros", size, lambda shape, local, offset, options: torch.zeros(local, **options), **layout)


def ones(*size, **layout) -> DTensor:
    """A DTensor of global ``size`` filled with 1 (keywords as ``zeros``)."""
    return _make("ones", size, lambda shape, local, offset, options: torch.ones(local, **options), **layout)


def empty(*size, **layout) -> DTensor:
    """A DTensor of global ``size`` with uninitialized values (keywords as ``zeros``)."""
    return _make("empty", size, lambda shape, local, offset, options: torch.empty(local, **options), **layout)


def full(size, fill_value, **layout) -> DTensor:
    """A DTensor of global ``size`` filled with ``fill_value`` (keywords as ``zeros``)."""
    return _make("full", tuple(size), lambda shape, local, offset, options: torch.full(local, fill_value, **options), **layout)


def rand(*size, **layout) -> DTensor:
    """Uniform [0, 1) values, the same for every layout given the same seed (keywords as ``zeros``).

    Seed with ``torch.manual_seed`` or ``shardwise.tensor.random.manual_seed``, identically on every
    rank. The values are shardwise's own (see ``shardwise.tensor.random``), not ``torch.rand``'s.
    """
    return _make("rand", size, _random_block("uniform"), **layout)


def randn(*size, **layout) -> DTensor:
    """Standard normal values, the same for every layout given the same seed (keywords as ``rand``)."""
    return _make("randn", size, _random_block("normal"), **layout)
