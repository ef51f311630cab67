"""The redistribute planner: a pure function from (source layout, target layout) to steps.

A layout is one placement per mesh axis. A step changes ONE axis with ONE collective:

    Shard(d)  -> Replicate   all_gather        Replicate -> Shard(d)  local chunk (free)
    Partial   -> Replicate   all_reduce        Partial   -> Shard(d)  reduce_scatter
    Shard(d)  -> Shard(e)    all_to_all        Replicate -> Partial   partition (free)

Axes cut the tensor in order (axis 0 first), so a step on axis i that gathers or cuts tensor
dim d is only legal when no later axis also cuts d: otherwise this rank's block is a piece of
a piece and the step would stitch the wrong rows together. The planner searches the small
graph of layouts (Dijkstra) for the path with the fewest bytes sent by the busiest rank, ties
broken by fewer steps and then by a fixed order, so every rank derives the same plan.

One step may change several axes: Partial on axes {a, b, ...} -> Replicate by ONE all_reduce
over their flattened group, when the caller says that group exists (``flattened``). Two
all_reduces over 2 ranks each send twice the data of one over 4; the merged step wins.

Axis by axis, a block that sits on a rank of another axis travels twice, and ranks that hold
their target block still send. So the planner also weighs an *exchange* (``exchange.py``):
one all_to_all, with per-peer counts, over the flattened group of the axes involved, that
sends every rank exactly what it lacks. It starts from the source, from a layout the search
reaches by reducing the source's Partial axes, or (a Partial(sum) source) it reduces on the way
(a reducing exchange), possibly into a fully sharded refinement of the target first. The plan
sent is the one with the fewest bytes over all ranks, then the fewest for the busiest rank
(``Plan.sends`` counts every rank), then the axis-by-axis one.

A Partial source may also be resolved in one *reduce-forward* step (``reduce_forward.py``):
each element's contributions reach a rank that needs it, which reduces and forwards the value
(two all_to_alls). It sends the least total a full reduction can.

An axis Partial in both layouts with the same op (the only op of either) may also stay
pending (``pending.py``): each rank keeps its own contribution there, and the other axes are
planned as a transition of their own, run side by side in every slice of the kept axes
(exchange and reduce-forward steps carry ``kept``).

Every candidate is scored the same way: bytes sent by all ranks (an all_reduce at each rank's
own share, ``collective_bytes``), then by the busiest rank, then collectives issued; the lowest
wins, ties to the axis-by-axis plan, among the candidates that no other candidate makes slower
(``_choose``): a plan is dropped when another's busiest rank sends at most as much in at most as
many collectives, one of the two strictly fewer. Such a plan is no faster on any network whose
time is a latency per collective plus the busiest rank's bytes over a bandwidth, and slower on
most; the bytes it saves in all would be paid in time. Total first otherwise: the two bounds of
``bound.py`` cannot always be met together for Partial sources, and the total is what the
network as a whole carries (what crosses oversubscribed links). Measured with the total first
and no filter: ``benchmarks/redistribute.py --meshes 2x2x2 --shapes 8x4,7x5 --sample 0`` had
shardwise's busiest rank above torch's in 19 of 5,360 transitions, and on 1024x1024
(P, P, R) -> (R, P, R) reduce-forward (24,576 KiB in all, 4,096 KiB busiest, two all_to_alls)
took 38.7 ms where torch's one all_reduce (32,768 KiB, 4,096 KiB) took 19.8 ms. With the filter
the same run has it above torch in 1 (a one-round exchange at 112 B against torch's relay of
96 B over three steps, 448 B in all against 768 B, 0.45x torch's time), never above torch in
bytes in all, and the total at the bound in 7,821 of 8,064 transitions. With every
flattened group available the chosen plan meets the total bound on every transition without a
Partial source, and its busiest rank meets its bound too; bound.py has the Partial figures.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from shardwise.comm.bytes import all_reduce_sent
from shardwise.core.placement import Partial, Placement, Replicate, Shard
from shardwise.redistribute.bound import coordinates, reducing_total
from shardwise.redistribute.exchange import plan_exchange, reducible
from shardwise.redistribute.pending import drop, insert, kept_axes, rest_axes, sub_groups, widen
from shardwise.redistribute.reduce_forward import forwardable, plan_reduce_forward
from shardwise.core.spec import local_shape_and_offset

__all__ = ["StepKind", "Step", "Plan", "plan_redistribute", "plan_candidates"]


class StepKind(str, enum.Enum):
    """What a plan step does on its axis (or axes). A ``str`` so that it reads, compares and
    prints as the collective's name (``"all_gather"``), as CommDebugMode names them."""

    RELABEL = "relabel"  # an axis of one rank: every layout of it holds the same data
    LOCAL_CHUNK = "local_chunk"  # Replicate -> Shard: keep this rank's piece, no communication
    PARTITION = "partition"  # Replicate -> Partial: this rank's share of the value, no communication
    RELAYOUT = "relayout"  # several axes re-labelled at once, nothing moves
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"

    def __str__(self) -> str:
        return self.value


