"""Parallel plans for a world: enumerate layouts, price them, rank them (pure: no processes).

A layout's cost comes from a ``LayoutCost`` (bytes sent per mesh axis and peak memory per
rank, from the simulation) and a ``Hardware`` profile:

* compute time = 6 x parameters x tokens per step / (world x peak FLOP/s x ``MFU``), the
  usual dense-transformer estimate (forward 2, backward 4 FLOPs per parameter per token), plus
  the attention scores (12 x layers x dim x seq_len per token);
* communication time, per mesh axis: each collective the simulation issued on it priced by
  ``shardwise.cost.collective_time`` (a latency per collective and per algorithm step, plus
  the bytes over the bandwidth of the link the axis crosses): an axis whose ranks all sit in
  one node (the axis and the ones inside it span at most ``gpus_per_node`` ranks; axes are
  laid out outermost first, tp innermost) uses the intra-node link, any other the inter-node one;
* step time = max(compute, data-parallel communication) + the other axes' communication: the
  data-parallel axes' gathers and reductions overlap with compute (FSDP prefetch, bucketed
  reductions), tensor- and context-parallel ones sit on the critical path between ops, and so
  do pipeline sends;
* expert parallelism (``ep``, borrowed from dp_shard x cp): the token dispatch and combine
  all_to_alls on the ep axis are priced like any collective (``Collective.ALL_TO_ALL``) and sit
  on the critical path; the experts' FSDP traffic on ``dp_shard_mod_ep`` overlaps as dp_shard's
  does. The simulation assumes balanced routing (docs/tools.md, "Expert parallelism in the simulation");
* a pipeline (1F1B, one microbatch per stage by default) idles ``pp - 1`` microbatch slots of
  ``microbatches + pp - 1``: compute is multiplied by ``(microbatches + pp - 1) / microbatches``.

A layout whose peak memory exceeds the device's is dropped with that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from shardwise.cost import Collective, Hardware, Link, latency, load_hardware, transfer_time
from shardwise.units import format_bytes

__all__ = ["Hardware", "load_hardware", "Candidate", "candidates", "LayoutCost", "extrapolate", "Plan", "price",
           "rank_plans", "fits", "MFU", "OVERLAPPED_AXES"]

MFU = 0.5  # fraction of peak FLOP/s a step's compute is assumed to reach
OVERLAPPED_AXES = ("dp_shard", "dp_replicate", "dp_shard_cp", "dp", "dp_cp", "dp_shard_mod_ep")
AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, as ParallelDims
FLATTENED_AXES = {"dp_shard_cp": ("dp_shard", "cp"), "dp": ("dp_replicate", "dp_shard"),
                  "dp_cp": ("dp_replicate", "dp_shard", "cp")}


@dataclass(frozen=True)
class Candidate:
    """Parallel degrees; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # borrowed from dp_shard x cp: not a factor of the world

    def degrees(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                "pp": self.pp, "ep": self.ep}

    def flags(self) -> str:
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.degrees().items() if v > 1) or "--dp-shard 1"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world: int, n_heads: int, n_kv_heads: int, global_batch: int, seq_len: int,
               max_tp: int | None = None, max_pp: int = 1, n_layers: int | None = None,
               max_ep: int = 1) -> Iterator[tuple[Candidate, str | None]]:
    """Every split of ``world`` into (dp_replicate, dp_shard, cp, tp, pp) with ``pp <= max_pp``,
    each with every ep up to ``max_ep`` it admits (``ep_degrees``), with why it is invalid (or None)."""
    for pp in (d for d in _divisors(world) if d <= max_pp):
        rest = world // pp
        for tp in _divisors(rest):
            for cp in _divisors(rest // tp):
                for rep in _divisors(rest // (tp * cp)):
                    shard = rest // (tp * cp * rep)
                    for ep in ep_degrees(shard, cp, max_ep):
                        c = Candidate(rep, shard, cp, tp, pp, ep)
                        yield c, _invalid(c, n_heads, n_kv_heads, global_batch, seq_len, max_tp, n_layers)


def ep_degrees(dp_shard: int, cp: int, max_ep: int) -> list[int]:
    """The ep degrees a (dp_shard, cp) split admits: 1, and the divisors of dp_shard x cp that are
    multiples of cp (ep takes whole cp groups; ``ParallelDims``), up to ``max_ep``."""
    return [1] + [e for e in _divisors(dp_shard * cp) if 1 < e <= max_ep and e % cp == 0]


def _invalid(c: Candidate, n_heads: int, n_kv_heads: int, global_batch: int, seq_len: int,
             max_tp: int | None, n_layers: int | None = None) -> str | None:
    if c.pp > 1 and n_layers is not None and n_layers % c.pp:
        return f"pp {c.pp} does not divide the {n_layers} layers"
    if c.pp > 1 and (global_batch // max(c.dp_replicate * c.dp_shard, 1)) % c.pp:
        return f"the local batch does not split into pp {c.pp} microbatches"
    if n_heads % c.tp or n_kv_heads % c.tp:
        return f"tp {c.tp} does not divide the heads ({n_heads}, kv {n_kv_heads})"
    if max_tp is not None and c.tp > max_tp:
        return f"tp {c.tp} spans more than a node ({max_tp} GPUs)"
    if global_batch % (c.dp_replicate * c.dp_shard):
        return f"global batch {global_batch} not divisible by dp {c.dp_replicate * c.dp_shard}"
    if c.cp > 1 and seq_len % (2 * c.cp):
        return f"seq len {seq_len} not divisible by 2 x cp {c.cp}"
    if c.tp > 1 and c.dp_replicate > 1 and c.dp_shard * c.cp == 1:
        return "DDP with TP is not supported (use HSDP)"
    return None


@dataclass(frozen=True)
class LayoutCost:
    """What the simulation says about one layout: the busiest rank's figures."""

    peak_memory_bytes: int
    comm_bytes_by_axis: dict[str, int]
    collectives_by_axis: dict[str, dict[str, int]] = field(default_factory=dict)  # axis -> kind -> count


def extrapolate(one: LayoutCost, two: LayoutCost, more: int) -> LayoutCost:
    """The figures of a model ``more`` blocks deeper than ``one``, given ``two`` (one block
    deeper than ``one``): each further block adds what the second added, to the peak, the bytes
    and the collectives of every axis."""

    def extend(a: int, b: int) -> int:
        return a + more * (b - a)

    axes = set(one.comm_bytes_by_axis) | set(two.comm_bytes_by_axis)
    sent = {a: extend(one.comm_bytes_by_axis.get(a, 0), two.comm_bytes_by_axis.get(a, 0)) for a in axes}
    calls = {}
    for a in set(one.collectives_by_axis) | set(two.collectives_by_axis):
        first, second = one.collectives_by_axis.get(a, {}), two.collectives_by_axis.get(a, {})
        calls[a] = {k: extend(first.get(k, 0), second.get(k, 0)) for k in set(first) | set(second)}
    return LayoutCost(extend(one.peak_memory_bytes, two.peak_memory_bytes), sent, calls)


@dataclass
class Plan:
    """One layout priced: ``simulated`` when its cost comes from a full-depth simulation (the
    figures ``--simulate`` prints), not from the 1- and 2-block estimate."""

    candidate: Candidate
    cost: LayoutCost
    compute_s: float
    comm_s: dict[str, float]
    step_s: float
    dropped: str | None = None
    placement: dict[str, str] = field(default_factory=dict)
    simulated: bool = False


def axis_links(c: Candidate, gpus_per_node: int) -> dict[str, Link]:
    """The link of each mesh axis (flattened names map to their outermost part)."""
    sizes = {a: getattr(c, a) for a in AXIS_ORDER}
    links, inner = {}, 1
    for a in reversed(AXIS_ORDER):
        inner *= sizes[a]
        links[a] = Link.INTRA_NODE if inner <= gpus_per_node else Link.INTER_NODE
    links["dp_shard_cp"] = links["dp_shard"] if c.dp_shard > 1 else links["cp"]
    links["dp"] = links["dp_replicate"] if c.dp_replicate > 1 else links["dp_shard"]
    links["dp_cp"] = links["dp_replicate"]
    if c.ep > 1:  # ep = the inner dp_shard ranks x cp: its groups span ep x tp neighbours
        links["ep"] = Link.INTRA_NODE if c.ep * c.tp <= gpus_per_node else Link.INTER_NODE
        links["dp_shard_mod_ep"] = links["dp_shard"]
    return links


def axis_size(c: Candidate, axis: str) -> int:
    """Ranks in one group of ``axis`` (a flattened axis, or several axes at once as ``"ep+tp"``:
    the product of its parts)."""
    if "+" in axis:
        return math.prod(axis_size(c, part) for part in axis.split("+"))
    if axis == "dp_shard_mod_ep":
        return c.dp_shard * c.cp // c.ep
    return math.prod(getattr(c, a) for a in FLATTENED_AXES.get(axis, (axis,)))


def axis_time(c: Candidate, axis: str, cost: LayoutCost, link: Link, hw: Hardware) -> float:
    """Seconds of communication on ``axis``: every collective's latency, and the bytes the
    busiest rank sent on it over the link (``shardwise.cost.collective_time``, summed: its
    bandwidth term is linear, so the step's bytes are priced at once)."""
    n = axis_size(c, axis)
    calls = cost.collectives_by_axis.get(axis, {})
    fixed = sum(count * latency(Collective.named(kind), n, link, hw) for kind, count in calls.items())
    return fixed + transfer_time(cost.comm_bytes_by_axis.get(axis, 0), link, hw)


def _link(links: dict[str, Link], axis: str) -> Link:
    """The link of ``axis``; of several axes at once (``"ep+tp"``), the outermost one's (it spans the others)."""
    return links.get(axis.split("+")[0], Link.INTER_NODE)


def price(c: Candidate, cost: LayoutCost, hw: Hardware, gpus_per_node: int, flops_per_step: float,
          world: int) -> Plan:
    """Step time of one layout on ``hw`` (module docstring), dropped if it does not fit."""
    links = axis_links(c, gpus_per_node)
    axes = set(cost.comm_bytes_by_axis) | set(cost.collectives_by_axis)
    comm = {a: axis_time(c, a, cost, _link(links, a), hw) for a in sorted(axes)}
    compute = flops_per_step / (world * hw.peak_flops * MFU)
    compute *= (c.pp + c.pp - 1) / c.pp  # the 1F1B bubble, microbatches = pp
    overlapped = sum(t for a, t in comm.items() if a in OVERLAPPED_AXES)
    exposed = sum(t for a, t in comm.items() if a not in OVERLAPPED_AXES)
    step = max(compute, overlapped) + exposed
    dropped = None
    if not fits(cost, hw):
        dropped = f"needs {format_bytes(cost.peak_memory_bytes)} per GPU, {hw.name} has {format_bytes(hw.memory_bytes)}"
    return Plan(c, cost, compute, comm, step, dropped, {a: _link(links, a).value for a in comm})


def fits(cost: LayoutCost, hw: Hardware) -> bool:
    """Whether the busiest rank's peak fits in one device of ``hw``."""
    return cost.peak_memory_bytes <= hw.memory_bytes


def rank_plans(plans: list[Plan]) -> list[Plan]:
    """Fitting plans, fastest first (ties: less memory)."""
    return sorted((p for p in plans if p.dropped is None), key=lambda p: (p.step_s, p.cost.peak_memory_bytes))
