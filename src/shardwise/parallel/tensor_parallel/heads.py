"""Head alignment: refuse a feature split that the attention's view into heads would cut.

ColwiseParallel and RowwiseParallel split a dim that is not divisible by the ranks as
torch.chunk does (10 features on 4 ranks: 3, 3, 3, 1). For an MLP that is all there is to it.
An attention projection is different: the module reshapes its block of features into heads
(``view(bs, seqlen, -1, head_dim)``), which works only if every rank's block is a whole number
of heads. A plan that would hand a rank 1.5 heads fails there with a bare shape error deep in
the model; this check names the module and the numbers while the plan is checked, before
anything is distributed.

Grouped key/value heads add one condition: each rank's query heads must be the ones its
key/value heads serve (12 query heads over 3 kv heads on 4 ranks: 3 query heads but 1, 1, 1, 0
kv heads per rank, so the local repeat of kv heads does not match). ``check_head_groups``
compares the per-rank head counts of the column-sharded projections of one attention module.

What is a head is read from the projection's parent module, by the attribute names attention
implementations use for it (``head_dim``, ``head_size``, ...). Without such an attribute, or
when the split features are not a multiple of it, nothing is checked.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Shard

__all__ = ["HEAD_DIM_NAMES", "head_dim_of", "block_sizes", "check_head_alignment", "check_head_groups"]

HEAD_DIM_NAMES = ("head_dim", "head_size", "d_head", "attention_head_size")


def head_dim_of(module: nn.Module) -> tuple[str, int] | None:
    """(attribute name, value) of ``module``'s per-head feature count, if it declares one."""
    for name in HEAD_DIM_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def block_sizes(size: int, ranks: int) -> list[int]:
    """How many of ``size`` rows each of ``ranks`` ranks holds (torch.chunk rules)."""
    return [Shard.chunk(size, ranks, i)[0] for i in range(ranks)]


def check_head_alignment(
    style: object, module: nn.Module, parent: nn.Module | None, parent_path: str, mesh: DeviceMesh
) -> None:
    """Raise ``ValueError`` if ``style`` would give some rank part of a head of ``parent``.

    ``style`` is a ColwiseParallel or RowwiseParallel (anything with ``sharded_features``);
    ``parent`` the module holding ``module`` (None for the root), ``parent_path`` its path.
    """
    features = getattr(style, "sharded_features", None)
    if parent is None or features is None:
        return
    split = features(module)
    head = head_dim_of(parent)
    if split is None or head is None:
        return
    what, size = split
    attr, head_dim = head
    ranks = mesh.size()
    if size % head_dim:  # not heads x head_dim: some other projection of the parent
        return
    sizes = block_sizes(size, ranks)
    if all(b % head_dim == 0 for b in sizes):
        return
    heads = size // head_dim
    fits = [d for d in range(1, heads + 1) if all(b % head_dim == 0 for b in block_sizes(size, d))]
    where = f"{parent_path}.{attr}" if parent_path else attr
    raise ValueError(
        f"{type(style).__name__} would split attention heads across ranks: its {size} {what} are {heads} "
        f"heads of {head_dim} ({where} = {head_dim}), and the {ranks} ranks of {mesh} would hold "
        f"{sizes} features ({', '.join(f'{b / head_dim:g}' for b in sizes)} heads), so viewing a block "
        f"as heads would cut a head in two. Use a tensor-parallel degree that splits {heads} heads "
        f"whole ({', '.join(map(str, fits))} ranks), or leave this module replicated"
    )


def _heads_per_rank(style: object, module: nn.Module, parent: nn.Module, ranks: int) -> list[int] | None:
    """Per-rank head counts of a column-sharded projection of ``parent`` (None: not one)."""
    features = getattr(style, "sharded_features", None)
    head = head_dim_of(parent)
    split = features(module) if features is not None else None
    if split is None or head is None or split[0] != "out_features" or split[1] % head[1]:
        return None
    return [b // head[1] for b in block_sizes(split[1], ranks)]


def check_head_groups(
    projections: Sequence[tuple[str, object, nn.Module, nn.Module]], mesh: DeviceMesh
) -> None:
    """Raise ``ValueError`` if query and key/value heads of one attention fall apart across ranks.

    ``projections``: (path, style, module, parent) of every styled module whose parent is the
    same attention module. For two column-sharded projections with H and H / r heads (r query
    heads per kv head), every rank must hold r times as many of the first as of the second.
    """
    ranks = mesh.size()
    counts = [(path, heads) for path, style, module, parent in projections
              if (heads := _heads_per_rank(style, module, parent, ranks)) is not None]
    for path_a, a in counts:
        for path_b, b in counts:
            total_a, total_b = sum(a), sum(b)
            if total_b == 0 or total_a <= total_b or total_a % total_b:
                continue
            group = total_a // total_b
            if any(x != group * y for x, y in zip(a, b)):
                raise ValueError(
                    f"the {total_a} heads of {path_a!r} share the {total_b} heads of {path_b!r} in groups of "
                    f"{group}, but the {ranks} ranks of {mesh} would hold {a} and {b} of them, so a rank's "
                    f"{path_a.rpartition('.')[2]} heads would not match its {path_b.rpartition('.')[2]} heads. "
                    f"Use a tensor-parallel degree dividing {total_b}, or leave {path_b!r} replicated"
                )
