"""``torch.distributed.tensor.placement_types``'s names (placements live in ``shardwise.core.placement``)."""

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial", "DeviceMesh"]
