"""Matrix products: mm, bmm, addmm, baddbmm, mv, dot (and through them matmul, linear, einsum).

``matmul``, ``linear`` and ``einsum`` are composite: autograd turns them into views plus the ops
here before they reach the dispatcher. For ``out[b?, m, n] = A[b?, m, k] @ B[b?, k, n]`` each
mesh axis may take one of these layouts:

    batch        A S(b)  x B S(b)  -> S(b)      (bmm)
    rows         A S(m)  x B R     -> S(m)
    columns      A R     x B S(n)  -> S(n)
    contraction  A S(k)  x B S(k)  -> Partial(sum)   each rank multiplies its slice of k
    linear       A P     x B R     -> P,  A R x B P -> P   (sum and avg; never both Partial)
    replicated   A R     x B R     -> R

A bias (addmm, baddbmm) follows the output: sharded with it where it broadcasts, and Partial
where the output is Partial. A replicated bias under a Partial output would be added once per
rank; a replicated bias becomes Partial for free (only the first rank keeps it).

The contraction layout is not offered on an axis where BOTH operands would have to move: the
output would still owe a reduction of the whole result, so gathering the cheaper operand (one
collective, finished output) is the better deal. That is what makes ``S(0) x S(1)`` gather
exactly one input, the cheaper one by the cost model.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from shardwise.dispatch.ops._common import R, aten, broadcast_dim
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import Candidate, OpSchema
from shardwise.core.placement import Partial, Placement, Shard, check_placements
from shardwise.core.spec import DTensorSpec

__all__ = ["AxisRow", "axis_product", "moves_data", "linear_partial_ops", "tensor_roles", "product_rows", "matmul_candidates"]

# One layout on one mesh axis: (output placements, {input role: placement}).
AxisRow = tuple[tuple[Placement, ...], dict]

_LINEAR_OPS = ("sum", "avg")


def moves_data(spec: DTensorSpec | None, axis: int, target: Placement | None) -> bool:
    """Reaching ``target`` on ``axis`` needs a collective (a replicated source chunks for free)."""
    if spec is None or target is None:
        return False
    current = spec.placements[axis]
    return current != target and not current.is_replicate()


def linear_partial_ops(specs: Sequence[DTensorSpec | None], axis: int) -> list[str]:
    """Pending reductions on ``axis`` that a product linear in one argument can carry through."""
    found = [p.reduce_op for s in specs if s is not None for p in (s.placements[axis],) if isinstance(p, Partial)]
    return [op for op in dict.fromkeys(found) if op in _LINEAR_OPS]


def axis_product(
    roles: Sequence[tuple[str, DTensorSpec]],
    rows_for_axis: Callable[[int], list[AxisRow]],
    mesh_ndim: int,
    rewrite: Callable | None = None,
) -> list[Candidate]:
    """Every N-D candidate built from one row per mesh axis (rows may differ between axes).

    ``roles`` names the DTensor inputs in ``schema.specs`` order; a row's dict gives each role's
    placement (a missing role: leave as is). Candidates whose output would mix Partial reduce
    ops are dropped (no such layout exists).
    """
    per_axis = [rows_for_axis(axis) for axis in range(mesh_ndim)]
    candidates = []
    for combo in itertools.product(*per_axis):
        n_out = len(combo[0][0])
        outputs = tuple(tuple(row[0][i] for row in combo) for i in range(n_out))
        if not all(_valid(out) for out in outputs):
            continue
        inputs = []
        for role, _ in roles:
            column = tuple(row[1].get(role) for row in combo)
            inputs.append(None if any(p is None for p in column) else column)
        candidates.append(Candidate(tuple(inputs), outputs, rewrite))
    return candidates


def _valid(placements: tuple[Placement, ...]) -> bool:
    try:
        check_placements(placements)
    except ValueError:
        return False
    return True


def tensor_roles(schema: OpSchema, names: Sequence[str]) -> list[tuple[str, DTensorSpec]]:
    """(role, spec) for each positional argument that is a DTensor, in ``schema.specs`` order."""
    return [(name, value) for name, value in zip(names, schema.args) if isinstance(value, DTensorSpec)]


# ---------------------------------------------------------------------- the product layouts
def product_rows(
    a: DTensorSpec,
    b: DTensorSpec,
    bias: DTensorSpec | None,
    axis: int,
    a_dims: tuple[int | None, int, int | None],
    b_dims: tuple[int | None, int, int | None],
    out_shape: tuple[int, ...],
) -> list[AxisRow]:
    """Layouts of one mesh axis for ``out = A @ B (+ bias)``.

    ``a_dims`` = (batch, contracted, row) dims of A, ``b_dims`` = (batch, contracted, column)
    dims of B; None where the operand has no such dim. Output dims are [batch?, row?, col?].
    """
    a_batch, a_k, a_m = a_dims
    b_batch, b_k, b_n = b_dims
    present = [name for name, d in (("b", a_batch), ("m", a_m), ("n", b_n)) if d is not None]
    out_dim = {name: i for i, name in enumerate(present)}

    def bias_at(d: int) -> Placement | None:
        return broadcast_dim(bias, out_shape, d) if bias is not None else None

    rows: list[AxisRow] = []
    if a_batch is not None:
        d = out_dim["b"]
        rows.append(((Shard(d),), {"a": Shard(a_batch), "b": Shard(b_batch), "bias": bias_at(d)}))
    if a_m is not None:
        d = out_dim["m"]
        rows.append(((Shard(d),), {"a": Shard(a_m), "b": R, "bias": bias_at(d)}))
    if b_n is not None:
        d = out_dim["n"]
        rows.append(((Shard(d),), {"a": R, "b": Shard(b_n), "bias": bias_at(d)}))
    if not (moves_data(a, axis, Shard(a_k)) and moves_data(b, axis, Shard(b_k))):
        rows.append(((Partial(),), {"a": Shard(a_k), "b": Shard(b_k), "bias": Partial()}))
    for op in linear_partial_ops((a, b, bias), axis):
        p = Partial(op)
        rows.append(((p,), {"a": p, "b": R, "bias": p}))
        rows.append(((p,), {"a": R, "b": p, "bias": p}))
    rows.append(((R,), {"a": R, "b": R, "bias": R}))
    return rows


def matmul_candidates(schema: OpSchema, has_bias: bool, batched: bool) -> list[Candidate]:
    """Candidates of mm / bmm / mv / dot and their bias-adding forms."""
    names = ("bias", "a", "b") if has_bias else ("a", "b")
    roles = tensor_roles(schema, names)
    specs = dict(roles)
    offset = 1 if has_bias else 0
    a_spec, b_spec = schema.args[offset], schema.args[offset + 1]
    a_dims, b_dims, out_shape = _operand_dims(a_spec.shape, b_spec.shape, batched)
    return axis_product(
        roles,
        lambda axis: product_rows(a_spec, b_spec, specs.get("bias"), axis, a_dims, b_dims, out_shape),
        schema.mesh.ndim,
    )


def _operand_dims(a_shape, b_shape, batched: bool):
    """(batch, k, m) dims of A, (batch, k, n) dims of B, and the output shape."""
    if batched:
        return (0, 2, 1), (0, 1, 2), (a_shape[0], a_shape[1], b_shape[2])
    a_dims = (None, 1, 0) if len(a_shape) == 2 else (None, 0, None)
    b_dims = (None, 0, 1) if len(b_shape) == 2 else (None, 0, None)
    out_shape = tuple(s for s, d in ((a_shape[0], a_dims[2]), (b_shape[-1], b_dims[2])) if d is not None)
    return a_dims, b_dims, out_shape


# ---------------------------------------------------------------------- registrations
@register_strategy(aten.mm.default, aten.mv.default, aten.dot.default, per_axis=False)
def mm_candidates(schema: OpSchema) -> list[Candidate]:
    return matmul_candidates(schema, has_bias=False, batched=False)


@register_strategy(aten.bmm.default, per_axis=False)
def bmm_candidates(schema: OpSchema) -> list[Candidate]:
    return matmul_candidates(schema, has_bias=False, batched=True)


@register_strategy(aten.addmm.default, aten.addmv.default, per_axis=False)
def addmm_candidates(schema: OpSchema) -> list[Candidate]:
    return matmul_candidates(schema, has_bias=True, batched=False)


@register_strategy(aten.baddbmm.default, per_axis=False)
def baddbmm_candidates(schema: OpSchema) -> list[Candidate]:
    return matmul_candidates(schema, has_bias=True, batched=True)
