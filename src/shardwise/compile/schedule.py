"""Graph-level communication optimization of compiled DTensor programs: bucketing and overlap.

A compiled DTensor program is an FX graph whose collectives are functional collectives, each
an issue node (``_c10d_functional.all_reduce`` ...) and a ``wait_tensor`` node (see comm.py).
Tracing writes every wait right after its issue, in the order the dispatcher met the ops, so
the graph communicates and computes in turn. With the whole graph in hand two rewrites pay:

* **bucketing**: independent collectives of one kind on one group and dtype (the small
  all_reduces of several Partial gradients, the reduce_scatters of several outputs) become one
  collective over their concatenation: one launch and one latency instead of several;
* **overlap**: each collective is issued as soon as its input exists and waited for only
  where its result is first used, so the compute in between runs while the data moves.

``optimize_communication(gm)`` applies both to an ATen graph in place. ``backend(...)`` is a
``torch.compile`` backend that applies it to the forward and backward graphs of every compiled
region and hands them to inductor or runs them as they are (``aot_eager``). ``census(gm)``
measures a graph: collectives by kind and, per collective, the compute nodes between its issue
and its wait (the compute it can overlap). Values do not change: the rewrites only move nodes
and concatenate independent collectives.

Issue order is kept: a collective moves earlier only up to the collective issued before it, so
every rank still issues the same collectives in the same order even when ranks' graphs differ
in local compute (uneven shards).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = ["CommCensus", "backend", "bucket_collectives", "census", "optimize_communication", "overlap_collectives"]

_FUNCTIONAL = torch.ops._c10d_functional
# Functional collective ops by the kind CommDebugMode calls them.
_KINDS: dict[Any, str] = {
    _FUNCTIONAL.all_gather_into_tensor.default: "all_gather",
    _FUNCTIONAL.all_gather_into_tensor_coalesced.default: "all_gather",
    _FUNCTIONAL.reduce_scatter_tensor.default: "reduce_scatter",
    _FUNCTIONAL.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    _FUNCTIONAL.all_reduce.default: "all_reduce",
    _FUNCTIONAL.all_reduce_coalesced.default: "all_reduce",
    _FUNCTIONAL.all_to_all_single.default: "all_to_all",
    _FUNCTIONAL.broadcast.default: "broadcast",
}
_WAIT = _FUNCTIONAL.wait_tensor.default


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _KINDS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _WAIT


def _is_compute(node: fx.Node) -> bool:
    """An op that does work on data: not a collective, a wait, a tuple access or a graph edge."""
    return (node.op == "call_function" and not is_collective(node) and not is_wait(node)
            and node.target is not operator.getitem)


def _waits_of(node: fx.Node) -> list[fx.Node]:
    """The waits of a collective: on its result, or on the items of a coalesced one's result."""
    waits = []
    for user in node.users:
        if is_wait(user):
            waits.append(user)
        elif user.op == "call_function" and user.target is operator.getitem:
            waits.extend(u for u in user.users if is_wait(u))
    return waits


# ---------------------------------------------------------------------- measuring
@dataclass
class CommCensus:
    """The collectives of a graph: counts by kind; per collective, how many compute nodes run
    between its issue and its (last) wait, i.e. the compute it can overlap."""

    counts: dict[str, int] = field(default_factory=dict)
    overlap: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def overlapped(self) -> int:
        """Collectives with at least one compute node between issue and wait."""
        return sum(1 for n in self.overlap if n > 0)


def census(gm: fx.GraphModule | fx.Graph) -> CommCensus:
    """The collectives of ``gm`` by kind, and the compute between each one's issue and wait."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    nodes = list(graph.nodes)
    compute_before = [0]
    for node in nodes:
        compute_before.append(compute_before[-1] + _is_compute(node))
    position = {node: i for i, node in enumerate(nodes)}
    out = CommCensus()
    for node in nodes:
        if not is_collective(node):
            continue
        kind = _KINDS[node.target]
        out.counts[kind] = out.counts.get(kind, 0) + 1
        waits = _waits_of(node)
        end = max((position[w] for w in waits), default=position[node])
        out.overlap.append(compute_before[end] - compute_before[position[node] + 1])
    return out


# ---------------------------------------------------------------------- bucketing
def bucket_collectives(gm: fx.GraphModule, bucket_cap_mb: float = 25.0) -> None:
    """Merge independent collectives of one kind, group and dtype that follow each other (no
    other such collective between their waits) into buckets of at most ``bucket_cap_mb``.

    Uses inductor's bucketing rewrites (``torch._inductor.fx_passes.bucketing``): each bucket is
    one collective over the concatenated inputs, split back into the original results. They
    need tensor metadata on the nodes (``node.meta["val"]``), which AOTAutograd's graphs have."""
    from torch._inductor.fx_passes import bucketing

    def cap(_bucket: int) -> float:
        return bucket_cap_mb

    before = census(gm).total
    bucketing.bucket_all_reduce(gm, cap)
    bucketing.bucket_reduce_scatter(gm, cap, "default")
    bucketing.bucket_all_gather(gm, cap, "default")
    if census(gm).total != before:
        _stable_topological_sort(gm.graph)


