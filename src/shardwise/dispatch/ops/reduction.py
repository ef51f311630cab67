"""Reductions and scans: a surviving sharded dim stays sharded; a reduced one becomes Partial.

Reducing over a sharded dim leaves each rank with the reduction of its block. That is exactly
``Partial(op)`` when the reduction has a matching collective (sum -> sum, amax / max() -> max,
amin / min() -> min), so nothing is communicated until the value is needed. Reductions without
one (prod, argmax, max.dim's indices, cumsum's running total) need the reduced dim whole.

Statistics built from sums are rewritten into sums instead of gathering their input (see
``_stat_handler``): ``mean`` = sum / count (a local mean of an uneven block is NOT a share of
the global mean), ``var`` = sum((x - mean)^2) / (N - correction), ``vector_norm`` =
sum(|x|^p)^(1/p) (max / min of |x| for p = +-inf), ``any`` / ``all`` = counts of (non)zeros,
``logsumexp`` = max + log(sum(exp(x - max))). When no reduced dim is sharded and nothing is
pending, the op simply runs on the local block.

A pending reduction passes through a reduction that commutes with it: sum / avg through sum,
mean and cumsum (linear), max through amax / max(), min through amin / min(). Anything else
reduces first; the cost model picks reduce_scatter over all_reduce where it can.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from shardwise.dispatch import walk
from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.registry import register_custom_handler, register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.dispatch import tensor_class

__all__ = ["reduction_axis_candidates", "reduced_dims", "scan_axis_candidates"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------- shared helpers
def reduced_dims(ndim: int, dims: int | Sequence[int] | None) -> tuple[int, ...]:
    """Non-negative reduced dims; None or [] means all dims (as aten's reductions do)."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def _out_dim(d: int, reduced: tuple[int, ...], keepdim: bool) -> int:
    return d if keepdim else d - sum(r < d for r in reduced)


def reduction_axis_candidates(
    schema: OpSchema,
    reduced: tuple[int, ...],
    keepdim: bool,
    partial_op: str | None,
    n_out: int = 1,
    passing: Sequence[str] = (),
) -> list[AxisCandidate]:
    """Per-axis layouts of a reduction of input 0 over ``reduced``.

    ``partial_op`` is the pending reduction a reduced sharded dim turns into (None: the
    reduced dims must be whole). A Partial input whose reduce op is in ``passing`` stays.
    """
    spec = schema.specs[0]
    others = (None,) * (len(schema.specs) - 1)
    candidates: list[AxisCandidate] = []
    for d in range(spec.ndim):
        if d in reduced:
            if partial_op is not None:
                candidates.append((Partial(partial_op),) * n_out + (Shard(d),) + others)
        else:
            candidates.append((Shard(_out_dim(d, reduced, keepdim)),) * n_out + (Shard(d),) + others)
    for p in _pending(spec.placements, passing):
        candidates.append((p,) * n_out + (p,) + others)
    candidates.append((R,) * n_out + (R,) + others)
    return candidates


def scan_axis_candidates(schema: OpSchema, dim: int, passing: Sequence[str] = (), n_out: int = 1) -> list[AxisCandidate]:
    """Per-axis layouts of a scan along ``dim``: that dim whole, every other dim may stay sharded."""
    spec = schema.specs[0]
    dim = dim % max(spec.ndim, 1)
    candidates: list[AxisCandidate] = [(Shard(d),) * n_out + (Shard(d),) for d in range(spec.ndim) if d != dim]
    candidates += [(p,) * n_out + (p,) for p in _pending(spec.placements, passing)]
    candidates.append((R,) * (n_out + 1))
    return candidates


def _pending(placements: Sequence[Placement], passing: Sequence[str]) -> list[Placement]:
    """The input's pending reductions that commute with this op."""
    return [p for p in dict.fromkeys(placements) if isinstance(p, Partial) and p.reduce_op in passing]


def _linear_passing(schema: OpSchema, dtype: torch.dtype | None) -> tuple[str, ...]:
    """Pending reductions a sum-like op may keep: sum and avg, unless a cast breaks linearity.

    Casting each rank's contribution to an integer type before adding them truncates each
    contribution (trunc(a) + trunc(b) != trunc(a + b)), and an integer average is not linear.
    """
    src = schema.specs[0].dtype
    out = dtype if dtype is not None else src
    if out.is_floating_point or out.is_complex:
        return ("sum", "avg")
    return () if (src.is_floating_point or src.is_complex) else ("sum",)


# ---------------------------------------------------------------------- strategies
@register_strategy(aten.sum.default, aten.sum.dim_IntList, per_axis=False)
def sum_candidates(schema: OpSchema) -> list[Candidate]:
    """A reduced sharded dim becomes Partial(sum); a pending sum or avg passes through.

    A DTensor carries one kind of pending reduction, so a kept avg on one mesh axis cannot sit
    next to a new sum on another: those combinations are dropped (the avg is reduced first).
    """
    spec = schema.specs[0]
    reduced = reduced_dims(spec.ndim, schema.arg(1, "dim"))
    passing = _linear_passing(schema, schema.kwarg("dtype"))
    axis = reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), "sum", passing=passing)
    return [c for c in expand(axis, 1, spec.mesh.ndim) if _one_pending_kind(c.outputs[0])]


