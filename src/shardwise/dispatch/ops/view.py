"""View and shape ops: the values stay where they are, only dims move, merge, split or vanish.

A sharded dim keeps its sharding when it survives the op as one output dim; otherwise that
mesh axis must hold the dim whole (Replicate), and the cost model decides how to get there.
Partial passes through every op here: they only move, copy or zero-fill values, which commutes
with any pending reduction (a zero contributes nothing to a sum, and ``fill``-like ops that
write other values are not in this module).

Reshapes (``view``) are the interesting case. The input and output shapes are matched into
groups of dims with equal products (``(B, S, H*D) -> (B, S, H, D)`` has groups {B}->{B},
{S}->{S}, {H*D}->{H, D}). Within a group the flattened elements are the same, so a block of the
input group is a block of the output group exactly when both are cut only on their LEADING dim
and cover the same flattened range on every rank: this is checked for every coordinate of the
mesh (it covers uneven shards and several mesh axes cutting one dim), so ``view(b, s, -1, d)``
of a column-sharded projection keeps the heads sharded without any communication whenever the
blocks line up, and anything else is gathered first. A Shard on a size-1 dim (one rank holds the
dim, the others hold nothing: batch 1 under data parallelism) moves to a size-1 output dim, and
any Shard of an empty tensor stays, both without communication.

Ops whose non-tensor arguments are global sizes (``view``, ``expand``, ``*_backward``,
``new_*``) get them rewritten to the local block's shape (``Candidate.rewrite``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from shardwise.dispatch.ops._common import R, aten, bind_arguments
from shardwise.dispatch.registry import register_custom_handler, register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Placement, Shard
from shardwise.core.spec import DTensorSpec, local_shape_and_offset

__all__ = ["dim_map_candidates", "view_groups", "view_candidates", "size_rewrite"]


# ---------------------------------------------------------------------- shared helpers
def partials(*specs: DTensorSpec) -> list[Placement]:
    """The pending reductions present among ``specs`` (each once, in order)."""
    return list(dict.fromkeys(p for s in specs for p in s.placements if p.is_partial()))


def dim_map_candidates(
    spec: DTensorSpec, dim_map: Sequence[int | None], n_out: int = 1, others: int = 0
) -> list[AxisCandidate]:
    """Per-axis layouts of an op taking input dim ``d`` to output dim ``dim_map[d]``.

    ``None`` in ``dim_map`` means the dim does not survive whole (it is sliced, selected,
    broadcast, squeezed...): it cannot stay sharded. Partial passes through; ``others`` extra
    DTensor inputs are left as they are.
    """
    rest = (None,) * others
    candidates = [(Shard(o),) * n_out + (Shard(d),) + rest for d, o in enumerate(dim_map) if o is not None]
    candidates += [(p,) * n_out + (p,) + rest for p in partials(spec)]
    candidates.append((R,) * (n_out + 1) + rest)
    return candidates


def size_rewrite(position: int, name: str, output: int = 0) -> Callable:
    """A rewrite putting output ``output``'s LOCAL shape in the size argument of the call."""

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        shape = list(output_specs[output].local_shape())
        if position < len(args):
            args = list(args)
            args[position] = shape
        else:
            kwargs = {**kwargs, name: shape}
        return args, kwargs

    return rewrite


def _with_rewrite(candidates: list[Candidate], rewrite: Callable) -> list[Candidate]:
    return [replace(c, rewrite=rewrite) for c in candidates]


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim > 0 else 0


def _meta(spec: DTensorSpec) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device="meta")


