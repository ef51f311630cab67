"""visualize_sharding: print which rank holds which block of a DTensor.

The blocks come from the spec math alone (``spec.local_shape_and_offset`` for every mesh
coordinate), so the table is computed without communication and tested without processes
(``sharding_blocks``, ``render_sharding``). As torch's, it is printed once, by the rank at
mesh coordinate (0, ..., 0); other ranks print nothing. A 1-D tensor shows as a column (as
torch does), a 2-D one as a grid of row and column ranges (inclusive, as torch writes them);
tensors of other ranks are listed block by block. Ranks that share a cell hold copies of it,
or, on a ``Partial`` axis, addends (a note under the table says which).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from shardwise.core.placement import Placement
from shardwise.core.spec import local_shape_and_offset

__all__ = ["Block", "sharding_blocks", "render_sharding", "sharding_table", "visualize_sharding"]


@dataclass(frozen=True, slots=True)
class Block:
    """A block of the global tensor and the ranks holding it.

    ``ranges`` are half-open ``(start, stop)`` global index ranges, one per tensor dim.
    """

    ranges: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]


def _rank_at(grid: Any, coordinate: Sequence[int]) -> int:
    for index in coordinate:
        grid = grid[index]
    return int(grid)


def sharding_blocks(
    global_shape: Sequence[int], rank_grid: Any, placements: Sequence[Placement]
) -> tuple[list[Block], tuple[int, ...]]:
    """Every distinct non-empty block with its ranks, and the ranks holding nothing.

    Args:
        global_shape: the DTensor's shape.
        rank_grid: the mesh's ranks as nested lists (``mesh.mesh.tolist()``).
        placements: one per mesh axis (Shard dims non-negative).
    Returns:
        (blocks ordered by their start indices, ranks whose block is empty).

    Example:
        >>> sharding_blocks((5,), [0, 1], [Shard(0)])
        ([Block(ranges=((0, 3),), ranks=(0,)), Block(ranges=((3, 5),), ranks=(1,))], ())
    """
    mesh_shape = _grid_shape(rank_grid, len(placements))
    holders: dict[tuple, list[int]] = {}
    empty: list[int] = []
    for coordinate in itertools.product(*map(range, mesh_shape)):
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, coordinate, placements)
        rank = _rank_at(rank_grid, coordinate)
        if any(s == 0 for s in shape):
            empty.append(rank)
            continue
        ranges = tuple((o, o + s) for o, s in zip(offset, shape))
        holders.setdefault(ranges, []).append(rank)
    blocks = [Block(ranges, tuple(sorted(ranks))) for ranges, ranks in sorted(holders.items())]
    return blocks, tuple(sorted(empty))


def _grid_shape(grid: Any, ndim: int) -> tuple[int, ...]:
    shape = []
    for _ in range(ndim):
        shape.append(len(grid))
        grid = grid[0]
    return tuple(shape)


def render_sharding(
    global_shape: Sequence[int],
    rank_grid: Any,
    placements: Sequence[Placement],
    device_type: str = "cpu",
    axis_names: Sequence[str] | None = None,
    title: str = "",
) -> str:
    """The table ``visualize_sharding`` prints (pure).

    Example:
        >>> print(render_sharding((4, 6), [[0, 1], [2, 3]], [Shard(0), Shard(1)]))
                 Col 0-2  Col 3-5
        Row 0-1  cpu:0    cpu:1
        Row 2-3  cpu:2    cpu:3
    """
    lines = [title] if title else []
    if 0 in tuple(global_shape):
        return "\n".join(lines + [f"empty tensor of shape {list(global_shape)}: no rank holds any element"])
    blocks, empty = sharding_blocks(global_shape, rank_grid, placements)
    cell = {b.ranges: f"{device_type}:{','.join(map(str, b.ranks))}" for b in blocks}
    if len(global_shape) in (1, 2):
        lines += _grid(blocks, cell)
    else:
        lines += [f"{_ranges_text(b.ranges)}  {cell[b.ranges]}" for b in blocks]
    if empty:
        lines.append(f"ranks holding no elements: {', '.join(map(str, empty))}")
    names = list(axis_names) if axis_names is not None else [str(i) for i in range(len(placements))]
    lines += [f"{p!r} on mesh axis {names[i]!r}: ranks of a cell that differ along it hold partial values; "
              f"the block is their {p.reduce_op}"  # type: ignore[attr-defined]
              for i, p in enumerate(placements) if p.is_partial()]
    return "\n".join(lines)


def _inclusive(r: tuple[int, int]) -> str:
    return f"{r[0]}-{r[1] - 1}"


def _ranges_text(ranges: tuple[tuple[int, int], ...]) -> str:
    return "scalar" if not ranges else "[" + ", ".join(_inclusive(r) for r in ranges) + "]"


def _grid(blocks: list[Block], cell: dict) -> list[str]:
    """Rows x columns of a 1-D (one column) or 2-D tensor's blocks."""
    def as_2d(ranges):
        return ranges if len(ranges) == 2 else (ranges[0], (0, 1))

    rows = sorted({as_2d(b.ranges)[0] for b in blocks})
    cols = sorted({as_2d(b.ranges)[1] for b in blocks})
    by_cell = {as_2d(b.ranges): cell[b.ranges] for b in blocks}
    table = [[""] + [f"Col {_inclusive(c)}" for c in cols]]
    table += [[f"Row {_inclusive(r)}"] + [by_cell.get((r, c), "") for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in table]


def sharding_table(dtensor: Any, header: str = "") -> str:
    """The table for a DTensor (or a DTensorSpec with tensor metadata), computed on any rank."""
    spec = getattr(dtensor, "_spec", dtensor)
    mesh = spec.mesh
    names = [mesh.axis_name(i) for i in range(mesh.ndim)]
    title = header or f"{spec.render()} on {mesh}"
    return render_sharding(tuple(spec.shape), mesh.mesh.tolist(), spec.placements, mesh.device_type, names, title)


def visualize_sharding(dtensor: Any, header: str = "", use_rich: bool = False) -> None:
    """Print which rank holds which block of ``dtensor`` (on the rank at mesh coordinate 0).

    Mirrors ``torch.distributed.tensor.debug.visualize_sharding``: printed once, by the rank
    whose coordinate is 0 along every mesh axis; ranks outside the mesh print nothing. Needs no
    extra package (``use_rich`` is accepted for compatibility and ignored) and handles tensors
    of any number of dims.

    Args:
        dtensor: the DTensor to show.
        header: first line of the output (default: its layout and mesh, e.g.
            ``f32[10@tp,6] on mesh(tp=4)``).
        use_rich: ignored; torch draws with ``rich`` when set.

    Example:
        >>> visualize_sharding(sw.distribute_tensor(torch.ones(4, 6), mesh, [Shard(0), Shard(1)]))
        f32[4@dp,6@tp] on mesh(dp=2, tp=2)
                 Col 0-2  Col 3-5
        Row 0-1  cpu:0    cpu:1
        Row 2-3  cpu:2    cpu:3
    """
    coordinate = dtensor.device_mesh.get_coordinate()
    if coordinate is None or any(coordinate):
        return
    print(sharding_table(dtensor, header), flush=True)
