"""Head alignment: refuse a feature split that the attention's view into heads would cut.

ColwiseParallel and RowwiseParallel split a dim that is not divisible by the ranks as
torch.chunk does (10 features on 4 ranks: 3, 3, 3, 1). For an MLP that is all there is to it.
An attention projection is different: the module reshapes its block of features into heads
(``view(bs, seqlen, -1, head_dim)``), which works only if every rank's block is a whole number
of heads. A plan that would hand a rank 1.5 heads fails there with a bare shape error deep in
the model; this check names the module and the numbers while the plan is checked, before
anything is distributed.

What is a head is read from the projection's parent module, by the attribute names attention
implementations use for it (``head_dim``, ``head_size``, ...). Without such an attribute, or
when the split features are not a multiple of it, nothing is checked.
"""

from __future__ import annotations

from torch import nn

from shardwise.mesh import DeviceMesh
from shardwise.placement import Shard

__all__ = ["HEAD_DIM_NAMES", "head_dim_of", "block_sizes", "check_head_alignment"]

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
    what, size, _ = split
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
