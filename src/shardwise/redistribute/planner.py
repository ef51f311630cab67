"""The redistribute planner: a pure function from (source layout, target layout) to steps.

A layout is one placement per mesh axis. A step changes ONE axis with ONE collective:

    Shard(d)  -> Replicate   all_gather        Replicate -> Shard(d)  local chunk (free)
    Partial   -> Replicate   all_reduce        Partial   -> Shard(d)  reduce_scatter
    Shard(d)  -> Shard(e)    all_to_all        Replicate -> Partial   partition (free)

Axes cut the tensor in order (axis 0 first), so a step on axis i that gathers or cuts tensor
dim d is only legal when no later axis also cuts d: otherwise this rank's block is a piece of
a piece and the step would stitch the wrong rows together.

Plans are chosen by predicted time (``shardwise.cost.collective_time``: a latency per
collective and per algorithm step plus the busiest rank's bytes over the link of the axis), on
the active hardware profile (``shardwise.cost.active_hardware``: ``cpu`` under gloo, settable
with ``shardwise.cost.use_hardware``). Two kinds of candidate are weighed:

* the axis-by-axis path: Dijkstra over the small graph of layouts, each edge priced by its
  predicted time (ties: fewer bytes, fewer steps, then a fixed order, so every rank derives
  the same plan). Partial on several axes whose flattened group exists (``flattened``) may be
  reduced by ONE all_reduce over that group: one collective instead of one per axis;
* exchange routes (``exchange.py``): one all_to_all with per-peer counts over the flattened
  group of the axes involved, sending every rank exactly what it lacks (axis by axis, a block
  on a rank of another axis travels twice). It starts from the source, from a layout the
  search reaches by reducing the source's Partial axes, or (a Partial(sum) source) reduces on
  the way, possibly into a fully sharded refinement of the target first.

* the plan keeping a reduction pending (``pending.py``): an axis Partial in both layouts with
  the same op stays unreduced (each rank keeps its own contribution) and the other axes are
  planned as a transition of their own, run side by side in every slice of the kept axes.

The fastest predicted plan wins, ties to the axis-by-axis one. docs/tools.md, "The redistribute
planner", has the ablation that decided which candidates to keep: reduce-forward (two
all_to_alls reducing each element at a consumer) and the byte lower bound as the planner's
target were removed, being slower measured on gloo and predicted on h100; ``bound.py`` keeps
the lower bound as a reported figure.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from shardwise.comm.bytes import all_reduce_sent
from shardwise.core.placement import Partial, Placement, Replicate, Shard
from shardwise.core.spec import local_shape_and_offset
from shardwise.cost import Collective, Hardware, Link, active_hardware, axis_links, collective_time
from shardwise.redistribute.bound import coordinates
from shardwise.redistribute.exchange import plan_exchange, reducible
from shardwise.redistribute.pending import drop, insert, kept_axes, rest_axes, sub_groups, widen

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

    ``bytes_per_rank`` is what the busiest rank of the axis sends; ``bytes_all`` what every rank
    of the mesh sends (an exchange's exact figure; 0 for an axis step, priced as the busiest
    rank's bytes times the ranks). ``flattened`` (two or more
    axes, ``axis`` the first) marks a collective over all of them at once, by their flattened
    group; otherwise it is empty. An exchange (``target`` set: the whole layout after it)
    re-lays several axes at once by one all_to_all over ``axes``' (flattened) group. ``kept``:
    mesh axes Partial before and after whose reduction stays pending (``pending.py``); the
    exchange then runs its schedule over the mesh without them, in every slice at once.
    """

    axis: int
    src: Placement
    dst: Placement
    collective: StepKind
    bytes_per_rank: int
    flattened: tuple[int, ...] = ()
    target: Layout = ()
    bytes_all: int = field(default=0, compare=False)
    kept: tuple[int, ...] = ()

    @property
    def axes(self) -> tuple[int, ...]:
        """Every mesh axis this step changes."""
        return self.flattened or (self.axis,)

    @property
    def free(self) -> bool:
        """Whether the step moves no data between ranks."""
        return self.collective in _FREE

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
        if self.target:
            return f"{where}: exchange to ({','.join(map(str, self.target))}) by {self.collective} ({self.bytes_per_rank} B)"
        return f"{where}: {self.src} -> {self.dst} by {self.collective} ({self.bytes_per_rank} B)"


