"""``torch.distributed.device_mesh``'s names (the mesh itself lives in ``shardwise.core.mesh``)."""

from shardwise.core.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
