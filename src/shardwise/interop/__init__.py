"""Interop with PyTorch's own distributed stack: the one place shardwise imports
``torch.distributed.tensor`` (and torch's checkpoint and ShardedTensor modules).

* ``to_torch`` / ``from_torch``: a DTensor either way, zero-copy, differentiable;
  ``mesh_to_torch`` / ``mesh_from_torch`` for meshes (same ranks, names, process groups);
  ``module_to_torch`` / ``module_from_torch`` for every parameter and buffer of a model.
* ``to_sharded_tensor`` / ``from_sharded_tensor``: torch's legacy ShardedTensor (Shard-only layouts).
* ``save_dcp``: a torch.distributed.checkpoint directory (``shardwise.checkpoint.load`` reads them).
* ``save_hf`` / ``read_weight_map``: Hugging Face safetensors (``shardwise.checkpoint.load`` reads
  a sharded one, given its directory or its ``model.safetensors.index.json``).
"""

from shardwise.interop.dtensor import from_torch, module_from_torch, module_to_torch, to_torch
from shardwise.interop.mesh import mesh_from_torch, mesh_to_torch
from shardwise.interop.dcp import save_dcp
from shardwise.interop.huggingface import read_weight_map, save_hf
from shardwise.interop.placements import UnconvertiblePlacement
from shardwise.interop.sharded_tensor import from_sharded_tensor, to_sharded_tensor

__all__ = [
    "to_torch", "from_torch", "module_to_torch", "module_from_torch",
    "mesh_to_torch", "mesh_from_torch", "UnconvertiblePlacement", "save_dcp", "save_hf", "read_weight_map",
    "to_sharded_tensor", "from_sharded_tensor",
]
