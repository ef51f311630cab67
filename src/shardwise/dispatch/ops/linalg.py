"""Linear algebra: factorizations, solves, inverses, determinants, decompositions, distances,
and the matrix helpers their formulas use (``diagonal``, ``trace``, ``cross``, ``addbmm``).

Every ``torch.linalg`` kernel works on the last two dims of its matrices (the last one of its
vectors: pivots, ``tau``, singular values) and loops over leading batch dims, broadcast between
inputs. A factorization couples every element of a matrix, so the matrix dims must be whole;
the batch dims stay sharded and each rank factorizes its own matrices, with no communication.
A replicated matrix stays replicated (every rank computes the same result).

Composite functions (``linalg.solve``, ``det``, ``svdvals``, ``pinv``, ``matrix_norm``,
``cond``, ``matrix_rank`` ...) reach shardwise as the kernels below plus products and
reductions, so they need nothing of their own (``lstsq`` and ``geqrf`` have no meta kernel:
they gather and run, see ``data_dependent.py``). ``_linalg_check_errors`` raises on a singular
or non-definite input: it reads the ``info`` codes whole, so every rank raises together.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from shardwise.dispatch.ops._common import R, aten, bind_arguments
from shardwise.dispatch.ops.core_dims import batch_axis_candidates, linear_partials
from shardwise.dispatch.ops.norm import spec_arguments
from shardwise.dispatch.ops.view import size_rewrite
from shardwise.dispatch.registry import allow_plain_indices, register_custom_handler, register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Shard
from shardwise.core.spec import DTensorSpec

# Trailing core dims of tensor arguments that are not matrices, by schema name. Tolerances of
# pinv broadcast against the batch dims: no core dims.
_CORES = {"pivots": 1, "LU_pivots": 1, "tau": 1, "atol": 0, "rtol": 0, "rcond": 0}
_MATRIX_OPS = [
    aten.linalg_cholesky_ex.default, aten.cholesky.default, aten.cholesky_inverse.default,
    aten.cholesky_solve.default, aten._cholesky_solve_helper.default,
    aten.linalg_inv_ex.default, aten.linalg_lu_factor_ex.default, aten.linalg_lu.default,
    aten.linalg_lu_solve.default, aten.lu_unpack.default,
    aten.linalg_solve_triangular.default, aten.triangular_solve.default,
    aten._linalg_det.default, aten._linalg_slogdet.default, aten._linalg_eigh.default,
    aten.linalg_eig.default, aten._linalg_eigvals.default,
    aten._linalg_svd.default, aten.linalg_qr.default, aten.linalg_householder_product.default,
    aten.linalg_matrix_exp.default, aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_solve.default,
    aten.linalg_pinv.default, aten.linalg_pinv.atol_rtol_float, aten.linalg_pinv.atol_rtol_tensor,
    aten.linalg_pinv.rcond_tensor,
    aten._cdist_forward.default, aten._cdist_backward.default, aten._euclidean_dist.default,
]


def matrix_cores(schema: OpSchema, overrides: Mapping[str, int] = {}) -> list[int]:
    """Core dims of each DTensor input: 2 for a matrix, fewer for the arguments in ``_CORES``."""
    cores = {**_CORES, **overrides}
    return [cores.get(name, 2) for name in spec_arguments(schema)]


@register_strategy(*_MATRIX_OPS)
def matrix_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Matrix dims whole, batch dims sharded alike on every operand and result."""
    return batch_axis_candidates(schema, matrix_cores(schema))


@register_strategy(aten.ormqr.default)
def ormqr_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """``ormqr(A, tau, C)``: its second argument is the vector of Householder scalars."""
    return batch_axis_candidates(schema, matrix_cores(schema, {"input2": 1}))


def _solve_cores(a: DTensorSpec, b: DTensorSpec | None) -> int:
    """B of ``solve(A, B)`` is a batch of vectors when it is 1-D or A's shape without the last dim."""
    if b is None:
        return 2
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    return 1 if vector else 2


@register_strategy(aten._linalg_solve_ex.default)
def solve_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """``solve(A, B)``: B's core dims depend on whether it is a batch of vectors."""
    a, b = (v if isinstance(v, DTensorSpec) else None for v in (schema.arg(0, "A"), schema.arg(1, "B")))
    b_cores = _solve_cores(a, b) if a is not None else 2
    cores = [2 if name == "A" else b_cores for name in spec_arguments(schema)]
    return batch_axis_candidates(schema, cores)


@register_strategy(aten._linalg_check_errors.default)
def check_errors_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """The error codes are read whole, so that every rank raises (or none does)."""
    return [(None, R)]


