"""What ``torch.load(weights_only=True)`` may rebuild from a pickled DTensor or DeviceMesh.

torch's safe loader refuses every class and function it was not told about. Importing
shardwise registers the few that a pickled DTensor, DTensorSpec or DeviceMesh refers to (the
rebuild functions, the spec and metadata classes, the placements), as importing
``torch.distributed.tensor`` does for torch's own, so ``torch.load(path)`` works with its
default ``weights_only=True``. None of them runs code beyond building these objects; a mesh
looks its process groups up (see ``DeviceMesh.__reduce__``).
"""

from __future__ import annotations

import torch

from shardwise.tensor import dtensor

from shardwise.core import mesh
from shardwise.core.placement import Partial, Replicate, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta

__all__ = ["SAFE_GLOBALS"]

SAFE_GLOBALS = [
    dtensor._rebuild_dtensor, dtensor.DTensor, *mesh.UNPICKLE_FUNCTIONS, mesh.DeviceMesh,
    DTensorSpec, TensorMeta, Shard, Replicate, Partial,
]

torch.serialization.add_safe_globals(SAFE_GLOBALS)
