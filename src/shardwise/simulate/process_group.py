"""A simulated process group: this process plays rank r of a world of N, and no data moves.

``simulated_world(rank, world_size)`` starts torch's default process group with a backend whose
collectives complete at once without sending anything (torch's fake process group), so every
mesh, sub-group and collective shardwise creates or issues runs its real code path, with its
real arguments, on one process. Collectives still go through ``shardwise.comm``, whose
recorders (``CommDebugMode``) count each one with its mesh axis and the bytes this rank would
send. Results of collectives are whatever the output buffers held: the simulation runs on meta
tensors, which hold no values anyway.

On leaving, the group is destroyed and shardwise's per-process caches that hold its groups
(meshes' groups, sequence numbers, dispatch decisions) are cleared, so the next rank starts
afresh in the same process.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from shardwise import comm, dispatch
from shardwise.core import mesh

__all__ = ["BACKEND", "simulated_world"]

BACKEND = "shardwise_sim"


def _create(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def _register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda", "meta"])


def reset_shardwise_state() -> None:
    """Forget every cached process group and the decisions taken with them."""
    comm.forget_groups()
    mesh.forget_groups()
    dispatch.clear_cache()


@contextlib.contextmanager
def simulated_world(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` ranks (simulated) inside the block.

    Raises:
        RuntimeError: a process group is already running in this process.
        ValueError: ``rank`` is not in ``range(world_size)``.
    """
    if dist.is_initialized():
        raise RuntimeError("simulated_world: this process already belongs to a process group; a simulation runs "
                           "in a process of its own (no launcher, no init_process_group)")
    if not 0 <= rank < world_size:
        raise ValueError(f"simulated_world: rank {rank} is not in range(world_size={world_size})")
    _register()
    reset_shardwise_state()
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        reset_shardwise_state()
