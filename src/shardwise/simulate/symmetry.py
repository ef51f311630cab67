"""Which ranks of a job do the same thing: simulate one of each (pure).

A training step runs the same program on every rank; what can differ between two ranks is the
size of the blocks they hold, since ``torch.chunk`` gives trailing ranks shorter pieces when a
dim does not divide evenly. Activations follow from the parameter blocks and the batch split
(which the trainer requires to be even), and every collective's byte count follows from the
block sizes. So two ranks whose every parameter block has the same shape are interchangeable:
same memory, same bytes on each mesh axis. Ranks are grouped by that signature, computed from
the parameters' layouts (global shape, placements, mesh axes) for every rank coordinate, without
building anything.

Some axes always tell ranks apart whatever the shapes (``DISTINCT_AXES``): a pipeline stage
holds other layers than its neighbour.

Example:
    >>> params = [ParamLayout((10, 4), (Shard(0),), ((0,),))]
    >>> rank_classes((4,), ("dp_shard",), params)  # rows 3, 3, 3, 1
    [[0, 1, 2], [3]]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from shardwise.core.placement import Placement
from shardwise.core.spec import local_shape_and_offset

__all__ = ["ParamLayout", "DISTINCT_AXES", "rank_classes", "layouts_of"]

# Mesh axes whose coordinate always makes ranks different (they hold different modules).
DISTINCT_AXES = ("pp",)


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One parameter's layout over the world mesh.

    ``axes`` gives, for each of its mesh's axes, the world-mesh axes it is made of (one, or
    several for a flattened axis, outermost first).
    """

    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    axes: tuple[tuple[int, ...], ...]

    def coordinate(self, world_coordinate: Sequence[int], world_shape: Sequence[int]) -> tuple[int, ...]:
        """This parameter's mesh coordinate for the rank at ``world_coordinate``."""
        out = []
        for dims in self.axes:
            index = 0
            for d in dims:
                index = index * world_shape[d] + world_coordinate[d]
            out.append(index)
        return tuple(out)

    def mesh_shape(self, world_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(math.prod(world_shape[d] for d in dims) for dims in self.axes)


def rank_classes(world_shape: Sequence[int], axis_names: Sequence[str],
                 params: Sequence[ParamLayout]) -> list[list[int]]:
    """Ranks grouped by what they hold, each group in rank order, groups by their first rank.

    Args:
        world_shape: the world mesh's shape (row-major rank numbering).
        axis_names: its axis names (those in ``DISTINCT_AXES`` split groups by coordinate).
        params: the layouts of the model's parameters (duplicates are cheap: deduplicated).
    """
    world_shape = tuple(world_shape)
    distinct = [i for i, name in enumerate(axis_names) if name in DISTINCT_AXES]
    unique = list(dict.fromkeys(params))
    shapes: dict = {}
    groups: dict[tuple, list[int]] = {}
    for rank, coord in enumerate(itertools.product(*(range(n) for n in world_shape))):
        signature = [tuple(coord[i] for i in distinct)]
        for p in unique:
            key = (p, p.coordinate(coord, world_shape))
            if key not in shapes:
                shapes[key] = local_shape_and_offset(p.shape, p.mesh_shape(world_shape), key[1], p.placements)[0]
            signature.append(shapes[key])
        groups.setdefault(tuple(signature), []).append(rank)
    return sorted(groups.values(), key=lambda g: g[0])


def layouts_of(parameters, world_mesh) -> list[ParamLayout]:
    """The ``ParamLayout`` of every DTensor parameter laid out on a sub-mesh of ``world_mesh``.

    Plain parameters are whole on every rank and say nothing about symmetry.
    """
    out = []
    for p in parameters:
        spec = getattr(p, "_spec", None)
        if spec is None:
            continue
        mesh = spec.mesh
        if mesh._root != world_mesh and mesh != world_mesh:
            raise ValueError(f"a parameter lives on {mesh}, not on a sub-mesh of the world mesh {world_mesh}")
        out.append(ParamLayout(tuple(spec.tensor_meta.shape), tuple(spec.placements), tuple(mesh._axis_dims)))
    return out
