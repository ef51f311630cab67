"""Sharding strategies as data, and the one place that chooses among them by cost.

An op's strategy lists candidate layouts: for each DTensor input the placements it must be in,
and for each tensor output the placements it comes out in. Most ops treat mesh axes
independently, so they list candidates for ONE axis (``AxisCandidate``: output placements then
input placements) and ``expand`` builds every N-D combination. ``choose`` scores each candidate
by the predicted time of moving the inputs there (the redistribute plans' ``predicted_s``,
priced by ``shardwise.cost`` on the active hardware profile) and keeps the fastest; ties go to
the earlier candidate, so every rank picks the same one. Scoring runs once per op signature,
on the dispatcher's cache miss.

Looking past the op: a Partial output is a reduction left for later, and later is rarely
cheaper (every consumer that needs the value pays it again on its own copy). ``pending_reduction``
charges each candidate the least its Partial outputs will cost to reduce (a reduce_scatter
of the output) on the axes where an input is already Partial, so that an op whose Partial
input can be reduced now for no more time does so, instead of handing the pending sum on to
consumers that would each reduce it again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from shardwise.cost import Collective, Link, active_hardware, axis_links, collective_time
from shardwise.dispatch import walk
from shardwise.core.placement import Placement, Replicate, check_placements
from shardwise.redistribute.execute import plan_for
from shardwise.core.spec import DTensorSpec

__all__ = ["OpSchema", "Candidate", "AxisCandidate", "expand", "choose", "replicate_all", "pending_reduction", "partial_axes",
           "input_cost", "input_bytes"]

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
    """Predicted seconds to bring ``spec`` to ``target`` (inf if not a valid layout)."""
    moved = _moved(spec, target)
    return 0.0 if moved is None else float("inf") if moved is _INVALID else plan_for(spec, moved).predicted_s


def input_bytes(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> float:
    """Bytes the busiest rank sends to bring ``spec`` to ``target`` (inf if not a valid
    layout): what ``debug.explain`` prints beside the time."""
    moved = _moved(spec, target)
    return 0 if moved is None else float("inf") if moved is _INVALID else plan_for(spec, moved).busiest_bytes


_INVALID = object()


def _moved(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> Any:
    """``spec`` laid out as ``target``; None when nothing moves, ``_INVALID`` when ``target``
    is not a layout of it."""
    if target is None or target == spec.placements:
        return None
    try:
        check_placements(target)
        return spec.with_placements(target)
    except (TypeError, ValueError, IndexError):
        return _INVALID


def choose(schema: OpSchema, candidates: Sequence[Candidate],
           extra: Callable[[Candidate], float] | None = None) -> Candidate | None:
    """The candidate whose inputs are fastest to reach; None if none is valid.

    Cost is the predicted seconds of the inputs' redistributions (plus ``extra(candidate)``
    seconds, when given: what happens after the op), then the number of mesh axes whose
    placement changes (a free local chunk still beats nothing only if it is needed), then the
    candidate's position in the list.
    """
    best, best_cost = None, (float("inf"), 0)
    for candidate in candidates:
        if len(candidate.inputs) != len(schema.specs):
            raise ValueError(
                f"strategy for {schema.op} returned {len(candidate.inputs)} input layouts for "
                f"{len(schema.specs)} DTensor inputs"
            )
        seconds = sum(input_cost(s, t) for s, t in zip(schema.specs, candidate.inputs))
        if extra is not None:
            seconds += extra(candidate)
        changes = sum(changed_axes(s, t) for s, t in zip(schema.specs, candidate.inputs))
        if (seconds, changes) < best_cost:
            best, best_cost = candidate, (seconds, changes)
    return best


def changed_axes(spec: DTensorSpec, target: tuple[Placement, ...] | None) -> int:
    """Mesh axes whose placement differs between ``spec`` and ``target`` (``choose``'s tie-break)."""
    if target is None:
        return 0
    return sum(a != b for a, b in zip(spec.placements, target))


def pending_reduction(candidate: Candidate, outputs: Sequence[Any], mesh_shape: Sequence[int],
                      owed: Sequence[bool] | None = None) -> float:
    """Predicted seconds to reduce the candidate's Partial outputs, at least.

    For each tensor output (``outputs``: the op's outputs on meta tensors of the global shapes)
    whose placements hold Partial axes of total size ``n``: a reduce_scatter over those axes of
    its local block (``(n - 1) / n`` of its bytes sent by each rank), the cheapest way to make
    the value whole somewhere, priced by ``shardwise.cost``. ``owed[axis]``: only Partial axes
    where an input is already Partial count (the reduction is owed either way: now or after
    the op); a Partial the op makes from values (a matmul over a sharded inner dim, a sum over
    a sharded dim) is the op's communication-free form and stays free. None counts every axis.
    """
    hardware = active_hardware()
    links = axis_links(mesh_shape, hardware.gpus_per_node)
    total = 0.0
    for placements, out in zip(candidate.outputs, outputs):
        if placements is None or not isinstance(out, torch.Tensor):
            continue
        partial = sharded = 1
        link = Link.INTRA_NODE
        for axis, (placement, size) in enumerate(zip(placements, mesh_shape)):
            if placement.is_partial() and (owed is None or owed[axis]):
                partial *= size
                link = Link.INTER_NODE if links[axis] is Link.INTER_NODE else link
            elif placement.is_shard():
                sharded *= size
        if partial > 1:
            sent = out.numel() * out.element_size() / sharded * (partial - 1) / partial
            total += collective_time(Collective.REDUCE_SCATTER, int(sent), partial, link, hardware)
    return total


def partial_axes(specs: Sequence[DTensorSpec]) -> tuple[bool, ...]:
    """Per mesh axis: whether some input is Partial on it (a reduction already owed)."""
    return tuple(any(s.placements[a].is_partial() for s in specs) for a in range(specs[0].mesh.ndim))
