"""Sharding strategies as data, and the one place that chooses among them by cost.

An op's strategy lists candidate layouts: for each DTensor input the placements it must be in,
and for each tensor output the placements it comes out in. Most ops treat mesh axes
independently, so they list candidates for ONE axis (``AxisCandidate``: output placements then
input placements) and ``expand`` builds every N-D combination. ``choose`` scores each candidate
by the bytes needed to move the inputs there (the redistribute planner's cost) and keeps the
cheapest; ties go to the earlier candidate, so every rank picks the same one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch  # noqa: F401  (the look-ahead scoring being added uses it)

from shardwise.placement import Placement, Replicate, check_placements
from shardwise.redistribute.execute import plan_for
from shardwise.spec import DTensorSpec

__all__ = ["OpSchema", "Candidate", "AxisCandidate", "expand", "choose", "replicate_all"]

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
    """DTensors an argument stands for: 1 for a spec, the specs in a list, else 0."""
    if isinstance(value, DTensorSpec):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(isinstance(v, DTensorSpec) for v in value)
    return 0


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
        changes = sum(_changed_axes(s, t) for s, t in zip(schema.specs, candidate.inputs))
        if (moved, changes) < best_cost:
            best, best_cost = candidate, (moved, changes)
    return best


def _changed_axes(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> int:
    if target is None:
        return 0
    return sum(a != b for a, b in zip(spec.placements, target))
