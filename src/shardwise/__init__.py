"""shardwise: one logical tensor plus its layout over a mesh of devices.

The public names mirror ``torch.distributed.tensor`` so that switching imports is enough.
"""

import os as _os

from shardwise.tensor.factories import distribute_tensor, empty, full, ones, rand, randn, zeros
from shardwise.tensor.clip_grad import clip_grad_norm_
from shardwise.dispatch import allow_replicate_fallback, implicit_replication, register_sharding
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh, init_device_mesh
from shardwise.tensor.distribute_module import distribute_module
from shardwise.core.placement import Partial, Placement, Replicate, Shard
from shardwise.tensor.random import manual_seed
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.tensor import serialization as _serialization  # noqa: F401  (torch.load safe globals)

__all__ = [
    "DeviceMesh", "init_device_mesh",
    "Placement", "Shard", "Replicate", "Partial",
    "DTensorSpec", "TensorMeta", "DTensor",
    "distribute_tensor", "distribute_module", "zeros", "ones", "empty", "full", "rand", "randn",
    "implicit_replication", "allow_replicate_fallback", "register_sharding", "manual_seed",
    "clip_grad_norm_",
]

if _os.environ.get("SHARDWISE_CHECK_COLLECTIVES"):  # read once, at import: see shardwise.debug.check
    from shardwise.debug.check import enable_from_env as _enable_check

    _enable_check()