@dataclass(frozen=True, slots=True)
class Plan:
    """Ordered steps; ``sends``: bytes each rank sends over the whole plan (row-major mesh
    coordinates, each collective as ``comm`` counts it); ``predicted_s``: the plan's time on
    the profile it was planned for (``shardwise.cost``)."""

    steps: tuple[Step, ...]
    sends: tuple[int, ...] = ()
    predicted_s: float = 0.0

    @property
    def bytes_per_rank(self) -> int:
        """Each step's busiest rank, summed (an upper bound on any one rank)."""
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def total_bytes(self) -> int:
        """Bytes sent by all ranks together."""
        return sum(self.sends)

    @property
    def busiest_bytes(self) -> int:
        """Bytes sent by the rank that sends the most over the whole plan."""
        return max(self.sends, default=0)

    @property
    def collectives(self) -> list[str]:
        """Names of the collectives that move data, in order (free local steps left out)."""
        return [kind.value for kind, _ in self.issued]

    @property
    def issued(self) -> list[tuple[StepKind, int]]:
        """Every collective the plan issues with its busiest rank's bytes, in order."""
        return [(s.collective, s.bytes_per_rank) for s in self.steps if not s.free]

    def __str__(self) -> str:
        return "; ".join(map(str, self.steps)) or "no-op"


_FREE = (StepKind.LOCAL_CHUNK, StepKind.PARTITION, StepKind.RELABEL, StepKind.RELAYOUT)
# Exchange routes are planned only on meshes of at most this many ranks: ``plan_exchange``
# compares every holder class with every receiver (quadratic in the ranks; seconds per plan at
# 64 ranks, minutes at 1,024), while axis-by-axis steps are priced in time independent of it.
EXCHANGE_MAX_RANKS = 32
# An exchange also packs and unpacks its runs on the host (a schedule of boxes, one copy per
# run): fitted on gloo over small blocks (docs/tools.md, "Ablation"), one collective latency.
EXCHANGE_HOST_LATENCIES = 1


def plan_redistribute(
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    flattened: Sequence[Sequence[int]] = (),
    hardware: Hardware | None = None,
) -> Plan:
    """The fastest predicted sequence of steps from layout ``src`` to layout ``dst``.

    Args:
        global_shape: the logical tensor's shape (Shard dims already non-negative).
        itemsize: bytes per element.
        mesh_shape: ranks along each mesh axis.
        src, dst: one placement per axis.
        flattened: sets of axes (ascending) whose flattened process group exists: Partials on
            those axes may be reduced together by one all_reduce, and exchanges may run on it.
        hardware: the profile to price with (default: ``shardwise.cost.active_hardware()``).

    Raises:
        ValueError: no path exists (cannot happen for valid layouts; kept as a guard).

    Example:
        >>> from shardwise import Replicate, Shard
        >>> plan_redistribute((8, 6), 4, (4,), [Shard(0)], [Replicate()]).collectives
        ['all_gather']
    """
    groups = tuple(sorted(tuple(sorted(g)) for g in flattened))  # one canonical order: the cache key
    return _cached_plan(tuple(global_shape), itemsize, tuple(mesh_shape), tuple(src), tuple(dst), groups,
                        hardware or active_hardware())


@lru_cache(maxsize=4096)
def _cached_plan(shape: tuple, itemsize: int, mesh_shape: tuple, src: Layout, dst: Layout, flattened: tuple,
                 hardware: Hardware) -> Plan:
    return _plan(_context(shape, itemsize, mesh_shape, src, dst, flattened, hardware), src, dst)


def plan_candidates(global_shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], src: Sequence[Placement],
                    dst: Sequence[Placement], flattened: Sequence[Sequence[int]] = (),
                    hardware: Hardware | None = None) -> list[Plan]:
    """Every plan ``plan_redistribute`` chooses among (same arguments), the axis-by-axis one
    first; for tests and tools that check the choice."""
    src, dst = tuple(src), tuple(dst)
    ctx = _context(global_shape, itemsize, mesh_shape, src, dst, flattened, hardware)
    if src == dst:
        return [_plan(ctx, src, dst)]
    return [ctx.priced(src, steps) for steps in _candidates(ctx, src, dst)]


def _context(global_shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int], src: Sequence[Placement],
             dst: Sequence[Placement], flattened: Sequence[Sequence[int]], hardware: Hardware | None) -> "_Context":
    groups = tuple(sorted(tuple(sorted(g)) for g in flattened))  # one canonical order: the cache key
    partials = tuple(sorted({p for p in (*src, *dst) if isinstance(p, Partial)}, key=lambda p: p.reduce_op))
    return _Context(tuple(global_shape), itemsize, tuple(mesh_shape), partials, groups,
                    hardware or active_hardware())


