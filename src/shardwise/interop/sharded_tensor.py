"""torch's legacy ShardedTensor both ways, for the layouts it can express: Shard only.

A ShardedTensor is a list of boxes, one per rank of a process group, each held whole by its
rank: a DTensor whose every mesh axis is Shard (nested, even or not) is exactly that. A
Replicate axis (the same box on several ranks) or a Partial one (a pending reduction) has no
ShardedTensor form and is refused, naming the axis. Both directions reuse the local block
(same storage) and communicate nothing: every rank computes every rank's box from the layout.
torch marks ShardedTensor deprecated; it still builds and gathers on gloo/CPU in 2.13.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh, init_device_mesh
from shardwise.core.placement import Placement, Shard, as_placements
from shardwise.redistribute.function import FromLocal
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride, local_shape_and_offset

__all__ = ["to_sharded_tensor", "from_sharded_tensor"]


def to_sharded_tensor(dtensor: DTensor) -> ShardedTensor:
    """The DTensor as a ShardedTensor over the default group (zero-copy, no communication).

    Raises:
        ValueError: a Replicate or Partial axis, or a mesh that does not span the world.
    """
    spec = dtensor._spec
    mesh = spec.mesh
    _require_shard_only(spec.placements, mesh, "to_sharded_tensor")
    _require_world(mesh, "to_sharded_tensor")
    boxes = _boxes(tuple(dtensor.shape), mesh, spec.placements)
    device = dtensor._local_tensor.device
    shards = [ShardMetadata(list(off), list(size), f"rank:{rank}/{device}") for rank, (size, off) in sorted(boxes.items())]
    props = TensorProperties(dtensor.dtype, torch.strided, dtensor.requires_grad, torch.contiguous_format, False)
    meta = ShardedTensorMetadata(shards, torch.Size(dtensor.shape), props)
    local = dtensor._local_tensor
    if not local.is_contiguous():
        raise ValueError(f"to_sharded_tensor: this rank's block has strides {local.stride()}; ShardedTensor "
                         f"holds contiguous shards only (call .contiguous() on the DTensor first)")
    mine = shards[dist.get_rank()]
    return ShardedTensor._init_from_local_shards_and_global_metadata([LocalShard(local, mine)], meta)


def from_sharded_tensor(
    st: ShardedTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """The ShardedTensor as a shardwise DTensor (zero-copy, no communication).

    Args:
        st: one box per rank of the default group.
        device_mesh, placements: the Shard-only layout the boxes form; default: a 1-D mesh over
            the world with Shard(dim) of the tensor's ``ChunkShardingSpec``.

    Raises:
        ValueError: a rank holds several shards or none, or the boxes are not the layout's
            (naming the rank and both boxes).
    """
    if device_mesh is None or placements is None:
        device_mesh, placements = _layout_of(st)
    placements = as_placements(placements, "from_sharded_tensor: placements")
    _require_shard_only(placements, device_mesh, "from_sharded_tensor")
    _require_world(device_mesh, "from_sharded_tensor")
    shape = tuple(st.size())
    spec = DTensorSpec(device_mesh, placements, TensorMeta(torch.Size(shape), contiguous_stride(shape), st.dtype))
    boxes = _boxes(shape, device_mesh, spec.placements)
    for shard in st.metadata().shards_metadata:
        rank = shard.placement.rank()
        want = boxes.get(rank)
        got = (tuple(shard.shard_sizes), tuple(shard.shard_offsets))
        if want != got:
            raise ValueError(f"from_sharded_tensor: rank {rank} holds the box sizes {list(got[0])} at offsets "
                             f"{list(got[1])}, but {list(spec.placements)} on {device_mesh} puts sizes "
                             f"{list(want[0]) if want else None} at {list(want[1]) if want else None} there")
    local_shards = st.local_shards()
    if len(local_shards) != 1:
        raise ValueError(f"from_sharded_tensor: rank {dist.get_rank()} holds {len(local_shards)} shards; a "
                         f"DTensor holds exactly one block per rank")
    return FromLocal.apply(local_shards[0].tensor, spec, None)


def _layout_of(st: ShardedTensor) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The 1-D layout of a ChunkShardingSpec ShardedTensor whose ranks come in order."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = st.sharding_spec()
    world = dist.get_world_size()
    ranks = [p.rank() for p in getattr(spec, "placements", [])]
    if not isinstance(spec, ChunkShardingSpec) or ranks != list(range(world)) or not isinstance(spec.dim, int):
        raise ValueError(f"from_sharded_tensor: cannot infer a layout from sharding spec {spec}; pass "
                         f"device_mesh and placements (Shard only)")
    return init_device_mesh(st.local_shards()[0].tensor.device.type if st.local_shards() else "cpu", (world,)), (Shard(spec.dim),)


def _require_shard_only(placements: Sequence[Placement], mesh: DeviceMesh, what: str) -> None:
    for axis, p in enumerate(placements):
        if not isinstance(p, Shard):
            raise ValueError(f"{what}: mesh axis {axis} ({mesh.axis_name(axis)!r}) is {p!r}; a ShardedTensor "
                             f"holds each box on one rank, so only Shard placements convert "
                             f"(redistribute {list(placements)} to Shard first)")


def _require_world(mesh: DeviceMesh, what: str) -> None:
    if sorted(mesh.mesh.flatten().tolist()) != list(range(dist.get_world_size())):
        raise ValueError(f"{what}: {mesh.describe()} does not span the world of {dist.get_world_size()} ranks; "
                         f"a ShardedTensor lives on the default group")


def _boxes(shape: tuple[int, ...], mesh: DeviceMesh, placements: Sequence[Placement]) -> dict[int, tuple]:
    """Every rank's (sizes, offsets) box of the layout."""
    boxes = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        rank = int(mesh.mesh[coord])
        boxes[rank] = local_shape_and_offset(shape, mesh.shape, coord, placements)
    return boxes