Layout = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Step:
    """Change mesh ``axis`` from ``src`` to ``dst`` with ``collective``.

    ``bytes_per_rank`` is what the busiest rank of the axis sends. ``flattened`` (two or more
    axes, ``axis`` the first) marks a reduction over all of them at once, by their flattened
    group; otherwise it is empty. An exchange (``target`` set: the whole layout after it)
    re-lays several axes at once by one all_to_all over ``axes``' (flattened) group. A
    reduce-forward step (``reduce_forward.py``) is an exchange of two all_to_alls, ``rounds``
    the busiest rank's bytes in each (a round where no rank sends is skipped); otherwise empty.
    ``kept``: mesh axes Partial before and after whose reduction stays pending (``pending.py``);
    an exchange step then runs its schedule over the mesh without them, in every slice at once
    (each rank keeps its own contribution on them). The executor can run a reduce-forward step
    that way too, but the planner does not offer one yet (``_kept_plan``).
    """

    axis: int
    src: Placement
    dst: Placement
    collective: StepKind
    bytes_per_rank: int
    flattened: tuple[int, ...] = ()
    target: Layout = ()
    rounds: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()

    @property
    def axes(self) -> tuple[int, ...]:
        """Every mesh axis this step changes."""
        return self.flattened or (self.axis,)

    def apply(self, layout: Layout) -> Layout:
        """``layout`` after this step."""
        if self.target:
            return self.target
        out = list(layout)
        for axis in self.axes:
            out[axis] = self.dst
        return tuple(out)

    def __str__(self) -> str:
        where = f"axes {'+'.join(map(str, self.flattened))}" if self.flattened else f"axis {self.axis}"
        if self.kept:
            where += f" (axes {'+'.join(map(str, self.kept))} kept pending)"
        if self.rounds:
            return f"{where}: reduce at consumers, then forward, to ({','.join(map(str, self.target))}) by 2 all_to_all ({'+'.join(map(str, self.rounds))} B)"
        if self.target:
            return f"{where}: exchange to ({','.join(map(str, self.target))}) by {self.collective} ({self.bytes_per_rank} B)"
        return f"{where}: {self.src} -> {self.dst} by {self.collective} ({self.bytes_per_rank} B)"


@dataclass(frozen=True, slots=True)
class Plan:
    """Ordered steps; ``bytes_per_rank`` sums each step's busiest rank (an upper bound on any one
    rank). ``sends``: bytes each rank sends over the whole plan (row-major mesh coordinates)."""

    steps: tuple[Step, ...]
    sends: tuple[int, ...] = ()
    exact_sends: tuple[int, ...] = ()

    @property
    def bytes_per_rank(self) -> int:
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def total_bytes(self) -> int:
        """Bytes sent by all ranks together."""
        return sum(self.sends)

    @property
    def exact_total_bytes(self) -> int:
        """Bytes sent by all ranks together with each all_reduce at every rank's own figure
        (``collective_bytes.all_reduce_sent``: 2 (n - 1) numel in all). ``sends`` and
        ``total_bytes`` count an all_reduce as ``comm`` does, at its busiest rank's figure on
        every rank, which exceeds that by a few elements when n does not divide the block;
        ``redistribute/bound.py``'s total is compared with this one."""
        return sum(self.exact_sends)

    @property
    def busiest_bytes(self) -> int:
        """Bytes sent by the rank that sends the most over the whole plan."""
        return max(self.sends, default=0)

    @property
    def collectives(self) -> list[str]:
        """Names of the collectives that move data, in order (free local steps left out)."""
        return [kind for kind, _ in self.issued]

    @property
    def issued(self) -> list[tuple[StepKind, int]]:
        """Every collective the plan issues with its busiest rank's bytes, in order (a
        reduce-forward step's rounds one by one)."""
        return _issued(self.steps)

    def __str__(self) -> str:
        return "; ".join(map(str, self.steps)) or "no-op"


