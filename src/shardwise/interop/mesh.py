"""DeviceMesh both ways between shardwise and torch, over the same process groups.

A converted mesh has the same rank grid, the same axis names and the same device type, and it
communicates over the very process groups of the original (no group is created by a
conversion). Each conversion is cached in both directions, so converting a mesh again, or
converting back, returns the same object: torch and shardwise tensors on it compare their
meshes as equal, and repeated conversions cost a dict lookup.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

from shardwise.core.mesh import DeviceMesh, adopt_group, axis_slices

__all__ = ["mesh_to_torch", "mesh_from_torch"]

_TO_TORCH: dict[DeviceMesh, TorchMesh] = {}
_FROM_TORCH: dict[TorchMesh, DeviceMesh] = {}


def mesh_to_torch(mesh: DeviceMesh) -> TorchMesh:
    """torch's DeviceMesh over ``mesh``'s ranks, names and process groups (cached)."""
    cached = _TO_TORCH.get(mesh)
    if cached is not None:
        return cached
    mesh._require_member("to_torch")
    groups = mesh.get_all_groups()
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    converted = TorchMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh.clone(), mesh_dim_names=names)
    if mesh.mesh_dim_names is None:  # torch needs names to build from groups; the original has none
        converted._mesh_dim_names = None
    _TO_TORCH[mesh] = converted
    _FROM_TORCH.setdefault(converted, mesh)
    return converted


def mesh_from_torch(torch_mesh: TorchMesh) -> DeviceMesh:
    """shardwise's DeviceMesh over ``torch_mesh``'s ranks, names and process groups (cached).

    Every rank of the torch mesh must convert it (as every rank built it); nothing is
    communicated. A torch sub-mesh (``root["tp"]``) converts through its root, so the result
    slices and flattens like shardwise's own sub-meshes.
    """
    cached = _FROM_TORCH.get(torch_mesh)
    if cached is not None:
        return cached
    root = torch_mesh._get_root_mesh()
    names = torch_mesh.mesh_dim_names
    if root is not torch_mesh and names is not None and root.mesh_dim_names is not None \
            and all(n in root.mesh_dim_names for n in names):
        converted = mesh_from_torch(root)[names]
    else:
        converted = _standalone(torch_mesh)
    _FROM_TORCH[torch_mesh] = converted
    _TO_TORCH.setdefault(converted, torch_mesh)
    return converted


def _standalone(torch_mesh: TorchMesh) -> DeviceMesh:
    """A shardwise root mesh over the torch mesh's grid, its groups adopted before it is built.

    shardwise creates one group per slice of every axis, also the slices this rank is not in;
    each slice gets the torch mesh's group here (a placeholder where this rank is outside it:
    torch keeps no handle for those), so building the mesh creates nothing.
    """
    grid = torch_mesh.mesh.to(torch.int64).cpu()
    rank = dist.get_rank()
    for axis, slices in enumerate(axis_slices(grid, grid.ndim)):
        for ranks in slices:
            adopt_group(ranks, torch_mesh.get_group(axis) if rank in ranks else dist.GroupMember.NON_GROUP_MEMBER)
    mesh = DeviceMesh(torch_mesh.device_type, grid, mesh_dim_names=torch_mesh.mesh_dim_names)
    # Groups over these ranks may have been cached before; the mesh talks over torch's own.
    mesh._groups = [torch_mesh.get_group(axis) for axis in range(grid.ndim)]
    return mesh
