"""Sharding strategies as data, and the one place that chooses among them by cost.

An op's strategy lists candidate layouts: for each DTensor input the placements it must be in,
and for each tensor output the placements it comes out in. Most ops treat mesh axes
independently, so they list candidates for ONE axis (``AxisCandidate``: output placements then
input placements) and ``expand`` builds every N-D combination. ``choose`` scores each candidate
by the bytes needed to move the inputs there (the redistribute planner's cost) and keeps the
cheapest; ties go to the earlier candidate, so every rank picks the same one.

Looking past the op: a Partial output is a reduction left for later, and later is rarely
cheaper (every consumer that needs the value pays it again on its own copy). ``pending_reduction``
charges each candidate the least its Partial outputs will cost to reduce (a reduce_scatter
of the output) on the axes where an input is already Partial, so that an op whose Partial
input can be reduced now for no more bytes does so, instead of handing the pending sum on to
consumers that would each reduce it again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch  # noqa: F401  (the look-ahead scoring being added uses it)

from shardwise.dispatch import walk
from shardwise.core.placement import Placement, Replicate, check_placements
from shardwise.redistribute.execute import plan_for
from shardwise.core.spec import DTensorSpec

__all__ = ["OpSchema", "Candidate", "AxisCandidate", "expand", "choose", "replicate_all", "pending_reduction", "partial_axes"]

# One mesh axis: (output placements..., input placements...); None = not a DTensor / any.
AxisCandidate = tuple


@dataclass(frozen=True, slots=True)
class OpSchema:
    """An op call as strategies see it: DTensor arguments replaced by their specs.

    ``args`` / ``kwargs`` keep the call's structure (lists stay lists, as tuples); ``specs`` are
    the DTensor specs in flattened argument order, the order candidates list inputs in.
    """

    op: Any
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]
    specs: tuple[DTensorSpec, ...]

    @property
    def mesh(self):
        return self.specs[0].mesh

    def kwarg(self, name: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(name, default)

    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        """Positional argument ``index``, or keyword ``name``, or ``default``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwarg(name, default) if name else default


@dataclass(frozen=True, slots=True)
class Candidate:
    """Target placements of every DTensor input and the placements of every tensor output.

    ``rewrite`` adapts non-tensor arguments to the local blocks (a view's size becomes the
    local size); it receives (local args, local kwargs, output specs) and returns new ones.
    """

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...] | None, ...]
    rewrite: Callable | None = field(default=None, compare=False)


def count_specs(value: Any) -> int:
    """DTensors an argument stands for: its spec leaves (1 for a spec, the specs in a list)."""
    return sum(isinstance(v, DTensorSpec) for v in walk.leaves(value))


def expand(
    axis_candidates: Sequence[AxisCandidate], num_outputs: int, mesh_ndim: int
) -> list[Candidate]:
    """Every N-D candidate made of one per-axis candidate per mesh axis."""
    candidates = []
    for combo in itertools.product(axis_candidates, repeat=mesh_ndim):
        width = len(combo[0])
        columns = [tuple(c[i] for c in combo) for i in range(width)]
        columns = [None if any(p is None for p in col) else col for col in columns]
        candidates.append(Candidate(tuple(columns[num_outputs:]), tuple(columns[:num_outputs])))
    return candidates


def replicate_all(schema: OpSchema, num_outputs: int) -> Candidate:
    """Gather every input; every tensor output is replicated."""
    rep = (Replicate(),) * schema.mesh.ndim
    return Candidate(tuple(rep for _ in schema.specs), tuple(rep for _ in range(num_outputs)))


def input_cost(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> float:
    """Bytes the busiest rank sends to bring ``spec`` to ``target`` (inf if not a valid layout)."""
    if target is None or target == spec.placements:
        return 0
    try:
        check_placements(target)
        moved = spec.with_placements(target)
    except (TypeError, ValueError, IndexError):
        return float("inf")
    return plan_for(spec, moved).bytes_per_rank


def choose(schema: OpSchema, candidates: Sequence[Candidate],
           extra: Callable[[Candidate], float] | None = None) -> Candidate | None:
    """The candidate whose inputs are cheapest to reach; None if none is valid.

    Cost is bytes moved (plus ``extra(candidate)`` bytes, when given: what happens after the
    op), then the number of mesh axes whose placement changes (a free local chunk still beats
    nothing only if it is needed), then the candidate's position in the list.
    """
    best, best_cost = None, (float("inf"), 0)
    for candidate in candidates:
        if len(candidate.inputs) != len(schema.specs):
            raise ValueError(
                f"strategy for {schema.op} returned {len(candidate.inputs)} input layouts for "
                f"{len(schema.specs)} DTensor inputs"
            )
        moved = sum(input_cost(s, t) for s, t in zip(schema.specs, candidate.inputs))
        if extra is not None:
            moved += extra(candidate)
        changes = sum(changed_axes(s, t) for s, t in zip(schema.specs, candidate.inputs))
        if (moved, changes) < best_cost:
            best, best_cost = candidate, (moved, changes)
    return best


def changed_axes(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> int:
    """Mesh axes whose placement differs between ``spec`` and ``target`` (``choose``'s tie-break)."""
    if target is None:
        return 0
    return sum(a != b for a, b in zip(spec.placements, target))


def pending_reduction(candidate: Candidate, outputs: Sequence[Any], mesh_shape: Sequence[int],
                      owed: Sequence[bool] | None = None) -> float:
    """Bytes the busiest rank will send to reduce the candidate's Partial outputs, at least.

    For each tensor output (``outputs``: the op's outputs on meta tensors of the global shapes)
    whose placements hold Partial axes of total size ``n``: its local block's bytes times
    ``(n - 1) / n``, what a reduce_scatter over those axes sends, the cheapest way to make the
    value whole somewhere. ``owed[axis]``: only Partial axes where an input is already Partial
    count (the reduction is owed either way: now or after the op); a Partial the op makes
    from values (a matmul over a sharded inner dim, a sum over a sharded dim) is the op's
    communication-free form and stays free. None counts every axis.
    """
    total = 0.0
    for placements, out in zip(candidate.outputs, outputs):
        if placements is None or not isinstance(out, torch.Tensor):
            continue
        partial = sharded = 1
        for axis, (placement, size) in enumerate(zip(placements, mesh_shape)):
            if placement.is_partial() and (owed is None or owed[axis]):
                partial *= size
            elif placement.is_shard():
                sharded *= size
        if partial > 1:
            total += out.numel() * out.element_size() / sharded * (partial - 1) / partial
    return total


def partial_axes(specs: Sequence[DTensorSpec]) -> tuple[bool, ...]:
    """Per mesh axis: whether some input is Partial on it (a reduction already owed)."""
    return tuple(any(s.placements[a].is_partial() for s in specs) for a in range(specs[0].mesh.ndim))
