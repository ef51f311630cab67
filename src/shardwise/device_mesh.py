"""``torch.distributed.device_mesh``'s names (the mesh itself lives in ``shardwise.mesh``)."""

from shardwise.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