def _plan(ctx: "_Context", src: Layout, dst: Layout) -> Plan:
    if src == dst:
        return Plan((), (0,) * math.prod(ctx.mesh_shape))
    candidates = _candidates(ctx, src, dst)
    best = min(range(len(candidates)), key=lambda i: (ctx.time(candidates[i]), _bytes(candidates[i]), i))
    return ctx.priced(src, candidates[best])


def _bytes(steps: tuple[Step, ...]) -> int:
    return sum(s.bytes_per_rank for s in steps)


def _candidates(ctx: "_Context", src: Layout, dst: Layout) -> list[tuple[Step, ...]]:
    """The plans weighed: the axis-by-axis path first, the exchange routes, then the plan keeping
    reductions pending (each where it applies)."""
    paths = _search(ctx, src)
    if dst not in paths:
        raise ValueError(f"no redistribute path from {list(src)} to {list(dst)} for shape {list(ctx.shape)}")
    kept = _kept_plan(ctx, src, dst)
    return [paths[dst], *_exchange_routes(ctx, src, dst, paths), *([kept] if kept else [])]


def _kept_plan(ctx: "_Context", src: Layout, dst: Layout) -> tuple[Step, ...] | None:
    """The plan that keeps the reductions of ``pending.kept_axes`` pending: the sub-plan over
    the other axes, its steps lifted to the full mesh (None when no axis may be kept)."""
    kept = kept_axes(ctx.mesh_shape, src, dst)
    if not kept:
        return None
    rest, held, ndim = rest_axes(len(ctx.mesh_shape), kept), tuple(src[a] for a in kept), len(ctx.mesh_shape)
    sub_ctx = _context(ctx.shape, ctx.itemsize, drop(ctx.mesh_shape, kept), drop(src, kept), drop(dst, kept),
                       sub_groups(ctx.flattened, kept, ndim), ctx.hardware)
    steps = []
    for s in _plan(sub_ctx, drop(src, kept), drop(dst, kept)).steps:
        group: tuple[int, ...] | None = tuple(rest[a] for a in s.flattened)
        if group and s.target:  # an all_to_all: may run on a group that spans the kept axes
            group = widen(group, ctx.flattened, kept, ctx.mesh_shape)
        elif group and group not in ctx.flattened:  # a reduction over the other axes only
            group = None
        if group is None:
            return None
        copies = math.prod(ctx.mesh_shape[a] for a in kept)
        steps.append(Step(group[0] if group else rest[s.axis], s.src, s.dst, s.collective, s.bytes_per_rank, group,
                          insert(s.target, kept, held) if s.target else (), s.bytes_all * copies,
                          kept if s.target else ()))
    return tuple(steps)


def _exchange_routes(ctx: "_Context", src: Layout, dst: Layout, paths: dict) -> list[tuple[Step, ...]]:
    """Plans that end in an exchange: from the source, from a reduced source, or (Partial(sum)
    source) a reducing exchange straight to the target or into a fully sharded refinement of it
    followed by a value exchange."""
    if math.prod(ctx.mesh_shape) > EXCHANGE_MAX_RANKS:
        return []  # too many ranks to plan the exchange in time: steps only
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
    """Fastest predicted axis-by-axis path from ``src`` to every layout (Dijkstra; ties broken
    by fewer bytes of the busiest ranks, fewer steps, then a fixed order)."""
    # (seconds, bytes, steps, tie-break key, layout, path)
    frontier: list = [(0.0, 0, 0, "", src, ())]
    paths: dict = {}
    while frontier:
        seconds, nbytes, n_steps, key, layout, path = heapq.heappop(frontier)
        if layout in paths:
            continue
        paths[layout] = path
        for step in _moves(ctx, layout):
            nxt = step.apply(layout)
            if nxt not in paths:
                entry = (seconds + ctx.step_time(step), nbytes + step.bytes_per_rank, n_steps + 1,
                         key + "|" + str(step), nxt, path + (step,))
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