# ---------------------------------------------------------------------- view / reshape
def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Match two shapes of equal, non-zero numel into groups of dims with equal products.

    Size-1 dims outside a group are skipped (they carry no elements). Each group is
    (input dims, output dims); its leading dims are the first of each.

    Example:
        >>> view_groups((2, 3, 8), (6, 2, 4))
        [((0, 1), (0,)), ((2,), (1, 2))]
    """
    groups, i, j = [], 0, 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) or j == len(dst):
            return groups
        ins, outs, a, b = [i], [j], src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                ins.append(i)
                a *= src[i]
            else:
                j += 1
                outs.append(j)
                b *= dst[j]
        groups.append((tuple(ins), tuple(outs)))
        i, j = i + 1, j + 1


def _cuts_only_leading(placements: Sequence[Placement], groups, side: int, shape: Sequence[int]) -> bool:
    """Every sharded dim is the leading dim of its group (on the input or output ``side``), or a
    size-1 dim (which only decides whether a rank's block is empty)."""
    leading = {g[side][0] for g in groups}
    return all(not p.is_shard() or p.dim in leading or shape[p.dim] == 1 for p in placements)


def _blocks_line_up(
    in_shape: Sequence[int], out_shape: Sequence[int], mesh_shape: Sequence[int],
    in_placements: Sequence[Placement], out_placements: Sequence[Placement], groups,
) -> bool:
    """On every rank, the input and output blocks are both empty, or each group's input block and
    output block cover the same flattened range. An empty tensor's blocks are all empty."""
    if math.prod(in_shape) == 0:
        return True
    if not (_cuts_only_leading(in_placements, groups, 0, in_shape)
            and _cuts_only_leading(out_placements, groups, 1, out_shape)):
        return False
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        in_len, in_off = local_shape_and_offset(in_shape, mesh_shape, coordinate, in_placements)
        out_len, out_off = local_shape_and_offset(out_shape, mesh_shape, coordinate, out_placements)
        empty = 0 in in_len
        if empty != (0 in out_len):
            return False
        if empty:
            continue
        for ins, outs in groups:
            a = _flat_range(in_shape, in_len, in_off, ins)
            b = _flat_range(out_shape, out_len, out_off, outs)
            if a != b:
                return False
    return True


def _flat_range(shape, lengths, offsets, dims) -> tuple[int, int]:
    """(start, count) of a group's block in the group's flattened elements; empty -> (0, 0)."""
    inner = math.prod(shape[d] for d in dims[1:])
    count = lengths[dims[0]] * inner
    return (offsets[dims[0]] * inner, count) if count else (0, 0)


def _kept_dims(in_shape: Sequence[int], out_shape: Sequence[int], groups) -> dict[int, list[int]]:
    """For each input dim a Shard may stay on through the reshape, the output dims it may go to,
    best first: a group's leading dim to the group's leading output dim; a size-1 dim (an uneven
    shard: one rank holds it, the others hold nothing) to a size-1 output dim, the one with the
    same elements after it first; in an empty tensor (every block empty) any dim to any dim,
    one of the same size first."""
    if math.prod(in_shape) == 0:
        return {i: sorted(range(len(out_shape)), key=lambda o: (out_shape[o] != in_shape[i], _from_end(in_shape, i) != _from_end(out_shape, o), abs(i - o)))
                for i in range(len(in_shape))}
    kept = {ins[0]: [outs[0]] for ins, outs in groups}
    singles = [o for o, n in enumerate(out_shape) if n == 1]
    for i, n in enumerate(in_shape):
        if n == 1 and singles:
            after = math.prod(in_shape[i + 1:])
            kept[i] = sorted(singles, key=lambda o: (math.prod(out_shape[o + 1:]) != after, _from_end(in_shape, i) != _from_end(out_shape, o), abs(i - o)))
    return kept


def _from_end(shape: Sequence[int], dim: int) -> int:
    return len(shape) - dim


def _axis_options(p: Placement, kept: dict[int, list[int]], groups) -> list[tuple[Placement, Placement]]:
    """(input, output) placements worth trying on one mesh axis now laid out by ``p``: keep its
    shard, move it to another group's leading dim (never onto a size-1 dim: one rank would hold
    everything), or replicate."""
    if p.is_partial():
        return [(p, p), (R, R)]
    if not p.is_shard():
        return [(R, R)]
    first = [(Shard(p.dim), Shard(o)) for o in kept.get(p.dim, ())]
    moves = [(Shard(ins[0]), Shard(outs[0])) for ins, outs in groups if ins[0] != p.dim]
    return first + moves + [(R, R)]


def view_candidates(spec: DTensorSpec, out_shape: Sequence[int], rewrite: Callable | None) -> list[Candidate]:
    """Every layout of a reshape of ``spec`` to ``out_shape`` whose blocks line up (see module doc)."""
    in_shape, mesh_shape = tuple(spec.shape), tuple(spec.mesh.shape)
    groups = [] if math.prod(in_shape) == 0 else view_groups(in_shape, out_shape)
    kept = _kept_dims(in_shape, tuple(out_shape), groups)
    options = [_axis_options(p, kept, groups) for p in spec.placements]
    candidates = []
    for combo in itertools.product(*options):
        ins, outs = tuple(c[0] for c in combo), tuple(c[1] for c in combo)
        if _blocks_line_up(in_shape, out_shape, mesh_shape, ins, outs, groups):
            candidates.append(Candidate((ins,), (outs,), rewrite))
    return candidates


def _view_out_shape(spec: DTensorSpec, size: Sequence[int]) -> tuple[int, ...]:
    return tuple(_meta(spec).reshape(size).shape)


_VIEW_SIZE = size_rewrite(1, "size")


def _viewable_rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
    """Local size for view; a local block whose strides cannot take the view is made contiguous.

    That happens only when the local block's strides differ from what the global view assumed
    (after a redistribute, for instance); the result then does not alias the input.
    """
    args, kwargs = _VIEW_SIZE(args, kwargs, output_specs)
    local = args[0]
    if not local.is_contiguous():
        try:
            local.view(args[1])
        except RuntimeError:
            args[0] = local.contiguous()
    return args, kwargs


@register_strategy(aten.view.default, aten._unsafe_view.default, per_axis=False)
def view_strategy(schema: OpSchema) -> list[Candidate]:
    spec = schema.specs[0]
    return view_candidates(spec, _view_out_shape(spec, schema.arg(1, "size")), _viewable_rewrite)


# ---------------------------------------------------------------------- dim permutations
@register_strategy(aten.transpose.int, aten.t.default)
def transpose_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    if spec.ndim < 2:
        return dim_map_candidates(spec, list(range(spec.ndim)))
    a, b = (0, 1) if schema.op is aten.t.default else (_norm(schema.arg(1, "dim0"), spec.ndim), _norm(schema.arg(2, "dim1"), spec.ndim))
    dim_map = list(range(spec.ndim))
    dim_map[a], dim_map[b] = b, a
    return dim_map_candidates(spec, dim_map)


@register_custom_handler(aten.movedim.int)
def movedim(op: Any, args: tuple, kwargs: dict) -> Any:
    """movedim as the permute it is (reached from decompositions such as diag_embed's)."""
    x, source, destination = bind_arguments(op, args, kwargs)
    source, destination = source % max(x.ndim, 1), destination % max(x.ndim, 1)
    order = [d for d in range(x.ndim) if d != source]
    order.insert(destination, source)
    return aten.permute.default(x, order)


@register_custom_handler(aten.narrow.default)
def narrow(op: Any, args: tuple, kwargs: dict) -> Any:
    """narrow as the slice it is."""
    x, dim, start, length = bind_arguments(op, args, kwargs)
    start = start + x.shape[dim] if start < 0 else start
    return aten.slice.Tensor(x, dim, start, start + length)


@register_strategy(aten.permute.default)
def permute_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    dims = [_norm(d, spec.ndim) for d in schema.arg(1, "dims")]
    return dim_map_candidates(spec, [dims.index(d) for d in range(spec.ndim)])


@register_strategy(aten.unsqueeze.default)
def unsqueeze_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    new = _norm(schema.arg(1, "dim"), spec.ndim + 1)
    return dim_map_candidates(spec, [d + (d >= new) for d in range(spec.ndim)])


@register_strategy(aten.squeeze.dims, per_axis=False)
def squeeze_strategy(schema: OpSchema) -> list[Candidate]:
    """Squeeze only the dims that are size 1 GLOBALLY: a sharded dim may be 1 (or 0) locally."""
    spec = schema.specs[0]
    dims = {_norm(d, spec.ndim) for d in schema.arg(1, "dim")} if spec.ndim else set()
    squeezed = sorted(d for d in dims if spec.shape[d] == 1)
    dim_map = [None if d in squeezed else d - sum(s < d for s in squeezed) for d in range(spec.ndim)]

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        return [args[0], squeezed], kwargs

    return _with_rewrite(expand(dim_map_candidates(spec, dim_map), 1, spec.mesh.ndim), rewrite)


@register_custom_handler(aten.squeeze.default, aten.squeeze.dim)
def squeeze_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """``squeeze()`` / ``squeeze(dim)`` as ``squeeze(dims)`` over the globally size-1 dims."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = range(x.ndim) if dim is None else [dim]
    return aten.squeeze.dims(x, [d for d in dims if x.ndim and x.shape[d] == 1])


@register_strategy(aten.expand.default, per_axis=False)
def expand_strategy(schema: OpSchema) -> list[Candidate]:
    """Broadcast dims (size 1 -> n) and new leading dims come out replicated."""
    spec = schema.specs[0]
    out_shape = tuple(_meta(spec).expand(schema.arg(1, "size")).shape)
    lead = len(out_shape) - spec.ndim
    dim_map = [lead + d if spec.shape[d] == out_shape[lead + d] else None for d in range(spec.ndim)]
    return _with_rewrite(expand(dim_map_candidates(spec, dim_map), 1, spec.mesh.ndim), size_rewrite(1, "size"))


@register_strategy(aten.repeat.default)
def repeat_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Dims repeated once keep their sharding; a repeated sharded dim would interleave blocks."""
    spec = schema.specs[0]
    repeats = list(schema.arg(1, "repeats"))
    lead = len(repeats) - spec.ndim
    return dim_map_candidates(spec, [lead + d if repeats[lead + d] == 1 else None for d in range(spec.ndim)])


# ---------------------------------------------------------------------- slicing
def _full_slice(size: int, start: int | None, end: int | None, step: int) -> bool:
    """True if ``slice(start, end, step)`` keeps every index of a dim of ``size``."""
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return step == 1 and start <= 0 and end >= size


@register_strategy(aten.slice.Tensor)
def slice_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """A sliced dim must be whole (a full slice is a no-op on every block and keeps it)."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim", 0), spec.ndim)
    full = _full_slice(spec.shape[dim], schema.arg(2, "start"), schema.arg(3, "end"), schema.arg(4, "step", 1))
    return dim_map_candidates(spec, [d if d != dim or full else None for d in range(spec.ndim)])


@register_strategy(aten.select.int)
def select_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    dim = _norm(schema.arg(1, "dim"), spec.ndim)
    return dim_map_candidates(spec, [None if d == dim else d - (d > dim) for d in range(spec.ndim)])


def _split_pieces(schema: OpSchema) -> int:
    spec = schema.specs[0]
    meta = _meta(spec)
    if schema.op in (aten.unbind.int,):
        return len(meta.unbind(schema.arg(1, "dim", 0)))
    if schema.op in (aten.split.Tensor, aten.unsafe_split.Tensor):
        return len(meta.split(schema.arg(1, "split_size"), schema.arg(2, "dim", 0)))
    return len(schema.arg(1, "split_sizes"))


@register_strategy(aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_with_sizes.default,
                   aten.unsafe_split_with_sizes.default, aten.unbind.int)
def split_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """The split dim must be whole, unless ``split`` leaves it in one piece; others keep."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(2 if schema.op is not aten.unbind.int else 1, "dim", 0), spec.ndim)
    pieces = _split_pieces(schema)
    whole = schema.op in (aten.split.Tensor, aten.unsafe_split.Tensor) and pieces == 1
    if schema.op is aten.unbind.int:
        dim_map = [None if d == dim else d - (d > dim) for d in range(spec.ndim)]
    else:
        dim_map = [d if d != dim or whole else None for d in range(spec.ndim)]
    return dim_map_candidates(spec, dim_map, n_out=pieces)


# ---------------------------------------------------------------------- joining
def _joined(schema: OpSchema) -> tuple[list, int]:
    """The DTensor inputs of cat/stack and the join dim (as given: may be negative)."""
    tensors = [t for t in schema.arg(0, "tensors") if isinstance(t, DTensorSpec)]
    return tensors, schema.arg(1, "dim", 0)


@register_strategy(aten.cat.default)
def cat_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Inputs sharded alike on a dim other than the cat dim keep it; Partials of one kind pass.

    1-D empty inputs (which ``cat`` skips) are left as they are.
    """
    tensors, dim = _joined(schema)
    ref = next((t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)), tensors[0])
    dim = _norm(dim, ref.ndim)
    legacy = [t.ndim == 1 and t.shape[0] == 0 and ref.ndim != 1 for t in tensors]
    candidates = []
    for d in range(ref.ndim):
        if d != dim and ref.shape[d] > 1:
            candidates.append((Shard(d),) + tuple(None if skip else Shard(d) for skip in legacy))
    ops = partials(*tensors)
    if len(ops) == 1 and all(t.has_partial for t in tensors):
        candidates.append((ops[0],) + tuple(None if skip else ops[0] for skip in legacy))
    candidates.append((R,) + tuple(None if skip else R for skip in legacy))
    return candidates


@register_strategy(aten.stack.default)
def stack_strategy(schema: OpSchema) -> list[AxisCandidate]:
    tensors, dim = _joined(schema)
    ref = tensors[0]
    dim = _norm(dim, ref.ndim + 1)
    n = len(tensors)
    candidates = [(Shard(d + (d >= dim)),) + (Shard(d),) * n for d in range(ref.ndim) if ref.shape[d] > 1]
    ops = partials(*tensors)
    if len(ops) == 1 and all(t.has_partial for t in tensors):
        candidates.append((ops[0],) * (n + 1))
    candidates.append((R,) * (n + 1))
    return candidates


# ---------------------------------------------------------------------- backward of views
@register_strategy(aten.select_backward.default, per_axis=False)
def select_backward_strategy(schema: OpSchema) -> list[Candidate]:
    """The gradient of a select is zeros with ``grad`` placed at the index: grad dims keep."""
    spec = schema.specs[0]
    dim = _norm(schema.arg(2, "dim"), len(schema.arg(1, "input_sizes")))
    dim_map = [g + (g >= dim) for g in range(spec.ndim)]
    return _with_rewrite(expand(dim_map_candidates(spec, dim_map), 1, spec.mesh.ndim), size_rewrite(1, "input_sizes"))


@register_strategy(aten.slice_backward.default, per_axis=False)
def slice_backward_strategy(schema: OpSchema) -> list[Candidate]:
    spec = schema.specs[0]
    sizes = list(schema.arg(1, "input_sizes"))
    dim = _norm(schema.arg(2, "dim"), len(sizes))
    full = _full_slice(sizes[dim], schema.arg(3, "start"), schema.arg(4, "end"), schema.arg(5, "step", 1))
    dim_map = [d if d != dim or full else None for d in range(spec.ndim)]
    return _with_rewrite(expand(dim_map_candidates(spec, dim_map), 1, spec.mesh.ndim), size_rewrite(1, "input_sizes"))


# ---------------------------------------------------------------------- as_strided
@register_strategy(aten.as_strided.default, per_axis=False)
def as_strided_strategy(schema: OpSchema) -> list[Candidate]:
    """Only on whole tensors (Replicate, or Partial: strides address elements, not blocks).

    The strides are the GLOBAL tensor's: a local copy laid out otherwise (a redistribute makes
    contiguous blocks) is first copied into the global strides, and an explicit storage offset
    counts from the local tensor's own start, as it does from the DTensor's.
    """
    spec = schema.specs[0]
    shape, stride = tuple(spec.shape), tuple(spec.tensor_meta.stride)
    axis = [(p, p) for p in partials(spec)] + [(R, R)]

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        args = list(args)
        local = args[0]
        if not _same_strides(local, shape, stride):
            fresh = torch.empty_strided(shape, stride, dtype=local.dtype, device=local.device)
            local = fresh.copy_(local)
            args[0] = local
        if len(args) > 3 and args[3] is not None:
            args[3] = args[3] + local.storage_offset()
        elif kwargs.get("storage_offset") is not None:
            kwargs = {**kwargs, "storage_offset": kwargs["storage_offset"] + local.storage_offset()}
        return args, kwargs

    return _with_rewrite(expand(axis, 1, spec.mesh.ndim), rewrite)


def _same_strides(t: torch.Tensor, shape: tuple, stride: tuple) -> bool:
    return tuple(t.shape) == shape and all(a == b or n <= 1 for a, b, n in zip(t.stride(), stride, shape))


# ---------------------------------------------------------------------- new tensors, copies
@register_strategy(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
                   aten.new_full.default, per_axis=False)
def new_like_strategy(schema: OpSchema) -> list[Candidate]:
    """Reads no values of ``self``: the same shape takes ``self``'s layout (Partial -> Replicate),
    another shape comes out replicated."""
    spec = schema.specs[0]
    rep = (R,) * spec.mesh.ndim
    if tuple(schema.arg(1, "size")) != tuple(spec.shape):
        return [Candidate((None,), (rep,))]
    out = tuple(R if p.is_partial() else p for p in spec.placements)
    return [Candidate((None,), (out,), size_rewrite(1, "size"))]


@register_strategy(aten.new_empty_strided.default, per_axis=False)
def new_empty_strided_strategy(schema: OpSchema) -> list[Candidate]:
    """Global strides only make sense for a whole tensor: replicated."""
    rep = (R,) * schema.mesh.ndim
    return [Candidate((None,), (rep,))]


@register_strategy(aten._to_copy.default)
def to_copy_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Layout kept. Partial(max/min) passes into any ordered dtype (conversion is monotonic);
    Partial(sum/avg) only from floating to an equally or more precise floating dtype (each
    contribution is then converted exactly or nearly so; truncating to ints, or overflowing a
    narrower float, would not commute with the sum)."""
    spec = schema.specs[0]
    dtype = schema.kwarg("dtype") or spec.dtype
    candidates = [(Shard(d), Shard(d)) for d in range(spec.ndim)]
    for p in partials(spec):
        if _converts_partial(p.reduce_op, spec.dtype, dtype):
            candidates.append((p, p))
    return candidates + [(R, R)]


@register_custom_handler(aten.to.dtype)
def to_dtype_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """``to(dtype)`` reached from inside a decomposition: the tensor itself when nothing
    changes (as ``Tensor.to`` does), else ``_to_copy``."""
    x = args[0]
    dtype = args[1] if len(args) > 1 else kwargs["dtype"]
    copy = args[3] if len(args) > 3 else kwargs.get("copy", False)
    memory_format = args[4] if len(args) > 4 else kwargs.get("memory_format")
    if dtype == x.dtype and not copy and memory_format in (None, torch.preserve_format):
        return x
    return aten._to_copy.default(x, dtype=dtype, memory_format=memory_format)


def _converts_partial(reduce_op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    if reduce_op in ("max", "min"):
        return dst != torch.bool and not dst.is_complex
    floating = lambda t: t.is_floating_point or t.is_complex  # noqa: E731
    return floating(src) and floating(dst) and dst.itemsize >= src.itemsize