def _stable_topological_sort(graph: fx.Graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)


# ---------------------------------------------------------------------- overlap
def overlap_collectives(gm: fx.GraphModule | fx.Graph) -> None:
    """Issue every collective early and wait for it late, so that compute runs in between.

    Early: of the nodes between two collectives, those the second one does not depend on move
    right after its issue (collectives keep their order; nothing moves past a further
    collective, so live memory grows little). Late: each wait moves right before the
    first node that uses its result."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    order: list[fx.Node] = []
    pending: list[fx.Node] = []  # nodes since the last collective, in graph order
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):  # the signature stays as it is
            order.append(node)
            continue
        if not is_collective(node):
            pending.append(node)
            continue
        needed = _ancestors_among(node, set(pending))
        order += [n for n in pending if n in needed]
        order.append(node)
        order += [n for n in pending if n not in needed]
        pending = []
    order += pending
    waits = [n for n in order if is_wait(n)]
    order = [n for n in order if not is_wait(n)]
    for wait in waits:  # right before the first user (a wait's users are not waits)
        position = {n: i for i, n in enumerate(order)}
        users = [position[u] for u in wait.users]
        order.insert(min(users) if users else position[wait.args[0]] + 1, wait)
    _reorder(graph, order)


def _ancestors_among(node: fx.Node, among: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``among`` that ``node`` depends on, directly or through others of ``among``."""
    found: set[fx.Node] = set()
    stack = [i for i in node.all_input_nodes if i in among]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        stack += [i for i in n.all_input_nodes if i in among]
    return found


def _reorder(graph: fx.Graph, order: list[fx.Node]) -> None:
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node
    graph.lint()


# ---------------------------------------------------------------------- the pass and backends
def optimize_communication(gm: fx.GraphModule, *, bucket: bool = True, overlap: bool = True,
                           bucket_cap_mb: float = 25.0) -> fx.GraphModule:
    """Bucket then overlap the collectives of ``gm`` in place (see the module docstring)."""
    if not any(is_collective(n) for n in gm.graph.nodes):
        return gm
    if bucket:
        bucket_collectives(gm, bucket_cap_mb)
    if overlap:
        overlap_collectives(gm)
    gm.recompile()
    return gm


class _InductorPass:
    """``optimize_communication`` as inductor's post-grad custom pass (on its final ATen graph)."""

    def __init__(self, bucket: bool, overlap: bool, bucket_cap_mb: float) -> None:
        self.bucket, self.overlap, self.bucket_cap_mb = bucket, overlap, bucket_cap_mb

    def __call__(self, graph: fx.Graph) -> None:
        optimize_communication(graph.owning_module, bucket=self.bucket, overlap=self.overlap,
                               bucket_cap_mb=self.bucket_cap_mb)

    def uuid(self) -> Any:
        return ("shardwise.compile.schedule", self.bucket, self.overlap, self.bucket_cap_mb)


def backend(base: str = "inductor", *, bucket: bool = True, overlap: bool = True, bucket_cap_mb: float = 25.0,
            inspect: Callable[[str, CommCensus, fx.GraphModule], None] | None = None) -> Callable:
    """A ``torch.compile`` backend that optimizes the communication of every compiled graph.

    ``base`` is what runs the optimized graphs: "inductor" (the pass runs as inductor's
    post-grad custom pass) or "aot_eager" (the forward and backward ATen graphs run as they
    are). ``inspect(kind, before, gm)``, for "aot_eager", sees each graph ("forward" or
    "backward") after the pass, with the ``census`` it had before.
    """
    if base == "inductor":
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class _Pass(_InductorPass, CustomGraphPass):
            pass

        patches = {"post_grad_custom_post_pass": _Pass(bucket, overlap, bucket_cap_mb)}

        def compile_inductor(gm: fx.GraphModule, example_inputs: list) -> Callable:
            return compile_fx(gm, example_inputs, config_patches=patches)

        return compile_inductor
    if base != "aot_eager":
        raise ValueError(f"shardwise.compile.schedule.backend: base must be 'inductor' or 'aot_eager', got {base!r}")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable:
            before = census(gm) if inspect is not None else None
            optimize_communication(gm, bucket=bucket, overlap=overlap, bucket_cap_mb=bucket_cap_mb)
            if inspect is not None:
                inspect(kind, before, gm)
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