@register_strategy(aten.linalg_cross.default)
def cross_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """A cross product along ``dim`` (size 3, whole); other dims broadcast like a pointwise op."""
    specs = [s for s in (schema.arg(0, "self"), schema.arg(1, "other")) if isinstance(s, DTensorSpec)]
    shape = _broadcast(*[tuple(s.shape) for s in specs])
    dim = schema.kwarg("dim", -1) % len(shape)
    candidates: list[AxisCandidate] = []
    for d, size in enumerate(shape):
        if d != dim and size > 1:
            candidates.append((Shard(d),) + tuple(_broadcast_placement(s, shape, d) for s in specs))
    return candidates + [(R,) * (1 + len(specs))]


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    import torch

    return tuple(torch.broadcast_shapes(*shapes))


def _broadcast_placement(spec: DTensorSpec, shape: tuple[int, ...], d: int):
    mine = d - (len(shape) - spec.ndim)
    return Shard(mine) if mine >= 0 and spec.shape[mine] == shape[d] else R


@register_strategy(aten.trace.default)
def trace_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """The sum of the diagonal: linear, so a pending sum / average passes; otherwise whole."""
    spec = schema.specs[0]
    return [(p, p) for p in linear_partials(spec)] + [(R, R)]


# trace's backward (a composite) fills the gradient into plain zeros it builds from the global
# shape: index_fill(zeros, 0, diagonal_indices, grad). Those zeros are the same on every rank.
allow_plain_indices(aten.index_fill.int_Tensor, aten.index_fill.int_Scalar, arguments=("index",), values=("self",))


# ---------------------------------------------------------------------- diagonals
# diagonal(x, offset, dim1, dim2) drops dim1 and dim2 and appends the diagonal as the last dim.
# Its decomposition is an as_strided, which only works on whole tensors, and the backward of
# most factorizations writes into a diagonal in place: so these keep the other dims sharded.
def _kept_dims(ndim: int, dim1: int, dim2: int) -> list[int]:
    """Input dims that survive a diagonal, in output order."""
    pair = {dim1 % ndim, dim2 % ndim}
    return [d for d in range(ndim) if d not in pair]


@register_strategy(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_strategy(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    kept = _kept_dims(spec.ndim, schema.arg(2, "dim1", 0), schema.arg(3, "dim2", 1))
    candidates: list[AxisCandidate] = [(Shard(o), Shard(d)) for o, d in enumerate(kept) if spec.shape[d] > 1]
    candidates += [(p, p) for p in dict.fromkeys(spec.placements) if p.is_partial()]
    return candidates + [(R, R)]


@register_strategy(aten.diagonal_backward.default, per_axis=False)
def diagonal_backward_strategy(schema: OpSchema) -> list[Candidate]:
    """The gradient is zeros with ``grad`` on the diagonal: grad dims keep, sums pass."""
    spec = schema.specs[0]
    sizes = list(schema.arg(1, "input_sizes"))
    kept = _kept_dims(len(sizes), schema.arg(3, "dim1"), schema.arg(4, "dim2"))
    axis: list[AxisCandidate] = [(Shard(d), Shard(o)) for o, d in enumerate(kept) if sizes[d] > 1]
    axis += [(p, p) for p in linear_partials(spec)]
    axis.append((R, R))
    return [replace(c, rewrite=size_rewrite(1, "input_sizes")) for c in expand(axis, 1, spec.mesh.ndim)]


@register_strategy(aten.diagonal_scatter.default)
def diagonal_scatter_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(out; self, src): self's kept dims sharded alike with the matching dims of src."""
    spec = schema.specs[0]
    kept = _kept_dims(spec.ndim, schema.arg(3, "dim1", 0), schema.arg(4, "dim2", 1))
    src = schema.arg(1, "src")
    if not isinstance(src, DTensorSpec):
        return [(R, R)]
    return [(Shard(d), Shard(d), Shard(o)) for o, d in enumerate(kept) if spec.shape[d] > 1] + [(R, R, R)]


# ---------------------------------------------------------------------- addbmm
@register_custom_handler(aten.addbmm.default)
def addbmm(op: Any, args: tuple, kwargs: dict) -> Any:
    """``beta * self + alpha * sum_b(batch1[b] @ batch2[b])`` as the bmm and sum it is: a
    batch-sharded product then stays a pending sum until the add needs it."""
    self, batch1, batch2, beta, alpha = bind_arguments(op, args, kwargs)
    out = aten.sum.dim_IntList(aten.bmm.default(batch1, batch2), [0])
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:  # as on one device: self is ignored, NaNs included
        return out
    return aten.add.Tensor(out, self if beta == 1 else aten.mul.Tensor(self, beta))