def _issued(steps: Sequence[Step]) -> list[tuple[StepKind, int]]:
    """``Plan.issued`` of ``steps``: a reduce-forward step's rounds one by one, free steps left
    out, a round where no rank sends skipped."""
    out = []
    for s in steps:
        if s.rounds:
            out += [(s.collective, b) for b in s.rounds if b]
        elif s.collective not in _FREE:
            out.append((s.collective, s.bytes_per_rank))
    return out


_FREE = (StepKind.LOCAL_CHUNK, StepKind.PARTITION, StepKind.RELABEL, StepKind.RELAYOUT)
# Exchange routes are planned only on meshes of at most this many ranks: ``plan_exchange``
# compares every holder class with every receiver (quadratic in the ranks; seconds per plan at
# 64 ranks, minutes at 1,024), while axis-by-axis steps are priced in time independent of it.
EXCHANGE_MAX_RANKS = 32


def plan_redistribute(
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    flattened: Sequence[Sequence[int]] = (),
) -> Plan:
    """The cheapest sequence of steps from layout ``src`` to layout ``dst``.

    Args:
        global_shape: the logical tensor's shape (Shard dims already non-negative).
        itemsize: bytes per element.
        mesh_shape: ranks along each mesh axis.
        src, dst: one placement per axis.
        flattened: sets of axes (ascending) whose flattened process group exists: Partials on
            those axes may be reduced together by one all_reduce.

    Raises:
        ValueError: no path exists (cannot happen for valid layouts; kept as a guard).
    """
    return _plan(tuple(global_shape), itemsize, tuple(mesh_shape), tuple(src), tuple(dst), _groups(flattened))