def _one_pending_kind(placements: Sequence[Placement]) -> bool:
    return len({p.reduce_op for p in placements if isinstance(p, Partial)}) <= 1


@register_strategy(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default, per_axis=False)
def extremum_candidates(schema: OpSchema) -> list[Candidate]:
    """amax / amin / max() / min(): a reduced sharded dim becomes Partial(max / min).

    A rank whose block is empty along a reduced dim (uneven shards) contributes the identity
    of the reduction (-inf for max) instead of failing on an empty reduction.
    """
    spec = schema.specs[0]
    reduced = reduced_dims(spec.ndim, schema.arg(1, "dim"))
    op = "max" if schema.op in (aten.amax.default, aten.max.default) else "min"
    axis = reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), op, passing=(op,))
    rewrite = functools.partial(_fill_empty_block, identity=_identity(op, spec.dtype), global_shape=tuple(spec.shape))
    return [replace(c, rewrite=rewrite) for c in expand(axis, 1, spec.mesh.ndim)]


def _identity(op: str, dtype: torch.dtype) -> bool | int | float:
    """The value that does not change a max (min) of ``dtype`` values."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _fill_empty_block(args: list, kwargs: dict, output_specs: tuple, *, identity: Any,
                      global_shape: tuple[int, ...]) -> tuple[list, dict]:
    """Give an empty local block's reduced dims of length 0 one identity element each.

    torch refuses to reduce over a dim of length 0; a rank whose shard of a reduced dim is
    empty must still produce its (identity) part, and a rank whose kept dims are empty too
    must produce its empty result like the others instead of raising alone. A reduced dim
    that is empty globally is left alone: torch raises on every rank, as on one device.
    """
    block = args[0]
    if block.numel() == 0:
        dims = args[1] if len(args) > 1 else kwargs.get("dim", ())
        reduced = set(reduced_dims(block.ndim, dims))
        shape = [1 if n == 0 and d in reduced and global_shape[d] > 0 else n for d, n in enumerate(block.shape)]
        args = [torch.full(shape, identity, dtype=block.dtype, device=block.device), *args[1:]]
    return args, kwargs


@register_strategy(aten.max.dim, aten.min.dim)
def indexed_extremum_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """max / min along a dim give (values, indices): the dim must be whole for global indices."""
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(1, "dim"))
    return reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), None, n_out=2)


@register_strategy(aten.argmax.default, aten.argmin.default)
def arg_extremum_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """argmax / argmin: the reduced dim (all dims for dim=None: a flat index) must be whole."""
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(1, "dim"))
    return reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), None)


@register_strategy(aten.median.default, aten.nanmedian.default)
def median_all_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """The median of every element: an order statistic, so the whole tensor on every rank."""
    return reduction_axis_candidates(schema, reduced_dims(schema.specs[0].ndim, None), False, None)


@register_strategy(aten.median.dim, aten.nanmedian.dim, aten.mode.default, aten.kthvalue.default)
def order_statistic_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """(values, indices) of an order statistic along a dim: that dim whole, the others keep
    their sharding (no collective computes a median of medians)."""
    dim_position = 2 if schema.op is aten.kthvalue.default else 1
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(dim_position, "dim", -1))
    keepdim = bool(schema.arg(dim_position + 1, "keepdim", False))
    return reduction_axis_candidates(schema, reduced, keepdim, None, n_out=2)


@register_strategy(aten.prod.default, aten.prod.dim_int)
def prod_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """No product collective: the reduced dims must be whole, other dims keep their sharding."""
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(1, "dim"))
    return reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), None)


@register_strategy(aten.cumsum.default, aten.cumsum_.default)
def cumsum_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """A running sum needs its dim whole; it is linear, so sum / avg pending reductions pass."""
    return scan_axis_candidates(schema, schema.arg(1, "dim"), _linear_passing(schema, schema.kwarg("dtype")))


@register_strategy(aten.cumprod.default, aten.cumprod_.default, aten.logcumsumexp.default)
def scan_candidates(schema: OpSchema) -> list[AxisCandidate]:
    return scan_axis_candidates(schema, schema.arg(1, "dim"))


@register_strategy(aten.cummax.default, aten.cummin.default)
def indexed_scan_candidates(schema: OpSchema) -> list[AxisCandidate]:
    return scan_axis_candidates(schema, schema.arg(1, "dim"), n_out=2)


@register_strategy(aten.flip.default)
def flip_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """flip (the backward of cumsum / cumprod): flipped dims whole, others keep their sharding.

    A flip only permutes elements, so every pending reduction passes through it.
    """
    spec = schema.specs[0]
    flipped = {d % max(spec.ndim, 1) for d in schema.arg(1, "dims")}
    candidates: list[AxisCandidate] = [(Shard(d), Shard(d)) for d in range(spec.ndim) if d not in flipped]
    candidates += [(p, p) for p in _pending(spec.placements, Partial.REDUCE_OPS)]
    return candidates + [(R, R)]


# ---------------------------------------------------------------------- rewritten statistics
def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    bound = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


@functools.lru_cache(maxsize=1024)
def _global_outputs(op: Any, spec: DTensorSpec, rest: tuple, kwargs: tuple) -> tuple[TensorMeta, ...]:
    """Global metadata of the op's outputs (run on a meta tensor; raises torch's own errors)."""
    meta = torch.empty_strided(spec.shape, spec.tensor_meta.stride, dtype=spec.dtype, device="meta")
    out = op(meta, *rest, **dict(kwargs))
    return tuple(TensorMeta(o.shape, tuple(o.stride()), o.dtype) for o in walk.leaves(out))


def _needs_rewrite(spec: DTensorSpec, reduced: tuple[int, ...]) -> bool:
    """Whether the op must be rewritten: a reduced dim is split across ranks, or a sum is pending."""
    return spec.has_partial or any(isinstance(p, Shard) and p.dim in reduced for p in spec.placements)


def _metas(op: Any, spec: DTensorSpec, args: tuple, kwargs: dict) -> tuple[TensorMeta, ...]:
    rest = walk.freeze(tuple(args[1:]))
    return _global_outputs(op, spec, rest, tuple(sorted((k, walk.freeze(v)) for k, v in kwargs.items())))


def _run_local(op: Any, x: Any, args: tuple, kwargs: dict, reduced: tuple[int, ...], keepdim: bool,
               metas: tuple[TensorMeta, ...]) -> Any:
    """Run a reduction on the local block when every reduced dim is whole on every rank.

    An empty block whose result is empty too (a short trailing shard of a kept dim) is
    allocated, not computed (torch warns about statistics of nothing). An empty block with a
    non-empty result means a reduced dim has length 0 on every rank: the op runs, giving what
    it gives on one device (NaN for var / mean, 0 for sum), the same on every rank.
    """
    DTensor = tensor_class.DTensor
    spec = x._spec
    placements = tuple(Shard(_out_dim(p.dim, reduced, keepdim)) if isinstance(p, Shard) else p for p in spec.placements)
    specs = [DTensorSpec(spec.mesh, placements, m) for m in metas]
    block = x._local_tensor
    if block.numel() == 0 and all(math.prod(s.local_shape()) == 0 for s in specs):
        outs = [torch.empty(s.local_shape(), dtype=s.dtype, device=block.device) for s in specs]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "var(): degrees of freedom is <= 0", as on one device
            out = op(block, *args[1:], **kwargs)
        outs = walk.leaves(out)
    wrapped = [DTensor(t, s, requires_grad=False) for t, s in zip(outs, specs)]
    return tuple(wrapped) if len(wrapped) > 1 else wrapped[0]


def _stat_handler(rewrite: Callable[..., Any]) -> Callable:
    """A custom handler: local run when nothing is split or pending, else ``rewrite``.

    ``rewrite(x, dims, keepdim, out_metas, bound)`` recomputes the op from ops that keep sums
    pending (sum, amax, pointwise), so a sharded reduced dim costs an all_reduce of the result,
    not an all_gather of the input.
    """

    def handler(op: Any, args: tuple, kwargs: dict) -> Any:
        DTensor = tensor_class.DTensor
        bound = _bind(op, args, kwargs)
        x = bound["self"]
        if not isinstance(x, DTensor):
            raise TypeError(f"{op}: expected a DTensor input, got {type(x).__name__}")
        dims = reduced_dims(x.ndim, bound.get("dim"))
        keepdim = bool(bound.get("keepdim", False))
        metas = _metas(op, x._spec, args, kwargs)
        if not _needs_rewrite(x._spec, dims):
            return _run_local(op, x, args, kwargs, dims, keepdim, metas)
        return rewrite(x, list(dims), keepdim, metas, bound)

    return handler


def _cast(t: Any, dtype: torch.dtype) -> Any:
    return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _count(x: Any, dims: list[int]) -> int:
    return math.prod(x.shape[d] for d in dims)


def _sum_over_count(x: Any, dims: list[int], keepdim: bool, out_dtype: torch.dtype) -> Any:
    """sum / count: Partial(sum) where a reduced dim is sharded (count is the GLOBAL count)."""
    total = aten.sum.dim_IntList(x, dims, keepdim, dtype=_accumulation_dtype(out_dtype))
    return _cast(aten.div.Scalar(total, _count(x, dims)), out_dtype)


def _mean(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    return _sum_over_count(x, dims, keepdim, metas[0].dtype)


def _variance(x: Any, dims: list[int], bound: dict, keepdim: bool) -> Any:
    """Two-pass variance in the accumulation dtype (the kept-dims mean is reduced once, small)."""
    work = _cast(x, _accumulation_dtype(x.dtype))
    centred = aten.sub.Tensor(work, _sum_over_count(work, dims, True, work.dtype))
    squares = aten.mul.Tensor(centred, centred) if not work.is_complex() else aten.pow.Tensor_Scalar(aten.abs.default(centred), 2)
    correction = bound.get("correction")
    correction = 1 if correction is None else correction
    dof = max(0, _count(x, dims) - correction)
    return aten.div.Scalar(aten.sum.dim_IntList(squares, dims, keepdim), dof)


def _var(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    return _cast(_variance(x, dims, bound, keepdim), metas[0].dtype)


def _std(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    return _cast(aten.sqrt.default(_variance(x, dims, bound, keepdim)), metas[0].dtype)


def _var_mean(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict, *, root: bool = False) -> tuple:
    var = _variance(x, dims, bound, keepdim)
    mean = _sum_over_count(x, dims, keepdim, metas[1].dtype)
    return _cast(aten.sqrt.default(var) if root else var, metas[0].dtype), mean


def _vector_norm(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    """sum(|x|^p)^(1/p); p = 2 as sqrt(sum(x*x)), p = +-inf as amax / amin of |x|, p = 0 a count."""
    out_dtype = metas[0].dtype
    p = float(bound.get("ord", 2))
    work = _cast(x, bound["dtype"]) if bound.get("dtype") is not None else x
    work = _cast(work, _accumulation_dtype(work.dtype))
    size = aten.abs.default(work) if (work.is_complex() or p != 2) else work
    if p == math.inf:
        result = aten.amax.default(size, dims, keepdim)
    elif p == -math.inf:
        result = aten.amin.default(size, dims, keepdim)
    elif p == 0:
        result = aten.sum.dim_IntList(aten.ne.Scalar(size, 0), dims, keepdim, dtype=size.dtype)
    elif p == 1:
        result = aten.sum.dim_IntList(size, dims, keepdim)
    elif p == 2:
        result = aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(size, size), dims, keepdim))
    else:
        powered = aten.sum.dim_IntList(aten.pow.Tensor_Scalar(size, p), dims, keepdim)
        result = aten.pow.Tensor_Scalar(powered, 1.0 / p)
    return _cast(result, out_dtype)


def _any(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    """any = (count of non-zeros) != 0: a Partial(sum) count instead of gathering the input."""
    count = aten.sum.dim_IntList(aten.ne.Scalar(x, 0), dims, keepdim)
    return _cast(aten.ne.Scalar(count, 0), metas[0].dtype)


def _all(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    """all = (count of zeros) == 0."""
    count = aten.sum.dim_IntList(aten.eq.Scalar(x, 0), dims, keepdim)
    return _cast(aten.eq.Scalar(count, 0), metas[0].dtype)


def _logsumexp(x: Any, dims: list[int], keepdim: bool, metas: tuple, bound: dict) -> Any:
    """max + log(sum(exp(x - max))): the (small) max is reduced once, the sum stays pending."""
    work = _cast(x, metas[0].dtype)
    peak = _settled(aten.amax.default(work, dims, True))
    peak = aten.masked_fill.Scalar(peak, aten.isinf.default(peak), 0)  # rows of only -inf / inf
    total = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(work, peak)), dims, keepdim)
    return aten.add.Tensor(aten.log.default(total), peak if keepdim else aten.squeeze.dims(peak, dims))


def _settled(t: Any) -> Any:
    """``t`` with its pending reductions done (replicated on those axes), once for all its uses."""
    if not t._spec.has_partial:
        return t
    return t.redistribute(t.device_mesh, [R if p.is_partial() else p for p in t.placements])


register_custom_handler(aten.mean.default, aten.mean.dim)(_stat_handler(_mean))
register_custom_handler(aten.var.correction)(_stat_handler(_var))
register_custom_handler(aten.std.correction)(_stat_handler(_std))
register_custom_handler(aten.var_mean.correction)(_stat_handler(_var_mean))
register_custom_handler(aten.std_mean.correction)(_stat_handler(functools.partial(_var_mean, root=True)))
register_custom_handler(aten.linalg_vector_norm.default)(_stat_handler(_vector_norm))
register_custom_handler(aten.any.default, aten.any.dim, aten.any.dims)(_stat_handler(_any))
register_custom_handler(aten.all.default, aten.all.dim, aten.all.dims)(_stat_handler(_all))
register_custom_handler(aten.logsumexp.default)(_stat_handler(_logsumexp))
