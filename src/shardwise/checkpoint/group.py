"""The ranks taking part in a save or load, and how they agree.

``save`` and ``load`` are collective over the default process group (every rank calls them,
like torch.distributed.checkpoint). Their only communication is exchanging small Python
objects (block lists, checksums, error messages) through ``shardwise.comm``; tensor data
never travels between ranks. Without an initialized process group they run as a world of one.

``async_save`` exchanges the same objects on a gloo group of its own (``checkpoint_world``),
created once per default group, collectively, the first time every rank calls it. Its writing
thread then never shares a group with the training thread, whose collectives it would
otherwise interleave with in an order that differs between ranks (a hang or a wrong result).
That group is used outside ``shardwise.comm`` on purpose: comm numbers and records every
collective of the training thread, and a thread of checkpoint traffic must not touch them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise import comm
from shardwise.checkpoint.errors import CheckpointError
from shardwise.core.mesh import DeviceMesh

__all__ = ["World", "current_world", "checkpoint_world"]


@dataclass(frozen=True)
class World:
    """This process's rank, the world size, and a 1-D mesh over the world (None alone)."""

    rank: int
    size: int
    mesh: DeviceMesh | None
    group: dist.ProcessGroup | None = None  # a group of the checkpoint's own (checkpoint_world)

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (also a barrier)."""
        if self.group is not None:
            out: list[Any] = [None] * self.size
            dist.all_gather_object(out, obj, group=self.group)
            return out
        if self.mesh is None:
            return [obj]
        return comm.all_gather_object(obj, self.mesh, 0)

    def agree(self, error: str | None) -> None:
        """Raise the same CheckpointError on every rank if any rank reports an error."""
        errors = self.exchange(error)
        failed = [rank for rank, e in enumerate(errors) if e is not None]
        if failed:
            where = f" (on rank {failed[0]})" if self.size > 1 else ""
            others = f"; {len(failed) - 1} other rank(s) failed too: {failed[1:]}" if len(failed) > 1 else ""
            raise CheckpointError(f"{errors[failed[0]]}{where}{others}")


def current_world() -> World:
    """The default process group as a World, or a world of one if there is none."""
    if not dist.is_available() or not dist.is_initialized():
        return World(0, 1, None)
    size = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return World(dist.get_rank(), size, DeviceMesh(device, list(range(size))))


# The default group the checkpoint group was made for (held, so its id is never reused), and it.
_SIDE: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []


def checkpoint_world() -> World:
    """The world over a gloo group used only by checkpoints (collective the first time per
    default group: every rank must call it at the same point); alone, a world of one."""
    world = current_world()
    if world.mesh is None:
        return world
    default = dist.group.WORLD
    if not _SIDE or _SIDE[0][0] is not default:
        from shardwise.comm.timeout import collective_timeout

        _SIDE[:] = [(default, dist.new_group(backend="gloo", timeout=collective_timeout()))]
    return World(world.rank, world.size, None, _SIDE[0][1])
