"""Ops that need some dims whole (their "core" dims) and treat every other dim independently.

A matrix op works on the last two dims and loops over the leading (batch) dims; a pooling op on
the last one to three (spatial) dims; an FFT on the dims it transforms; ``glu`` / ``diff`` /
``kthvalue`` on one dim. Whatever the op does along its core dims, each index of a free dim is
computed on its own, so a free dim may stay sharded: each rank runs the op on its block. A core
dim must be whole (Replicate on every mesh axis): this is the "gather on the dims the op needs,
keep the rest sharded" layout, and it is exact for every such op.

Two shapes of the rule live here:

* ``batch_axis_candidates``: every tensor has ``core`` trailing dims; the leading dims are batch
  dims, broadcast between inputs (aligned from the right, as ``torch.linalg.solve`` does), and
  every output starts with the broadcast batch dims;
* ``aligned_axis_candidates``: every tensor has the same rank, a chosen set of dims is core, any
  other dim may be sharded on every tensor at once (outputs included).

Output shapes come from running the op on meta tensors of the global shapes (the op's own shape
rules), so a strategy never restates them. Ops that are linear in one input (FFTs, average
pooling, the backward of a pad or a pooling) also let a pending sum / average through.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Any, Sequence

import torch

from shardwise.dispatch import walk
from shardwise.dispatch.ops._common import R
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec, local_shape_and_offset

__all__ = ["output_shapes", "batch_axis_candidates", "aligned_axis_candidates", "linear_partials", "without_empty_blocks"]


# ---------------------------------------------------------------------- output metadata
def _meta(value: Any) -> Any:
    if isinstance(value, DTensorSpec):
        return torch.empty_strided(value.shape, value.tensor_meta.stride, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value


@lru_cache(maxsize=2048)
def _shapes(op: Any, args: tuple, kwargs: tuple) -> tuple[tuple[int, ...] | None, ...]:
    meta_args, meta_kwargs = walk.map_leaves(_meta, (args, dict(kwargs)))
    out = op(*meta_args, **meta_kwargs)
    return tuple(tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in walk.leaves(out))


def output_shapes(schema: OpSchema) -> tuple[tuple[int, ...] | None, ...]:
    """Global shape of every output of the call (None for a non-tensor output), flattened."""
    try:
        return _shapes(schema.op, schema.args, schema.kwargs)
    except TypeError:  # an unhashable argument: compute without the cache
        return _shapes.__wrapped__(schema.op, schema.args, schema.kwargs)


# ---------------------------------------------------------------------- Partial
def linear_partials(spec: DTensorSpec) -> list[Placement]:
    """``spec``'s pending sums / averages: they pass through a function linear in it."""
    return list(dict.fromkeys(p for p in spec.placements if isinstance(p, Partial) and p.reduce_op in ("sum", "avg")))


def _linear_candidates(schema: OpSchema, n_out: int, linear_in: int | None) -> list[AxisCandidate]:
    """The op is linear in DTensor input ``linear_in``: its pending sum passes, the others are whole."""
    if linear_in is None or linear_in >= len(schema.specs):
        return []
    n_in = len(schema.specs)
    return [
        (p,) * n_out + tuple(p if i == linear_in else R for i in range(n_in))
        for p in linear_partials(schema.specs[linear_in])
    ]


