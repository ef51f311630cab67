"""``torch.distributed.tensor.placement_types``'s names (placements live in ``shardwise.placement``)."""

from shardwise.mesh import DeviceMesh
from shardwise.placement import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial", "DeviceMesh"]
