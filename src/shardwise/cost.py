"""The one cost model: how long a collective takes on a hardware profile (pure).

Every part of shardwise that chooses by cost prices communication here: the redistribute
planner (which plan to run), the dispatcher (which input layouts an op asks for), and
``shardwise.plan`` (which parallel layout is fastest, from the simulator's figures). docs/tools.md
("Simulate a job before running it", "The redistribute planner") shows the figures.

The model is the usual latency-bandwidth one, per mesh axis:

    time = collective_latency + steps(kind, n) x link_latency + bytes of the busiest rank / link bandwidth

``steps`` counts the rounds of the ring / pairwise algorithms whose bytes ``comm`` records
(``n - 1``; an all_reduce is a reduce_scatter then an all_gather, ``2 (n - 1)``). An axis's
link is intra-node when the ranks of that axis and of every axis inside it (mesh axes are laid
out outermost first, the last one innermost) fit in one node, inter-node otherwise.

Profiles live in ``plan/hardware.json``: ``cpu`` (gloo on one machine), ``h100-80gb``,
``a100-80gb``, ``h200``. The latencies there are stated assumptions (NCCL's launch and
per-hop figures, gloo's over loopback), not measurements of this machine.
"""

from __future__ import annotations

import enum
import json
import math
import os
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Collective", "Link", "Hardware", "load_hardware", "collective_time", "latency", "transfer_time", "axis_links",
           "active_hardware", "use_hardware", "HARDWARE_FILE"]

HARDWARE_FILE = os.path.join(os.path.dirname(__file__), "plan", "hardware.json")


class Collective(str, enum.Enum):
    """A collective the model prices; the values are ``comm``'s names for them."""

    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"

    @classmethod
    def named(cls, name: str) -> "Collective":
        """The kind ``comm`` records as ``name``; a point-to-point ``send``/``recv`` is one step,
        and any other (``scatter``, ``barrier``, object gathers) is priced as a broadcast."""
        if name in ("send", "recv", "send_recv"):
            return cls.SEND_RECV
        try:
            return cls(name)
        except ValueError:
            return cls.BROADCAST


class Link(str, enum.Enum):
    """What a mesh axis's ranks talk over."""

    INTRA_NODE = "intra"  # NVLink, or shared memory / loopback on one machine
    INTER_NODE = "inter"  # the network between nodes


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device profile: memory, compute, and each link's bandwidth (bytes/s, one direction,
    per device) and latency (seconds per algorithm step); ``collective_latency_s`` is paid once
    per collective issued (launch, synchronisation); ``gpus_per_node`` places axes on links.
    ``shared_bandwidth``: the ranks of a node share one memory system and its cores (gloo
    processes on one machine), so intra-node time counts the bytes EVERY rank sends, over the
    node's bandwidth, rather than the busiest rank's over its own link."""

    name: str
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    intra_node_latency_s: float = 0.0
    inter_node_latency_s: float = 0.0
    collective_latency_s: float = 0.0
    gpus_per_node: int = 8
    shared_bandwidth: bool = False

    def bandwidth(self, link: Link) -> float:
        return self.intra_node_bw if link is Link.INTRA_NODE else self.inter_node_bw

    def step_latency(self, link: Link) -> float:
        return self.intra_node_latency_s if link is Link.INTRA_NODE else self.inter_node_latency_s


def load_hardware(name: str, path: str | None = None) -> Hardware:
    """The named profile from ``plan/hardware.json``, or from ``path`` (a JSON of the same form)."""
    path = path or HARDWARE_FILE
    with open(path) as f:
        profiles = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    if name not in profiles:
        raise ValueError(f"unknown hardware {name!r} in {path}; known: {', '.join(profiles)}")
    return Hardware(name, **profiles[name])


def steps(kind: Collective, group_size: int) -> int:
    """Rounds of the ring / pairwise algorithm for ``kind`` over ``group_size`` ranks."""
    if kind is Collective.SEND_RECV:
        return 1
    return (2 if kind is Collective.ALL_REDUCE else 1) * (group_size - 1)


def latency(kind: Collective, group_size: int, link: Link, hardware: Hardware) -> float:
    """The part of a collective's time that does not depend on its size."""
    if group_size < 2:
        return 0.0
    return hardware.collective_latency_s + steps(kind, group_size) * hardware.step_latency(link)


def collective_time(kind: Collective, nbytes_busiest: int, group_size: int, link: Link,
                    hardware: Hardware, nbytes_all: int | None = None) -> float:
    """Predicted seconds for one collective: latency plus the busiest rank's bytes over the link
    (on a ``shared_bandwidth`` node: every rank's bytes over the node's bandwidth).

    Args:
        kind: which collective.
        nbytes_busiest: bytes the busiest rank of the group sends (``comm``'s accounting).
        group_size: ranks in the group; one rank communicates nothing and costs nothing.
        link: the link the group's ranks talk over (``axis_links``).
        hardware: the profile.
        nbytes_all: bytes sent by every rank on the node meanwhile (all the copies of the group
            running side by side); default ``nbytes_busiest * group_size``. Read only on a
            ``shared_bandwidth`` profile.

    Example:
        >>> h = Hardware("toy", 0, 0, intra_node_bw=1e9, inter_node_bw=1e8, intra_node_latency_s=1e-6)
        >>> round(collective_time(Collective.ALL_GATHER, 3_000_000, 4, Link.INTRA_NODE, h), 6)
        0.003003
    """
    if group_size < 2:
        return 0.0
    nbytes = nbytes_busiest
    if hardware.shared_bandwidth and link is Link.INTRA_NODE:
        nbytes = nbytes_busiest * group_size if nbytes_all is None else nbytes_all
    return latency(kind, group_size, link, hardware) + transfer_time(nbytes, link, hardware)


def transfer_time(nbytes: float, link: Link, hardware: Hardware) -> float:
    """The size-dependent part: ``nbytes`` over the link's bandwidth. Linear, so the bytes of
    many collectives on one link may be priced at once (``shardwise.plan`` does)."""
    return nbytes / hardware.bandwidth(link)


def axis_links(mesh_shape: Sequence[int], gpus_per_node: int) -> tuple[Link, ...]:
    """The link of each mesh axis: intra-node while the axis and the axes inside it (later in
    ``mesh_shape``) span at most ``gpus_per_node`` ranks."""
    links = []
    for axis in range(len(mesh_shape)):
        inner = math.prod(mesh_shape[axis:])
        links.append(Link.INTRA_NODE if inner <= gpus_per_node else Link.INTER_NODE)
    return tuple(links)


_ACTIVE: list[Hardware] = []


def active_hardware() -> Hardware:
    """The profile the redistribute planner and the dispatcher price with: the one set by
    ``use_hardware``, else ``h100-80gb`` when CUDA is present and ``cpu`` otherwise (gloo)."""
    if not _ACTIVE:
        import torch

        _ACTIVE.append(load_hardware("h100-80gb" if torch.cuda.is_available() else "cpu"))
    return _ACTIVE[0]


def use_hardware(hardware: Hardware | str) -> Hardware:
    """Price plans with ``hardware`` (a profile or its name in ``plan/hardware.json``) from now
    on, in this process; returns the profile it replaces (to restore it). Plans are cached per
    profile, so switching back and forth is cheap. Every rank must price with the same profile:
    ranks that plan differently would enter different collectives."""
    before = active_hardware()
    _ACTIVE[:] = [load_hardware(hardware) if isinstance(hardware, str) else hardware]
    return before