@dataclass(frozen=True, slots=True)
class _Context:
    shape: tuple
    itemsize: int
    mesh_shape: tuple
    partials: tuple[Partial, ...]
    flattened: tuple[tuple[int, ...], ...]
    hardware: Hardware

    # ------------------------------------------------------------------ pricing
    def step_time(self, step: Step) -> float:
        """Predicted seconds of one step on this context's hardware (0 for a free one)."""
        if step.free:
            return 0.0
        links = _axis_links(self.mesh_shape, self.hardware.gpus_per_node)
        link = Link.INTER_NODE if any(links[a] is Link.INTER_NODE for a in step.axes) else Link.INTRA_NODE
        n = math.prod(self.mesh_shape[a] for a in step.axes)
        host = EXCHANGE_HOST_LATENCIES * self.hardware.collective_latency_s if step.target else 0.0
        return host + collective_time(Collective(step.collective.value), step.bytes_per_rank, n, link, self.hardware,
                                      step.bytes_all or step.bytes_per_rank * math.prod(self.mesh_shape))

    def time(self, steps: tuple[Step, ...]) -> float:
        return sum(self.step_time(s) for s in steps)

    def priced(self, src: Layout, steps: tuple[Step, ...]) -> Plan:
        """``steps`` as a Plan with what every rank sends and its predicted time."""
        return Plan(steps, self.sends(src, steps), self.time(steps))

    def sends(self, src: Layout, steps: tuple[Step, ...]) -> tuple[int, ...]:
        """Bytes every rank sends over ``steps`` (see ``rank_sends``)."""
        sends = [0] * math.prod(self.mesh_shape)
        layout = src
        for step in steps:
            for r, b in enumerate(_rank_sends(self, layout, step)):
                sends[r] += b
            layout = step.apply(layout)
        return tuple(sends)

    def rank_sends(self, layout: Layout, step: Step) -> list[int]:
        """Bytes each rank (row-major) sends in ``step`` taken from ``layout``, as ``comm`` counts
        them (an all_reduce at the busiest rank's figure on every rank)."""
        coords = coordinates(self.mesh_shape)
        if step.free:
            return [0] * len(coords)
        if step.target:
            return [e * self.itemsize for e in self.schedule_sends(layout, step)]
        n = math.prod(self.mesh_shape[a] for a in step.axes)
        after = step.apply(layout)
        return [self._sent(step.collective, n, _rank_block_shape(self.shape, self.mesh_shape, layout, c),
                           _rank_block_shape(self.shape, self.mesh_shape, after, c)) * self.itemsize for c in coords]

    def schedule_sends(self, layout: Layout, step: Step) -> list[int]:
        """Elements each rank sends in an exchange; with kept axes, the schedule over the other
        axes, every slice sending the same."""
        kept = step.kept
        mesh_shape = drop(self.mesh_shape, kept)
        sends = plan_exchange(self.shape, mesh_shape, drop(layout, kept), drop(step.target, kept)).sends
        if not kept:
            return list(sends)
        index = {c: i for i, c in enumerate(coordinates(mesh_shape))}
        return [sends[index[drop(c, kept)]] for c in coordinates(self.mesh_shape)]

    # ------------------------------------------------------------------ moves
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
        """The one-all_to_all step from ``layout`` to ``dst``, or None when it moves nothing or
        needs a flattened group that does not exist."""
        if layout == dst or len({p for p in dst if p.is_partial()}) > 1 or not reducible(layout, dst):
            return None  # mixed reductions: the order of partitioning matters, leave it to steps
        ex = plan_exchange(self.shape, self.mesh_shape, layout, dst)
        if not ex.axes:  # every rank builds its target block from what it holds
            changed = next(a for a, (p, q) in enumerate(zip(layout, dst)) if p != q)
            return Step(changed, layout[changed], dst[changed], StepKind.RELAYOUT, 0, (), dst)
        group = self.group(ex.axes)
        if group is None:
            return None
        busiest = max(ex.sends) * self.itemsize
        return Step(group[0], layout[group[0]], dst[group[0]], StepKind.ALL_TO_ALL, busiest,
                    group if len(group) > 1 else (), dst, sum(ex.sends) * self.itemsize)

    def group(self, axes: Sequence[int]) -> tuple[int, ...] | None:
        """The smallest group over ``axes``: one axis, or an existing flattened group holding
        them all (None when there is none)."""
        if len(axes) == 1:
            return tuple(axes)
        wide = [g for g in self.flattened if set(axes) <= set(g)]
        if not wide:
            return None
        return min(wide, key=lambda g: (math.prod(self.mesh_shape[a] for a in g), g))

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


_axis_links = lru_cache(maxsize=256)(axis_links)


@lru_cache(maxsize=65536)
def _rank_sends(ctx: _Context, layout: Layout, step: Step) -> tuple[int, ...]:
    """``_Context.rank_sends``, cached: plans share steps."""
    return tuple(ctx.rank_sends(layout, step))


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