def _groups(flattened: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``flattened`` in one canonical order (the plan cache's key)."""
    return tuple(sorted(tuple(sorted(g)) for g in flattened))


@lru_cache(maxsize=4096)
def _plan(shape: tuple, itemsize: int, mesh_shape: tuple, src: Layout, dst: Layout, flattened: tuple = ()) -> Plan:
    if src == dst:
        return Plan((), (0,) * math.prod(mesh_shape), (0,) * math.prod(mesh_shape))
    ctx = _Context(shape, itemsize, mesh_shape, _partial_ops(src, dst), flattened)
    candidates, scores = _candidates(ctx, src, dst)
    return ctx.priced(src, candidates[_choose(scores)])


def plan_candidates(global_shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], src: Sequence[Placement],
                    dst: Sequence[Placement], flattened: Sequence[Sequence[int]] = ()) -> list[Plan]:
    """Every plan ``plan_redistribute`` chooses among (same arguments), the axis-by-axis one
    first; for tests and tools that check the choice (``_choose``)."""
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return [plan_redistribute(global_shape, itemsize, mesh_shape, src, dst, flattened)]
    ctx = _Context(tuple(global_shape), itemsize, tuple(mesh_shape), _partial_ops(src, dst), _groups(flattened))
    return [ctx.priced(src, steps) for steps in _candidates(ctx, src, dst)[0]]


Score = tuple[int, int, int]  # bytes sent by all ranks, by the busiest, collectives issued


def _candidates(ctx: "_Context", src: Layout, dst: Layout) -> tuple[list[tuple[Step, ...]], list[Score]]:
    """The plans weighed, with their scores: the axis-by-axis path, the exchange routes, the
    reduce-forward step and the plan keeping reductions pending (each where it applies).

    Reduce-forward is weighed only when it sends no more bytes in all than the plan chosen from
    the others: saving bytes in all is what it is for, and its schedule (a local search) costs
    more to plan than all the others together; its total is known without planning it."""
    paths = _search(ctx, src)
    if dst not in paths:
        raise ValueError(f"no redistribute path from {list(src)} to {list(dst)} for shape {list(ctx.shape)}")
    candidates = [paths[dst], *_exchange_routes(ctx, src, dst, paths)]
    pending = _kept_plan(ctx.shape, ctx.itemsize, ctx.mesh_shape, src, dst, ctx.flattened)
    if pending is not None:
        candidates.append(pending)
    scores = [ctx.score(src, steps) for steps in candidates]
    beat = scores[_choose(scores)][0]
    weigh = ctx.forward_applies(src, dst) and ctx.reducing_total(src, dst) <= beat
    forward = ctx.reduce_forward(src, dst) if weigh else None
    if forward is not None:  # before the kept plan: ties go to the earlier candidate
        at = len(candidates) - (pending is not None)
        candidates.insert(at, (forward,))
        scores.insert(at, ctx.score(src, (forward,)))
    return candidates, scores


def _choose(scores: Sequence[Score]) -> int:
    """The index of the plan with the fewest bytes in all, then for the busiest rank, then the
    fewest collectives (ties to the earlier candidate), among those no other candidate makes
    slower.

    A plan is dropped when another one's busiest rank sends at most as much in at most as many
    collectives (one of the two strictly fewer): under any time model of a latency per
    collective plus the busiest rank's bytes over a bandwidth it is never faster and usually
    slower, so the bytes it saves in all would be paid in time."""
    kept = [i for i, s in enumerate(scores) if not any(_dominates(o, s) for o in scores)]
    return min(kept, key=lambda i: (scores[i], i))


def _dominates(a: Score, b: Score) -> bool:
    """Whether ``a``'s busiest rank sends at most ``b``'s bytes in at most as many collectives,
    one of the two strictly fewer (totals aside)."""
    return a[1] <= b[1] and a[2] <= b[2] and a[1:] != b[1:]


def _kept_plan(shape: tuple, itemsize: int, mesh_shape: tuple, src: Layout, dst: Layout,
               flattened: tuple) -> tuple[Step, ...] | None:
    """The plan that keeps the reductions of ``pending.kept_axes`` pending: the sub-plan over
    the other axes, its steps lifted to the full mesh (None when no axis may be kept)."""
    kept = kept_axes(mesh_shape, src, dst)
    if not kept:
        return None
    rest = rest_axes(len(mesh_shape), kept)
    held = tuple(src[a] for a in kept)
    sub = _plan(shape, itemsize, drop(mesh_shape, kept), drop(src, kept), drop(dst, kept),
                sub_groups(flattened, kept, len(mesh_shape)))
    if any(s.rounds for s in sub.steps):  # a kept reduce-forward: no transition of up to 3 axes
        return None  # picks one, so it has never run on real ranks; not offered until it has
    steps = []
    for s in sub.steps:
        group: tuple[int, ...] | None = tuple(rest[a] for a in s.flattened)
        if group and s.target:  # an all_to_all: may run on a group that spans the kept axes
            group = widen(group, flattened, kept, mesh_shape)
        elif group and group not in flattened:  # a reduction over the other axes only
            group = None
        if group is None:
            return None
        steps.append(Step(group[0] if group else rest[s.axis], s.src, s.dst, s.collective, s.bytes_per_rank, group,
                          insert(s.target, kept, held) if s.target else (), s.rounds, kept if s.target else ()))
    return tuple(steps)


def _exchange_routes(ctx: "_Context", src: Layout, dst: Layout, paths: dict) -> list[tuple[Step, ...]]:
    """Plans that end in an exchange: from the source, from a reduced source, or (Partial(sum)
    source) a reducing exchange straight to the target or into a fully sharded refinement of it
    followed by a value exchange."""
    routes = []
    for via in _exchange_starts(ctx, src):
        step = ctx.exchange(via, dst) if via in paths else None
        if step is not None:
            routes.append(paths[via] + (step,))
    if any(p.is_partial() for p in src) and reducible(src, dst):
        step = ctx.exchange(src, dst)
        if step is not None:
            routes.append((step,))
        for d in range(len(ctx.shape)):
            cut = tuple(p if p.is_shard() else Shard(d) for p in dst)
            first = ctx.exchange(src, cut)
            second = ctx.exchange(cut, dst)
            if first is not None and second is not None:
                routes.append((first, second))
    return routes


@lru_cache(maxsize=1024)
def _search(ctx: "_Context", src: Layout) -> dict:
    """Cheapest axis-by-axis path from ``src`` to every layout (Dijkstra on the busiest rank's
    bytes, ties broken by fewer steps, then a fixed order)."""
    # (bytes, steps, tie-break key, layout, path)
    frontier: list = [(0, 0, "", src, ())]
    paths: dict = {}
    while frontier:
        cost, n_steps, key, layout, path = heapq.heappop(frontier)
        if layout in paths:
            continue
        paths[layout] = path
        for step in _moves(ctx, layout):
            nxt = step.apply(layout)
            if nxt not in paths:
                entry = (cost + step.bytes_per_rank, n_steps + 1, key + "|" + str(step), nxt, path + (step,))
                heapq.heappush(frontier, entry)
    return paths


def _exchange_starts(ctx: "_Context", src: Layout) -> list[Layout]:
    """Layouts an exchange may start from: the source with each Partial axis reduced to
    Replicate or to a Shard (the source itself when it has none)."""
    options = [[p] if not p.is_partial() else [Replicate(), *(Shard(d) for d in range(len(ctx.shape)))] for p in src]
    return [tuple(c) for c in itertools.product(*options)]


@lru_cache(maxsize=65536)
def _moves(ctx: "_Context", layout: Layout) -> tuple[Step, ...]:
    """Edges out of ``layout``; they depend on the tensor and mesh, not on the endpoints."""
    return tuple(ctx.moves(layout))


def _partial_ops(src: Layout, dst: Layout) -> tuple[Partial, ...]:
    return tuple(sorted({p for p in src + dst if isinstance(p, Partial)}, key=lambda p: p.reduce_op))


@dataclass(frozen=True, slots=True)
class _Context:
    shape: tuple
    itemsize: int
    mesh_shape: tuple
    partials: tuple[Partial, ...]
    flattened: tuple[tuple[int, ...], ...] = ()

    def candidates(self) -> list[Placement]:
        """Every placement one axis may take along the way."""
        return [Replicate(), *self.partials, *(Shard(d) for d in range(len(self.shape)))]

    def moves(self, layout: Layout) -> list[Step]:
        steps = []
        for axis, current in enumerate(layout):
            for target in self.candidates():
                step = self.step(layout, axis, current, target)
                if step is not None:
                    steps.append(step)
        return steps + self.merged_reductions(layout)

    def exchange(self, layout: Layout, dst: Layout) -> Step | None:
        """The one-all_to_all step from ``layout`` (no Partial) to ``dst``, or None when it moves
        nothing or needs a flattened group that does not exist."""
        if layout == dst or len({p for p in dst if p.is_partial()}) > 1 or not reducible(layout, dst):
            return None  # mixed reductions: the order of partitioning matters, leave it to steps
        if math.prod(self.mesh_shape) > EXCHANGE_MAX_RANKS:
            return None  # too many ranks to plan the exchange in time: steps only
        ex = plan_exchange(self.shape, self.mesh_shape, layout, dst)
        if not ex.axes:  # every rank builds its target block from what it holds
            changed = next(a for a, (p, q) in enumerate(zip(layout, dst)) if p != q)
            return Step(changed, layout[changed], dst[changed], StepKind.RELAYOUT, 0, (), dst)
        group = self.group(ex.axes)
        if group is None:
            return None
        busiest = max(ex.sends) * self.itemsize
        return Step(group[0], layout[group[0]], dst[group[0]], StepKind.ALL_TO_ALL, busiest,
                    group if len(group) > 1 else (), dst)

    def forward_applies(self, src: Layout, dst: Layout) -> bool:
        """Whether reduce-forward may be weighed: one Partial op, a mesh small enough to plan
        exchanges on. Checked before its total, whose count grows with the ranks times the
        cells their blocks cut the tensor into (minutes on a 512-rank mesh)."""
        return forwardable(self.mesh_shape, src, dst) and math.prod(self.mesh_shape) <= EXCHANGE_MAX_RANKS

    def reduce_forward(self, src: Layout, dst: Layout) -> Step | None:
        """The two-all_to_all step that reduces every element of a Partial source at a rank
        that needs it, then forwards it (``reduce_forward.py``), or None without a group over
        the axes it crosses. Only where ``forward_applies`` (``_candidates`` checks it first)."""
        # Axes it must cross: every Partial one, and every one leaving a Shard (each block is
        # held only at its coordinate and needed at others); no group over them, no step.
        crossed = tuple(a for a, (p, q, m) in enumerate(zip(src, dst, self.mesh_shape))
                        if m > 1 and (p.is_partial() or p.is_shard() and p != q))
        if self.group(crossed) is None:
            return None
        rf = plan_reduce_forward(self.shape, self.mesh_shape, src, dst)
        group = self.group(rf.axes) if rf.axes else None
        if group is None:
            return None
        rounds = tuple(max(r, default=0) * self.itemsize for r in rf.round_sends)
        return Step(group[0], src[group[0]], dst[group[0]], StepKind.ALL_TO_ALL, sum(rounds),
                    group if len(group) > 1 else (), dst, rounds)

    def reducing_total(self, src: Layout, dst: Layout) -> int:
        """Bytes reduce-forward sends in all, known without planning it (``bound.py``)."""
        return reducing_total(self.shape, self.mesh_shape, src, dst) * self.itemsize

    def group(self, axes: Sequence[int]) -> tuple[int, ...] | None:
        """The smallest group over ``axes``: one axis, or an existing flattened group holding
        them all (None when there is none)."""
        if len(axes) == 1:
            return tuple(axes)
        wide = [g for g in self.flattened if set(axes) <= set(g)]
        if not wide:
            return None
        return min(wide, key=lambda g: (math.prod(self.mesh_shape[a] for a in g), g))

    def priced(self, src: Layout, steps: tuple[Step, ...]) -> Plan:
        """``steps`` as a Plan with what every rank sends."""
        return Plan(steps, self.sends(src, steps), self.sends(src, steps, exact=True))

    def sends(self, src: Layout, steps: tuple[Step, ...], exact: bool = False) -> tuple[int, ...]:
        """Bytes every rank sends over ``steps`` (see ``rank_sends``)."""
        sends = [0] * math.prod(self.mesh_shape)
        layout = src
        for step in steps:
            for r, b in enumerate(_rank_sends(self, layout, step, exact)):
                sends[r] += b
            layout = step.apply(layout)
        return tuple(sends)

    def score(self, src: Layout, steps: tuple[Step, ...]) -> tuple[int, int, int]:
        """What plans are compared by (``_choose``): bytes of all ranks, of the busiest, and the
        collectives issued; all_reduce at its exact per-rank figure (so that no all_reduce is
        traded for two collectives over the rounding of its count)."""
        sends = self.sends(src, steps, exact=True)
        return sum(sends), max(sends, default=0), len(_issued(steps))

    def rank_sends(self, layout: Layout, step: Step, exact: bool = False) -> list[int]:
        """Bytes each rank (row-major) sends in ``step`` taken from ``layout``, as ``comm`` counts
        them; ``exact``: an all_reduce at each rank's own figure (``comm`` counts the busiest
        rank's on every rank), whose sum is the reduction's minimum, 2 (n - 1) numel."""
        coords = coordinates(self.mesh_shape)
        if step.collective in _FREE:
            return [0] * len(coords)
        if step.target:
            return [e * self.itemsize for e in self.schedule_sends(layout, step)]
        n = math.prod(self.mesh_shape[a] for a in step.axes)
        after = step.apply(layout)
        sends = []
        for c in coords:
            before = _rank_block_shape(self.shape, self.mesh_shape, layout, c)
            if step.collective == StepKind.ALL_REDUCE and exact:  # each rank at its own figure
                k = 0
                for a in step.axes:
                    k = k * self.mesh_shape[a] + c[a]
                sends.append(all_reduce_sent(math.prod(before), n, k) * self.itemsize)
                continue
            after_shape = _rank_block_shape(self.shape, self.mesh_shape, after, c)
            sends.append(self._sent(step.collective, n, before, after_shape) * self.itemsize)
        return sends

    def schedule_sends(self, layout: Layout, step: Step) -> list[int]:
        """Elements each rank sends in an exchange or reduce-forward step; with kept axes, the
        schedule over the other axes, every slice sending the same."""
        kept = step.kept
        mesh_shape, layout_s, target = drop(self.mesh_shape, kept), drop(layout, kept), drop(step.target, kept)
        if step.rounds:
            sends = plan_reduce_forward(self.shape, mesh_shape, layout_s, target).sends
        else:
            sends = plan_exchange(self.shape, mesh_shape, layout_s, target).sends
        if not kept:
            return list(sends)
        index = {c: i for i, c in enumerate(coordinates(mesh_shape))}
        return [sends[index[drop(c, kept)]] for c in coordinates(self.mesh_shape)]

    def merged_reductions(self, layout: Layout) -> list[Step]:
        """Partial -> Replicate on every axis of a flattened group at once (one all_reduce).

        Legal whatever the other axes hold: a reduction changes no block's shape.
        """
        steps = []
        for axes in self.flattened:
            first = layout[axes[0]]
            if not first.is_partial() or any(layout[a] != first for a in axes):
                continue
            n = math.prod(self.mesh_shape[a] for a in axes)
            sent = self._sent(StepKind.ALL_REDUCE, n, self._local_shape(layout), ())
            steps.append(Step(axes[0], first, Replicate(), StepKind.ALL_REDUCE, sent * self.itemsize, axes))
        return steps

    def step(self, layout: Layout, axis: int, cur: Placement, new: Placement) -> Step | None:
        """The single-collective step on ``axis`` from ``cur`` to ``new``, or None if illegal."""
        if cur == new or new.is_partial() and any(p.is_partial() and p != new for p in layout):
            return None
        if self.mesh_shape[axis] == 1:  # one rank: every layout of this axis holds the same data
            return Step(axis, cur, new, StepKind.RELABEL, 0)
        kind = _collective(cur, new)
        if kind is None or not self._cuts_ok(layout, axis, cur, new):
            return None
        return Step(axis, cur, new, kind, self._bytes(layout, axis, kind, cur, new))

    def _cuts_ok(self, layout: Layout, axis: int, cur: Placement, new: Placement) -> bool:
        """No later axis cuts a tensor dim this step gathers or cuts."""
        dims = {p.dim for p in (cur, new) if isinstance(p, Shard)}
        return not any(isinstance(p, Shard) and p.dim in dims for p in layout[axis + 1 :])

    def _bytes(self, layout: Layout, axis: int, kind: StepKind, cur: Placement, new: Placement) -> int:
        """Bytes the busiest rank of the axis sends (the others at coordinate 0, where blocks are largest)."""
        if kind in _FREE:
            return 0
        after = layout[:axis] + (new,) + layout[axis + 1 :]
        return max(
            self._sent(kind, self.mesh_shape[axis], self._local_shape(layout, axis, k), self._local_shape(after, axis, k))
            for k in range(self.mesh_shape[axis])
        ) * self.itemsize

    @staticmethod
    def _sent(kind: StepKind, n: int, before: tuple[int, ...], after: tuple[int, ...]) -> int:
        """Elements one rank sends: its block to n-1 peers, all of a reduction but its piece, ..."""
        numel = math.prod(before)
        if kind == StepKind.ALL_GATHER:
            return (n - 1) * numel
        if kind == StepKind.ALL_REDUCE:
            return all_reduce_sent(numel, n, 0)  # rank 0: the busiest
        if kind == StepKind.REDUCE_SCATTER:
            return numel - math.prod(after)
        return numel - _kept(before, after)  # all_to_all

    def _local_shape(self, layout: Layout, axis: int = 0, index: int = 0) -> tuple[int, ...]:
        """Block shape of the rank at ``index`` on ``axis`` and coordinate 0 on the other axes."""
        coordinate = tuple(index if a == axis else 0 for a in range(len(self.mesh_shape)))
        return _rank_block_shape(self.shape, self.mesh_shape, layout, coordinate)


@lru_cache(maxsize=65536)
def _rank_sends(ctx: _Context, layout: Layout, step: Step, exact: bool) -> tuple[int, ...]:
    """``_Context.rank_sends``, cached: candidate plans share steps, and scoring each plan
    prices every step again."""
    return tuple(ctx.rank_sends(layout, step, exact))


@lru_cache(maxsize=65536)
def _rank_block_shape(shape: tuple, mesh_shape: tuple, layout: Layout, coordinate: tuple) -> tuple[int, ...]:
    """Block shape of the rank at ``coordinate``."""
    return local_shape_and_offset(shape, mesh_shape, coordinate, layout)[0]


def _kept(before: tuple[int, ...], after: tuple[int, ...]) -> int:
    """Elements an all_to_all leaves in place: the overlap of the old and new block."""
    return math.prod(min(b, a) for b, a in zip(before, after))


def _collective(cur: Placement, new: Placement) -> StepKind | None:
    if cur.is_shard():
        return StepKind.ALL_GATHER if new.is_replicate() else StepKind.ALL_TO_ALL if new.is_shard() else None
    if cur.is_replicate():
        return StepKind.LOCAL_CHUNK if new.is_shard() else StepKind.PARTITION if new.is_partial() else None
    if cur.is_partial():
        return StepKind.ALL_REDUCE if new.is_replicate() else StepKind.REDUCE_SCATTER if new.is_shard() else None
    return None
