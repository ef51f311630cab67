"""Flat-buffer layout of one FSDP group: where each parameter's dim-0 shard sits.

A group gathers all of its parameters with ONE collective, so every rank packs its shards into
one flat buffer of the same length. Shards follow ``torch.chunk`` rules along dim 0 (trailing
ranks may hold fewer rows, or none), so each parameter gets a slot of ``padded_rows`` rows on
every rank, ``padded_rows = ceil(rows / world)``; a shorter shard leaves zeros at the end of
its slot.

Gathered buffer, rank-major (what ``all_gather`` of the flat buffers returns)::

    [ rank 0: slot(p0) slot(p1) ... | rank 1: slot(p0) slot(p1) ... | ... ]   world * per_rank

Because shorter shards are the trailing ones, concatenating the padded slots of all ranks gives
the parameter's rows in order followed by the padding: the first ``rows`` rows of the
``world * padded_rows`` rows ARE the parameter. Unsharded storage therefore has the padded
shape, and the parameter is a view of its first ``rows`` rows; unpacking is one copy per
parameter, without temporaries.

Gradients travel the other way: each gradient is padded to ``world * padded_rows`` rows and cut
into the same slots, so a reduce_scatter of the rank-major buffer leaves every rank the reduced
slots of its own shards.

Everything here is local tensor arithmetic: no process group, testable in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from shardwise.core.placement import Shard

__all__ = ["ParamSlot", "FlatLayout"]


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """One parameter's place in the per-rank flat buffer.

    ``shape`` is the block FSDP shards (the whole parameter, or its TP-local block).
    """

    shape: tuple[int, ...]
    padded_rows: int
    offset: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        """Elements in one row (product of the trailing dims)."""
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        """Elements of the slot on every rank (padded shard)."""
        return self.padded_rows * self.row_numel

    def padded_shape(self, world: int) -> tuple[int, ...]:
        """Shape of the unsharded storage: all ranks' padded shards stacked along dim 0."""
        return (world * self.padded_rows, *self.shape[1:])

    def shard_shape(self, world: int, rank: int) -> tuple[int, ...]:
        """Shape of the (unpadded) shard held by ``rank``."""
        return (Shard.chunk(self.rows, world, rank)[0], *self.shape[1:])

    def shard_offset(self, world: int, rank: int) -> int:
        """First row of ``rank``'s shard in the unsharded block."""
        return Shard.chunk(self.rows, world, rank)[1]


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Slots of a group's parameters in the flat buffer that every rank of the axis sends."""

    world: int
    slots: tuple[ParamSlot, ...]
    per_rank: int

    @staticmethod
    def build(shapes: Sequence[Sequence[int]], world: int) -> "FlatLayout":
        """Lay out blocks of the given shapes (each at least 1-D) for ``world`` ranks.

        Example:
            >>> FlatLayout.build([(3,), (5, 2)], 4).per_rank   # 1 row of 1 + 2 rows of 2
            5
        """
        if world < 1:
            raise ValueError(f"a flat layout needs at least one rank, got world={world}")
        slots, offset = [], 0
        for shape in shapes:
            shape = tuple(int(s) for s in shape)
            if not shape:
                raise ValueError("a 0-dim tensor has no dim 0 to shard; give it at least one dim")
            slot = ParamSlot(shape, -(-shape[0] // world), offset)
            slots.append(slot)
            offset += slot.numel
        return FlatLayout(world, tuple(slots), offset)

    # ------------------------------------------------------------------ gather side
    def pack_shards(self, shards: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's flat buffer ``[per_rank]``: each shard copied (and cast) into its slot."""
        flat = torch.zeros(self.per_rank, dtype=dtype, device=_device(shards))
        for slot, shard in zip(self.slots, shards):
            flat.narrow(0, slot.offset, shard.numel()).copy_(shard.reshape(-1))
        return flat

    def unpack_gathered(self, gathered: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Copy every slot of the gathered ``[world * per_rank]`` buffer into padded storage.

        ``outs[i]`` has ``slots[i].padded_shape(world)``; afterwards its first ``rows`` rows
        hold the whole block.
        """
        by_rank = gathered.view(self.world, self.per_rank)
        for slot, out in zip(self.slots, outs):
            # [world, padded_rows * row_numel] -> [world, padded_rows, row_numel]
            src = by_rank.narrow(1, slot.offset, slot.numel).view(self.world, slot.padded_rows, slot.row_numel)
            out.view(self.world, slot.padded_rows, slot.row_numel).copy_(src)

    # ------------------------------------------------------------------ reduce side
    def pack_grads(self, grads: Sequence[torch.Tensor | None], dtype: torch.dtype, *, presence: bool = False) -> torch.Tensor:
        """Rank-major ``[world * per_rank]`` buffer of whole-block gradients (None counts as 0).

        Slot s of rank r holds rows ``[r * padded_rows, (r + 1) * padded_rows)`` of gradient s,
        zero-padded past its last row, so a reduce_scatter leaves each rank its own shards.
        With ``presence`` every rank's segment ends with one more element per slot: 1 where
        this rank has that gradient, so after the reduction each rank knows whether ANY rank
        had it (``[world * (per_rank + len(slots))]``).
        """
        extra = len(self.slots) if presence else 0
        flat = torch.zeros(self.world, self.per_rank + extra, dtype=dtype, device=_device(grads))
        for index, (slot, grad) in enumerate(zip(self.slots, grads)):
            if grad is None:
                continue
            if presence:
                flat[:, self.per_rank + index] = 1
            # [world, padded_rows, row_numel]: ranks with a whole slot first, then a partial one
            dst = flat.narrow(1, slot.offset, slot.numel).view(self.world, slot.padded_rows, slot.row_numel)
            src = grad.reshape(slot.rows, slot.row_numel)
            whole = slot.rows // slot.padded_rows if slot.padded_rows else 0
            dst[:whole].copy_(src[: whole * slot.padded_rows].view(whole, slot.padded_rows, slot.row_numel))
            rest = slot.rows - whole * slot.padded_rows
            if rest:
                dst[whole, :rest].copy_(src[whole * slot.padded_rows :])
        return flat.view(-1)

    def unpack_shards(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of ``rank``'s unpadded shards in its flat ``[per_rank]`` buffer."""
        out = []
        for slot in self.slots:
            shape = slot.shard_shape(self.world, rank)
            out.append(flat.narrow(0, slot.offset, math.prod(shape)).view(shape))
        return out


def _device(tensors: Sequence[torch.Tensor | None]) -> torch.device:
    for t in tensors:
        if t is not None:
            return t.device
    return torch.device("cpu")