# ---------------------------------------------------------------------- batched (leading dims free)
def batch_axis_candidates(
    schema: OpSchema, cores: Sequence[int], *, linear_in: int | None = None
) -> list[AxisCandidate]:
    """Per-axis layouts of an op over the trailing ``cores[i]`` dims of each DTensor input.

    The batch shape is the broadcast of the inputs' leading dims; output batch dim ``d`` may be
    sharded when every output has the batch dims first, with each input sharded on its own
    matching dim (or replicated where it broadcasts that dim).
    """
    specs = schema.specs
    batches = [tuple(s.shape[: max(s.ndim - c, 0)]) for s, c in zip(specs, cores)]
    batch = tuple(torch.broadcast_shapes(*batches)) if batches else ()
    outs = output_shapes(schema)
    n_out = len(outs)
    candidates: list[AxisCandidate] = []
    for d, size in enumerate(batch):
        placed = tuple(_batch_output(o, batch, d) for o in outs)
        if size <= 1 or None in placed:
            continue
        ins = tuple(_batch_dim(b, batch, d) for b in batches)
        candidates.append(placed + ins)
    candidates += _linear_candidates(schema, n_out, linear_in)
    candidates.append((R,) * (n_out + len(specs)))
    return candidates


def _batch_output(shape: tuple[int, ...] | None, batch: tuple[int, ...], d: int) -> Placement | None:
    """An output's placement for batch dim ``d`` sharded: Shard(d) if it starts with the batch
    dims; R for an empty placeholder (``svd`` without ``U`` / ``Vh``); None if it cannot follow."""
    if shape is None:
        return R
    if shape[: len(batch)] == batch:
        return Shard(d)
    return R if shape == (0,) else None


def _batch_dim(own: tuple[int, ...], batch: tuple[int, ...], d: int) -> Placement:
    """An input's placement for batch dim ``d`` sharded: its own dim, or R where it broadcasts."""
    mine = d - (len(batch) - len(own))
    return Shard(mine) if mine >= 0 and own[mine] == batch[d] else R


# ---------------------------------------------------------------------- aligned (same rank)
def aligned_axis_candidates(
    schema: OpSchema, core: Sequence[int], *, linear_in: int | None = None
) -> list[AxisCandidate]:
    """Per-axis layouts of an op whose tensors all share one rank; dims in ``core`` are whole.

    A free dim ``d`` is sharded on every input and output at once, when all of them have the
    same size there (an input with size 1 there broadcasts: replicated).
    """
    specs = schema.specs
    outs = output_shapes(schema)
    ndim = specs[0].ndim
    core_set = {c % max(ndim, 1) for c in core}
    candidates: list[AxisCandidate] = []
    for d in range(ndim):
        size = specs[0].shape[d]
        if d in core_set or size <= 1:
            continue
        if not all(o is not None and len(o) == ndim and o[d] == size for o in outs):
            continue
        if not all(s.ndim == ndim and s.shape[d] in (1, size) for s in specs):
            continue
        ins = tuple(Shard(d) if s.shape[d] == size else R for s in specs)
        candidates.append((Shard(d),) * len(outs) + ins)
    candidates += _linear_candidates(schema, len(outs), linear_in)
    candidates.append((R,) * (len(outs) + len(specs)))
    return candidates


# ---------------------------------------------------------------------- empty blocks
def without_empty_blocks(schema: OpSchema, candidates: list[Candidate], allowed: set[int]) -> list[Candidate]:
    """Candidates under which no rank's block of input 0 is empty on a dim outside ``allowed``.

    For kernels that accept an empty batch but reject empty channels or features (pooling,
    reflection padding): with few channels over many ranks, uneven shards leave some rank
    none, and that rank alone would raise.
    """
    spec = schema.specs[0]
    return [c for c in candidates if _nonempty(spec, c.inputs[0] if c.inputs else None, allowed)]


def _nonempty(spec: DTensorSpec, target: tuple | None, allowed: set[int]) -> bool:
    placements = spec.placements if target is None else target
    dims = frozenset(p.dim for p in placements if p.is_shard()) - allowed
    if not dims:
        return True
    return _no_empty_block(tuple(spec.shape), tuple(spec.mesh.shape), tuple(placements), dims)


@lru_cache(maxsize=4096)
def _no_empty_block(shape: tuple, mesh_shape: tuple, placements: tuple, dims: frozenset) -> bool:
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        block, _ = local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        if any(block[d] == 0 for d in dims):
            return False
    return True
