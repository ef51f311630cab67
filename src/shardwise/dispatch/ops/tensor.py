"""Tensor ops that address values by index, sort them, fill them or read them out.

Indexing (``index``, ``index_put``, ``index_select``, ``index_add``, ``gather``, ``scatter``):
an indexed dim must be whole on every mesh axis, because indices are global positions; the
index tensors are replicated, and the dims that are not indexed keep their sharding (they move
to wherever the op puts them in the output). Two further layouts need no gathering of data:

* indices sharded along the result's index dims, data replicated: each rank looks up its own
  positions (``x[idx]`` with ``idx`` sharded, ``index_select`` / ``gather`` on a sharded index);
* a pending reduction passes through an op that only moves values (a gather is linear and
  order-preserving), and through writes when the written values carry the same reduction;
* ``gather`` along a dim the input shards, with an index of size 1 there: each rank picks the
  positions it holds and writes 0 elsewhere, giving a Partial(sum) (``masked_gather``).

Plain integer tensors given as indices are taken as replicated, like int arguments
(``registry.allow_plain_indices``): ``x[torch.tensor([0, 2])]`` needs no wrapping. So are plain
``values`` of ``index_put``: autograd's backward of ``index_put`` writes plain zeros.

``topk`` / ``sort`` need their dim whole; ``fill_`` / ``zero_`` and ``copy_`` keep the layout of
the tensor they write (into a Partial(sum) the value goes to coordinate 0 and 0 elsewhere, or
it would be counted once per rank); ``item()`` needs the value replicated.

Boolean masks work for writes (``x[mask] = v``, ``index_put``) but not for reads
(``x[mask]``): the result's shape depends on the mask's values, which the layout propagation
(run on meta tensors) cannot see.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from shardwise.dispatch.ops._common import R, aten, bind_arguments, broadcast_dim, cached_choice, localize, wrap_local
from shardwise.dispatch.ops.pointwise import pointwise_candidates
from shardwise.dispatch.registry import allow_plain_indices, register_layout_handler, register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec

__all__ = ["index_layout"]


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim > 0 else 0


def _partials(spec: DTensorSpec) -> list[Placement]:
    return list(dict.fromkeys(p for p in spec.placements if p.is_partial()))


# ---------------------------------------------------------------------- advanced indexing
def _is_mask(t: Any) -> bool:
    return t is not None and t.dtype in (torch.bool, torch.uint8)


def index_layout(shape: Sequence[int], indices: Sequence[Any]) -> tuple[dict[int, int], int, tuple[int, ...], tuple[int, ...]]:
    """Where ``x[indices]`` puts things: (non-indexed dim -> output dim, first index-result
    dim, broadcast shape of the index tensors, result shape).

    NumPy rules: the broadcast index dims replace the indexed dims in place when those are
    adjacent, and go first otherwise. A k-dim boolean mask indexes k dims and gives one result
    dim whose size depends on its values: it stands as size 1 here (only the kept dims' sizes
    are used).
    """
    indexed, shapes, d = [], [], 0
    for t in indices:
        width = t.ndim if _is_mask(t) else 1
        if t is not None:
            indexed += range(d, d + width)
            shapes.append((1,) if _is_mask(t) else tuple(t.shape))
        d += width
    bshape = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    first = indexed[0] if adjacent and indexed else 0
    rest = [d for d in range(len(shape)) if d not in indexed]
    kept = {}
    for d in rest:
        if adjacent and d < first:
            kept[d] = d
        elif adjacent:
            kept[d] = d - len(indexed) + len(bshape)
        else:
            kept[d] = len(bshape) + rest.index(d)
    result = [0] * (len(rest) + len(bshape))
    for d, o in kept.items():
        result[o] = shape[d]
    result[first:first + len(bshape)] = bshape
    return kept, first, bshape, tuple(result)


def _index_specs(indices: Sequence[Any]) -> list[DTensorSpec]:
    return [t for t in indices if isinstance(t, DTensorSpec)]


def _index_candidates(schema: OpSchema, put: bool) -> list[AxisCandidate]:
    """Per-axis layouts of ``index`` (output, self, index DTensors...) or of ``index_put``
    (output, self, index DTensors..., values if a DTensor)."""
    spec = schema.specs[0]
    indices = list(schema.arg(1, "indices"))
    idx_specs = _index_specs(indices)
    values = schema.arg(2, "values") if put else None
    vals = isinstance(values, DTensorSpec)
    kept, first, bshape, result_shape = index_layout(spec.shape, indices)
    idx_rep = (R,) * len(idx_specs)
    candidates: list[AxisCandidate] = []
    for d, o in kept.items():
        if spec.shape[d] > 1:
            out = Shard(d) if put else Shard(o)
            candidates.append((out, Shard(d)) + idx_rep + ((broadcast_dim(values, result_shape, o),) if vals else ()))
    if not put and len(idx_specs) == sum(t is not None for t in indices) and not any(map(_is_mask, indices)):
        for k, size in enumerate(bshape):
            if size > 1:
                candidates.append((Shard(first + k), R) + tuple(broadcast_dim(t, bshape, k) for t in idx_specs))
    position = _mask_fill(indices, values) if put else None
    if position is not None:
        candidates += _mask_fill_candidates(spec, indices[position], position, vals)
    for p in _partials(spec):
        if not put:
            candidates.append((p, p) + idx_rep)
        elif vals and p in values.placements and (not schema.arg(3, "accumulate", False) or p.reduce_op in ("sum", "avg")):
            candidates.append((p, p) + idx_rep + (p,))  # each rank writes its contributions
    candidates.append((R, R) + idx_rep + ((R,) if vals else ()))
    return candidates


def _mask_fill(indices: Sequence[Any], values: Any) -> int | None:
    """The position of the one boolean mask when ``x[mask] = scalar`` is a masked fill (so
    elementwise: the masked dims may stay sharded, the mask sharded alike), else None."""
    given = [i for i, t in enumerate(indices) if t is not None]
    if len(given) == 1 and _is_mask(indices[given[0]]) and values.ndim == 0:
        return given[0]
    return None


def _mask_fill_candidates(spec: DTensorSpec, mask: Any, position: int, vals: bool) -> list[AxisCandidate]:
    """(output, self, mask if a DTensor, values if a DTensor): a masked dim sharded alike."""
    mask_shard = isinstance(mask, DTensorSpec)
    return [
        (Shard(position + j), Shard(position + j)) + ((Shard(j),) if mask_shard else ()) + ((R,) if vals else ())
        for j in range(mask.ndim)
        if spec.shape[position + j] > 1
    ]


@register_strategy(aten.index.Tensor, aten._unsafe_index.Tensor)
def index_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """A lookup: non-indexed dims keep, sharded indices shard the result, Partial passes."""
    return _index_candidates(schema, put=False)


@register_strategy(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
                   aten._unsafe_index_put.default, per_axis=False)
def index_put_strategy(schema: OpSchema) -> list[Candidate]:
    """Self's non-indexed dims keep their sharding and the values follow them (or broadcast).

    A Partial self stays Partial only when the values carry the same pending reduction (each
    rank writes its contributions; an accumulating write only for sum/avg, which are linear).
    Plain values (replicated) are cut to the local block by the rewrite.
    """
    candidates = expand(_index_candidates(schema, put=True), 1, schema.mesh.ndim)
    values = schema.arg(2, "values")
    indices = list(schema.arg(1, "indices"))
    position = _mask_fill(indices, values)
    if position is not None and isinstance(indices[position], torch.Tensor):
        rewrite = _plain_mask_rewrite(position, indices[position].ndim)
        candidates = [replace(c, rewrite=rewrite) for c in candidates]
    elif isinstance(values, torch.Tensor) and values.ndim > 0:
        kept, _, _, result_shape = index_layout(schema.specs[0].shape, list(schema.arg(1, "indices")))
        lead = len(result_shape) - values.ndim
        dims = {d: o - lead for d, o in kept.items() if o - lead >= 0 and values.shape[o - lead] != 1}
        candidates = [replace(c, rewrite=_plain_values_rewrite(dims)) for c in candidates]
    return candidates


def _plain_values_rewrite(dims: dict[int, int]) -> Callable:
    """Narrow plain (replicated) values to the block of self this rank writes: self dim ``d``
    is values dim ``dims[d]``."""

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        shape, offset = output_specs[0].local_shape_and_offset()
        full = output_specs[0].shape
        values = args[2] if len(args) > 2 else kwargs["values"]
        for d, vd in dims.items():
            if shape[d] != full[d]:
                values = values.narrow(vd, offset[d], shape[d])
        if len(args) > 2:
            args = list(args)
            args[2] = values
        else:
            kwargs = {**kwargs, "values": values}
        return args, kwargs

    return rewrite


def _plain_mask_rewrite(position: int, width: int) -> Callable:
    """Narrow a plain (replicated) mask to the block of self this rank writes: mask dim ``j``
    is self dim ``position + j``."""

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        shape, offset = output_specs[0].local_shape_and_offset()
        full = output_specs[0].shape
        indices = list(args[1])
        mask = indices[position]
        for j in range(width):
            d = position + j
            if shape[d] != full[d]:
                mask = mask.narrow(j, offset[d], shape[d])
        indices[position] = mask
        args = list(args)
        args[1] = indices
        return args, kwargs

    return rewrite


# ---------------------------------------------------------------------- index_select / index_add
def _index_spec_rep(schema: OpSchema, position: int, name: str) -> tuple:
    """R for the index argument if it is a DTensor, nothing if it is plain."""
    return (R,) if isinstance(schema.arg(position, name), DTensorSpec) else ()


@register_strategy(aten.index_select.default)
def index_select_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(output, self, index): other dims keep; a sharded index with a replicated self gives an
    output sharded on the selected dim."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim"), spec.ndim)
    idx = _index_spec_rep(schema, 2, "index")
    candidates = [(Shard(d), Shard(d)) + idx for d in range(spec.ndim) if d != dim and spec.shape[d] > 1]
    index = schema.arg(2, "index")
    if idx and index.ndim == 1 and index.shape[0] > 1:
        candidates.append((Shard(dim), R, Shard(0)))
    candidates += [(p, p) + idx for p in _partials(spec)]
    return candidates + [(R, R) + idx]


@register_strategy(aten.index_add.default, aten.index_add_.default)
def index_add_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(output, self, index, source): other dims keep; sums of sums stay pending."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim"), spec.ndim)
    idx = _index_spec_rep(schema, 2, "index")
    source = schema.arg(3, "source")
    if not isinstance(source, DTensorSpec):  # a plain 0-dim source
        return [(R, R) + idx]
    candidates = [
        (Shard(d), Shard(d)) + idx + (Shard(d),)
        for d in range(spec.ndim)
        if d != dim and spec.shape[d] > 1 and source.ndim == spec.ndim
    ]
    candidates += [(p, p) + idx + (p,) for p in _partials(spec) if p.reduce_op in ("sum", "avg") and p in source.placements]
    return candidates + [(R, R) + idx + (R,)]


# ---------------------------------------------------------------------- gather / scatter
def _aligned_dims(dim: int, *specs: DTensorSpec) -> list[int]:
    """Dims other than ``dim`` on which every spec has the same (non-1) size."""
    ref = specs[0]
    return [d for d in range(ref.ndim) if d != dim and ref.shape[d] > 1 and all(s.ndim == ref.ndim and s.shape[d] == ref.shape[d] for s in specs)]


@register_strategy(aten.gather.default)
def gather_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(output, self, index): shard a dim both share, or the index on ``dim`` with self replicated."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim"), max(spec.ndim, 1))
    index = schema.arg(2, "index")
    if not isinstance(index, DTensorSpec):
        return [(p, p) for p in _partials(spec)] + [(R, R)]
    candidates = [(Shard(d), Shard(d), Shard(d)) for d in _aligned_dims(dim, spec, index)]
    if index.ndim and index.shape[dim] > 1:
        candidates.append((Shard(dim), R, Shard(dim)))
    candidates += [(p, p, R) for p in _partials(spec)]
    return candidates + [(R, R, R)]


def _masked_gather_applies(schema: OpSchema) -> bool:
    """``gather`` along a dim the input shards, with an index of size 1 there (one value picked
    per row: the label lookup of a loss over a sharded class dim)."""
    spec, index = schema.specs[0], schema.arg(2, "index")
    if not isinstance(index, DTensorSpec) or spec.ndim == 0 or index.ndim != spec.ndim or index.has_partial:
        return False
    dim = _norm(schema.arg(1, "dim"), spec.ndim)
    return index.shape[dim] == 1 and bool(spec.shard_axes(dim)) and not spec.has_partial and spec.dtype != torch.bool


@register_layout_handler(aten.gather.default, applies=_masked_gather_applies)
def masked_gather(op: Any, args: tuple, kwargs: dict) -> Any:
    """``gather`` without gathering the input: a rank owning positions [offset, offset+length)
    of ``dim`` picks the indices in that range and writes 0 for the others, so the result is
    Partial(sum) (each value comes from exactly one rank). The dims both tensors share keep
    their sharding as in ``gather_strategy``; the cost model may still prefer another layout."""
    x, dim, index = bind_arguments(op, args, kwargs)[:3]
    spec, ispec = x._spec, index._spec
    dim = _norm(dim, spec.ndim)
    schema = OpSchema(op, (spec, dim, ispec), (), (spec, ispec))
    axis = gather_strategy(schema)
    plan = cached_choice((op, spec, ispec, dim), schema,
                         lambda: expand([(Partial(), Shard(dim), R)] + axis, 1, spec.mesh.ndim))
    block, idx = localize([x, index], plan)
    target = spec.with_placements(plan.inputs[0])
    if target.shard_axes(dim):
        shape, offset = target.local_shape_and_offset()
        shifted = idx - offset[dim]
        outside = (shifted < 0) | (shifted >= shape[dim])
        if shape[dim] == 0:
            out = block.new_zeros(idx.shape)
        else:
            out = aten.gather.default(block, dim, shifted.masked_fill(outside, 0)).masked_fill_(outside, 0)
    else:
        out = aten.gather.default(block, dim, idx)
    meta = torch.empty(ispec.shape, dtype=spec.dtype, device="meta")
    return wrap_local(out, spec.mesh, plan.outputs[0], meta)


_SCATTER_SRC = [aten.scatter.src, aten.scatter_.src, aten.scatter_add.default, aten.scatter_add_.default,
                aten.scatter.reduce, aten.scatter_.reduce, aten.scatter_reduce.two, aten.scatter_reduce_.two]
_SCATTER_VALUE = [aten.scatter.value, aten.scatter_.value, aten.scatter.value_reduce, aten.scatter_.value_reduce]


@register_strategy(*_SCATTER_SRC, *_SCATTER_VALUE)
def scatter_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(output, self, index[, src]): a dim shared by all (same sizes) keeps its sharding.

    Partial: an overwriting scatter of Partial values into a Partial self keeps it (each rank
    writes its contributions); ``scatter_add`` only for sum/avg; reductions other than a plain
    write or add, and scalar values, need whole tensors.
    """
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim"), max(spec.ndim, 1))
    tensors = list(schema.specs)
    candidates = [tuple(Shard(d) for _ in range(len(tensors) + 1)) for d in _aligned_dims(dim, *tensors)]
    if schema.op in _SCATTER_SRC and len(schema.specs) == 3 and _plain_write(schema):
        add = schema.op in (aten.scatter_add.default, aten.scatter_add_.default)
        src = schema.specs[2]
        for p in _partials(spec):
            if p in src.placements and (not add or p.reduce_op in ("sum", "avg")):
                candidates.append((p, p, R, p))
    return candidates + [(R,) * (len(tensors) + 1)]


