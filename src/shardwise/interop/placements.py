"""Placements one-to-one between shardwise and ``torch.distributed.tensor``.

Shard(dim), Replicate() and Partial(reduce_op) mean the same in both libraries (torch.chunk
splits, nested left to right over the mesh axes), so each maps to its namesake. torch's
private placements (``_StridedShard``, which FSDP2 + TP produce for a parameter sharded twice
along one dim in the "wrong" order, and ``_MaskPartial`` from vocab-parallel embeddings) have
no shardwise meaning; converting one raises an error naming it and the mesh axis it sits on.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import placement_types as tp

from shardwise.core.placement import Partial, Placement, Replicate, Shard

__all__ = ["placements_to_torch", "placements_from_torch", "UnconvertiblePlacement"]


class UnconvertiblePlacement(ValueError):
    """A placement one library has and the other cannot express."""


def placements_to_torch(placements: Sequence[Placement]) -> tuple[tp.Placement, ...]:
    """torch's placement for each shardwise placement (every shardwise placement maps)."""
    return tuple(_to_torch(p, axis) for axis, p in enumerate(placements))


def placements_from_torch(placements: Sequence[tp.Placement], what: str = "from_torch") -> tuple[Placement, ...]:
    """shardwise's placement for each of torch's, or an error naming the one that has none."""
    return tuple(_from_torch(p, axis, what) for axis, p in enumerate(placements))


def _to_torch(p: Placement, axis: int) -> tp.Placement:
    if isinstance(p, Shard):
        return tp.Shard(p.dim)
    if isinstance(p, Replicate):
        return tp.Replicate()
    if isinstance(p, Partial):
        return tp.Partial(p.reduce_op)
    raise UnconvertiblePlacement(f"to_torch: mesh axis {axis} has placement {p!r}, which torch has no equivalent of")


def _from_torch(p: tp.Placement, axis: int, what: str) -> Placement:
    kind = type(p)
    if kind is tp.Shard:
        return Shard(p.dim)
    if kind is tp.Replicate:
        return Replicate()
    if kind is tp.Partial:
        if p.reduce_op not in Partial.REDUCE_OPS:
            raise UnconvertiblePlacement(
                f"{what}: mesh axis {axis} has torch placement {p} (Partial with reduce op "
                f"{p.reduce_op!r}); shardwise's Partial reduces with one of {Partial.REDUCE_OPS}"
            )
        return Partial(p.reduce_op)
    hint = ""
    if kind.__name__ == "_StridedShard":
        hint = " (a strided shard, as fully_shard over a tensor-parallel dim makes; redistribute it to Shard first)"
    elif kind.__name__ == "_MaskPartial":
        hint = " (a masked partial of a vocab-parallel embedding; reduce it first)"
    raise UnconvertiblePlacement(
        f"{what}: mesh axis {axis} has torch placement {p} ({kind.__name__}), which shardwise cannot "
        f"express{hint}; shardwise converts Shard, Replicate and Partial"
    )