def _plain_write(schema: OpSchema) -> bool:
    """A scatter that writes or adds (no ``reduce=`` other than sum/add)."""
    reduce = schema.kwarg("reduce") or (schema.args[4] if len(schema.args) > 4 and isinstance(schema.args[4], str) else None)
    return reduce in (None, "sum", "add")


# ---------------------------------------------------------------------- sort / topk
def _sorted_dim_candidates(spec: DTensorSpec, dim: int, n_out: int) -> list[AxisCandidate]:
    """The sorted dim must be whole; other dims keep their sharding (all outputs alike)."""
    candidates = [(Shard(d),) * n_out + (Shard(d),) for d in range(spec.ndim) if d != dim and spec.shape[d] > 1]
    return candidates + [(R,) * (n_out + 1)]


@register_strategy(aten.topk.default)
def topk_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    return _sorted_dim_candidates(spec, _norm(schema.arg(2, "dim", -1), spec.ndim), 2)


@register_strategy(aten.sort.default, aten.sort.stable)
def sort_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    dim = schema.arg(1, "dim", -1) if schema.op is aten.sort.default else schema.kwarg("dim", -1)
    return _sorted_dim_candidates(spec, _norm(dim, spec.ndim), 2)


# ---------------------------------------------------------------------- fills and copies
def _partition_rewrite(position: int, axes: Sequence[int] | None = None) -> Callable:
    """On a rank whose coordinate is not 0 along an axis (of ``axes``, default all) where the
    written tensor (the first output) is Partial(sum) or Partial(product), replace the
    replicated value at ``position`` by the reduction's identity: the value is then counted
    once, not once per rank."""

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        spec = output_specs[0]
        for axis, p in enumerate(spec.placements):
            if axes is not None and axis not in axes:
                continue
            if p.is_partial() and p.identity() is not None and spec.mesh.get_local_rank(axis) != 0:
                args = list(args)
                value = args[position]
                args[position] = torch.full_like(value, p.identity()) if isinstance(value, torch.Tensor) else p.identity()
                break
        return args, kwargs

    return rewrite


@register_strategy(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, per_axis=False)
def fill_strategy(schema: OpSchema) -> list[Candidate]:
    """In place: self keeps its layout. Into a Partial(sum) or Partial(product) the value is
    written on coordinate 0 and the identity elsewhere (a rewrite; a replicated DTensor value
    is partitioned), so it is counted once; avg, max and min of equal values are that value."""
    spec = schema.specs[0]
    value = 0 if schema.op is aten.zero_.default else schema.arg(1, "value")
    value_spec = isinstance(value, DTensorSpec)
    axis: list[AxisCandidate] = [(Shard(d), Shard(d)) + ((R,) if value_spec else ()) for d in range(spec.ndim)]
    axis += [(p, p) + ((p,) if value_spec else ()) for p in _partials(spec)]
    axis.append((R, R) + ((R,) if value_spec else ()))
    candidates = expand(axis, 1, schema.mesh.ndim)
    if value_spec or schema.op is aten.zero_.default:
        return candidates
    return [replace(c, rewrite=_partition_rewrite(1)) for c in candidates]


def _safe_cast(reduce_op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting each contribution before reducing gives the cast of the reduction."""
    if src == dst or reduce_op in ("max", "min"):
        return True
    return (src.is_floating_point or src.is_complex) and (dst.is_floating_point or dst.is_complex)


@register_strategy(aten.copy_.default, per_axis=False)
def copy_strategy(schema: OpSchema) -> list[Candidate]:
    """``self.copy_(src)``: self never changes its layout; src is brought to it.

    Per mesh axis: a sharded self dim takes src sharded alike (replicated where src
    broadcasts); a replicated self takes src replicated; a Partial self keeps src's own
    contributions when they carry the same reduction (and the cast is exact), and otherwise
    takes src replicated, written on coordinate 0 with the identity elsewhere for sum and
    product (``_partition_rewrite``).
    """
    spec = schema.specs[0]
    src = schema.arg(1, "src")
    placements = spec.placements
    if not isinstance(src, DTensorSpec):  # a plain 0-dim source: a replicated value
        return [Candidate((placements,), (placements,), rewrite=_partition_rewrite(1))]
    target, replicated = [], []
    for axis, (p, q) in enumerate(zip(placements, src.placements)):
        if p.is_shard():
            target.append(broadcast_dim(src, tuple(spec.shape), p.dim))
        elif p.is_partial() and q == p and _safe_cast(p.reduce_op, src.dtype, spec.dtype):
            target.append(p)  # each rank copies its own contribution
        else:
            target.append(R)
            replicated.append(axis)
    rewrite = _partition_rewrite(1, tuple(replicated)) if replicated else None
    return [Candidate((placements, tuple(target)), (placements,), rewrite=rewrite)]


@register_strategy(aten.fill.Scalar, aten.fill.Tensor)
def fill_out_of_place_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """A new tensor of ``value``: reads no values of self, so any layout works (Partial -> R)."""
    spec = schema.specs[0]
    value = schema.arg(1, "value")
    value_spec = (R,) if isinstance(value, DTensorSpec) else ()
    candidates = [(Shard(d), Shard(d)) + value_spec for d in range(spec.ndim)]
    candidates += [(R, p) + value_spec for p in _partials(spec)]  # a Partial's blocks are whole
    return candidates + [(R, R) + value_spec]


# ---------------------------------------------------------------------- reading values out
@register_strategy(aten._local_scalar_dense.default)
def item_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """``item()``: a Python number, the same on every rank: the tensor must be replicated."""
    return [(None, R)]


@register_strategy(aten.equal.default)
def equal_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """A bool on every rank: comparing local blocks would need a reduction of the answers, so
    both tensors are compared whole."""
    return [(None, R, R)]


# ---------------------------------------------------------------------- masked fill
# masked_fill.Scalar is tagged pointwise; the Tensor-value overloads are not.
register_strategy(aten.masked_fill.Tensor, aten.masked_fill_.Tensor, per_axis=False, replace=True)(pointwise_candidates)

allow_plain_indices(aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default,
                    aten.index_add.default, aten.index_add_.default)
# The backward of index_put (accumulate=False) writes plain zeros made from the values' metadata.
allow_plain_indices(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
                    aten._unsafe_index_put.default, values=("values",))
