"""The summary ``print(explain)`` shows by default: a line per module per phase (docs/explain.md).

Pure: it reads an ``Explanation``'s records (no process group, no model), so an explanation
read back with ``Explanation.from_json`` summarizes the same.

Sections, in step order:

* forward: the modules in the order they were first entered, then what ran outside any module
  (``Global``: the loss, for one);
* backward: outside any module first (the loss's backward), then the modules in reverse (a
  module's backward runs after those of the modules it feeds), each with what autograd ran under it;
* optimizer: what ran outside any module once backward was over (gradient clipping, the
  optimizer step).

Each line: the module, indented under the modules that contain it; the DTensor ops it ran itself;
its collectives by kind and mesh axis (``all_reduce@tp x2 32.0 KiB``: count and the bytes this
rank sent, as ``CommDebugMode`` counts them; an all_to_all with counts per peer, such as the
expert-parallel dispatch and combine, also the bytes sent to each peer of the axis, summed over
its calls); and the layouts crossing its edge on its first call (forward: inputs -> outputs;
backward: the output's gradient -> the inputs' gradients), in the compact syntax of
``shardwise.debug.explain``. Consecutive blocks of a list (``layers.0``, ``layers.1``) whose
lines agree but for the index fold into one (``layers.0-1 (x2, same)``: the figures are each
block's). A total line closes each section, every block counted.
"""

from __future__ import annotations

import enum
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal

from shardwise.debug.module_tracker import GLOBAL
from shardwise.units import format_bytes

if TYPE_CHECKING:
    from shardwise.debug.explain import CollectiveEntry, Explanation

__all__ = ["Section", "Traffic", "Line", "Part", "summarize", "render"]

_SHOWN_TENSORS = 2  # layouts shown per side of an edge; the rest are counted
_BLOCK = re.compile(r"^(.*)\.(\d+)$")  # a block of a list: "Transformer.layers.3"


class Section(enum.Enum):
    """A part of the step: the forward, the backward, and what ran outside any module after it."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    @property
    def title(self) -> str:
        return "optimizer (after backward: gradient clipping, the step)" if self is Section.OPTIMIZER else self.value


@dataclass(frozen=True, slots=True)
class Traffic:
    """One kind of collective on one mesh axis: how many, the bytes this rank sent, and for an
    all_to_all with counts per peer the bytes sent to each peer (this rank's own entry 0)."""

    kind: str
    axis: str
    count: int
    bytes: int
    per_peer: tuple[int, ...] | None = None

    def describe(self) -> str:
        peers = f" (per peer {' / '.join(format_bytes(b) for b in self.per_peer)})" if self.per_peer else ""
        return f"{self.kind}@{self.axis} x{self.count} {format_bytes(self.bytes)}{peers}"


@dataclass(frozen=True, slots=True)
class Line:
    """One module in one section (``label`` as shown: relative to the line it is indented under)."""

    module: str
    label: str
    depth: int
    ops: int
    traffic: tuple[Traffic, ...]
    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] | None = None

    def edge(self) -> str:
        """``inputs -> outputs`` (``-`` when not seen: a module that ran no hooks in that phase)."""
        if self.inputs is None and self.outputs is None:
            return ""
        return f"{_tensors(self.inputs)} -> {_tensors(self.outputs)}"


@dataclass(frozen=True, slots=True)
class Part:
    """A section's lines and its totals (every block of a folded run counted)."""

    section: Section
    lines: tuple[Line, ...]
    ops: int
    traffic: tuple[Traffic, ...]


def _tensors(layouts: tuple[str, ...] | None) -> str:
    if not layouts:
        return "-"
    more = len(layouts) - _SHOWN_TENSORS
    return ", ".join(layouts[:_SHOWN_TENSORS]) + (f" +{more} more" if more > 0 else "")


# ---------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class _Event:
    """An op (``collective`` None) or a collective, where and when it ran."""

    module: str
    section: Section
    collective: "CollectiveEntry | None" = None


def _events(ex: "Explanation") -> list[_Event]:
    """Every top-level op and every collective (those inside ops too), with its section: what
    ran outside any module after the last backward event or module boundary is the optimizer's."""
    raw: list[tuple[str, str, int, CollectiveEntry | None]] = []
    for op in ex.ops:
        if op.depth == 0:
            raw.append((op.module, op.phase, op.order, None))
        raw += [(c.module, c.phase, c.order if c.order >= 0 else op.order, c) for c in op.collectives]
    raw += [(c.module, c.phase, c.order, c) for c in ex.collectives]
    backward = [order for _, phase, order, _ in raw if phase == "backward"]
    backward += [b.order for b in ex.boundaries if b.phase == "backward"]  # a backward with no events
    last_backward = max(backward) if backward else None
    return [_Event(module, _section(module, phase, order, last_backward), c) for module, phase, order, c in raw]


def _section(module: str, phase: str, order: int, last_backward: int | None) -> Section:
    if phase == "backward":
        return Section.BACKWARD
    if module == GLOBAL and last_backward is not None and order > last_backward:
        return Section.OPTIMIZER
    return Section.FORWARD


def _traffic(collectives: list["CollectiveEntry"]) -> tuple[Traffic, ...]:
    """Collectives grouped by (kind, mesh axis), in order of first appearance."""
    groups: dict[tuple[str, str], list[CollectiveEntry]] = {}
    for c in collectives:
        groups.setdefault((c.kind, c.axis), []).append(c)
    return tuple(Traffic(kind, axis, len(cs), sum(c.bytes for c in cs), _per_peer(cs))
                 for (kind, axis), cs in groups.items())


def _per_peer(collectives: list["CollectiveEntry"]) -> tuple[int, ...] | None:
    peers = [c.per_peer for c in collectives]
    if any(p is None for p in peers) or len({len(p) for p in peers if p is not None}) != 1:
        return None
    return tuple(sum(column) for column in zip(*[p for p in peers if p is not None]))


# ---------------------------------------------------------------------- the module tree
@dataclass(slots=True)
class _Node:
    name: str
    children: list["_Node"] = field(default_factory=list)
    repeat: tuple[int, int, int] | None = None  # a folded run: (first index, last index, blocks)


def _tree(names: list[str]) -> list[_Node]:
    """The modules as a forest, each under the longest other name it extends (in ``names`` order)."""
    nodes = {n: _Node(n) for n in names}
    roots: list[_Node] = []
    for name in names:
        parents = [p for p in names if name.startswith(p + ".")]
        (nodes[max(parents, key=len)].children if parents else roots).append(nodes[name])
    return roots


def _reverse(nodes: list[_Node]) -> list[_Node]:
    for node in nodes:
        node.children = _reverse(node.children)
    return nodes[::-1]


def _with_ancestors(chosen: set[str], order: list[str]) -> list[str]:
    """``chosen`` and every module of ``order`` containing one of them, in ``order``."""
    return [n for n in order if n in chosen or any(c.startswith(n + ".") for c in chosen)]


# ---------------------------------------------------------------------- lines
@dataclass(frozen=True, slots=True)
class _Facts:
    """What a section knows of each module: ops, collectives, boundaries."""

    ops: dict[str, int]
    collectives: dict[str, list["CollectiveEntry"]]
    edges: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]]

    def line(self, name: str, label: str, depth: int) -> Line:
        inputs, outputs = self.edges.get(name, (None, None))
        return Line(name, label, depth, self.ops.get(name, 0), _traffic(self.collectives.get(name, [])),
                    inputs, outputs)


def _facts(ex: "Explanation", events: list[_Event], section: Section) -> _Facts:
    ops: dict[str, int] = {}
    collectives: dict[str, list[CollectiveEntry]] = {}
    for e in events:
        if e.section is not section:
            continue
        if e.collective is None:
            ops[e.module] = ops.get(e.module, 0) + 1
        else:
            collectives.setdefault(e.module, []).append(e.collective)
    phase = "backward" if section is Section.BACKWARD else "forward"
    edges = {b.module: (tuple(b.inputs), tuple(b.outputs) if b.outputs is not None else None)
             for b in ex.boundaries if b.phase == phase and section is not Section.OPTIMIZER}
    return _Facts(ops, collectives, edges)


def _lines(nodes: list[_Node], facts: _Facts, parent: str = "", depth: int = 0) -> Iterator[Line]:
    for node in nodes:
        label = node.name[len(parent) + 1:] if parent else node.name
        if node.repeat is not None:
            first, last, blocks = node.repeat
            prefix = label.rsplit(".", 1)[0] + "." if "." in label else ""
            label = f"{prefix}{first}-{last} (x{blocks}, same)"
        yield facts.line(node.name, label, depth)
        yield from _lines(node.children, facts, node.name, depth + 1)


def _signature(node: _Node, facts: _Facts, root: str) -> tuple:
    """What a block's lines say, names relative to the block: equal for blocks that fold."""
    line = facts.line(node.name, "", 0)
    own = (node.name[len(root):], line.ops, line.traffic, line.inputs, line.outputs)
    return (own, *[_signature(c, facts, root) for c in node.children])


def _fold(nodes: list[_Node], facts: _Facts) -> list[_Node]:
    """Fold each run of consecutive, identical blocks of a list into its first block."""
    out: list[_Node] = []
    for node in nodes:
        node.children = _fold(node.children, facts)
        last = out[-1] if out else None
        if last is not None and _continues(last, node, facts):
            first, _, blocks = last.repeat or (_index(last), 0, 1)
            last.repeat = (first, _index(node), blocks + 1)
        else:
            out.append(node)
    return out


def _index(node: _Node) -> int:
    match = _BLOCK.match(node.name)
    return int(match.group(2)) if match else -1


def _continues(run: _Node, node: _Node, facts: _Facts) -> bool:
    """Whether ``node`` is the block right after ``run``'s last one (either way round) and says the same."""
    a, b = _BLOCK.match(run.name), _BLOCK.match(node.name)
    if a is None or b is None or a.group(1) != b.group(1):
        return False
    last = run.repeat[1] if run.repeat else _index(run)
    if abs(_index(node) - last) != 1:
        return False
    return _signature(run, facts, run.name) == _signature(node, facts, node.name)


# ---------------------------------------------------------------------- summarize
def summarize(ex: "Explanation") -> list[Part]:
    """The sections of ``ex`` that ran anything, in step order (see the module docstring)."""
    events = _events(ex)
    modules = list(dict.fromkeys([*ex.modules, *(e.module for e in events)]))
    modules = [m for m in modules if m != GLOBAL]
    parts = []
    for section in Section:
        facts = _facts(ex, events, section)
        mine = [e for e in events if e.section is section]
        if not mine and not (section is Section.FORWARD or (section is Section.BACKWARD and facts.edges)):
            continue
        active = {m for m in modules if m in facts.ops or m in facts.collectives or m in facts.edges}
        names = modules if section is Section.FORWARD else _with_ancestors(active, modules)
        nodes = _fold(_tree(names), facts)
        if section is Section.BACKWARD:
            nodes = _reverse(nodes)
        has_global = GLOBAL in facts.ops or GLOBAL in facts.collectives
        outside = [_Node(GLOBAL)] if has_global else []
        nodes = nodes + outside if section is Section.FORWARD else outside + nodes
        parts.append(Part(section, tuple(_lines(nodes, facts)), sum(e.collective is None for e in mine),
                          _traffic([e.collective for e in mine if e.collective is not None])))
    return parts


# ---------------------------------------------------------------------- rendering
def _traffic_text(traffic: tuple[Traffic, ...]) -> str:
    return "; ".join(t.describe() for t in traffic) or "-"


def _total_traffic(part: Part) -> str:
    return _traffic_text(part.traffic) if part.traffic else "no collectives"


def render(ex: "Explanation", head: str, rich: bool) -> str:
    """The summary as text under ``head``: rich's tables when ``rich``, else aligned columns."""
    parts = summarize(ex)
    if rich:
        drawn = _render_rich(parts, head)
        if drawn is not None:
            return drawn
    return _render_plain(parts, head)


_COLUMNS: tuple[tuple[str, Literal["left", "right"]], ...] = (
    ("module", "left"), ("ops", "right"), ("collectives (bytes sent)", "left"), ("in -> out (first call)", "left"))


def _render_plain(parts: list[Part], head: str) -> str:
    lines_of = [line for part in parts for line in part.lines]
    name_w = max([2 * line.depth + len(line.label) for line in lines_of] + [5])
    traffic_w = min(max([len(_traffic_text(line.traffic)) for line in lines_of] + [1]), 48)
    traffic_w = max(traffic_w, len(_COLUMNS[2][0]))
    titles = [title for title, _ in _COLUMNS]
    out = [head, f"  {titles[0]:<{name_w}} {titles[1]:>4}  {titles[2]:<{traffic_w}}  {titles[3]}"]
    for part in parts:
        out.append(f"{part.section.title}:")
        for line in part.lines:
            name = "  " * line.depth + line.label
            row = f"  {name:<{name_w}} {line.ops:>4}  {_traffic_text(line.traffic):<{traffic_w}}  {line.edge()}"
            out.append(row.rstrip())
        out.append(f"  {'total':<{name_w}} {part.ops:>4}  {_total_traffic(part)}")
    return "\n".join(out)


def _render_rich(parts: list[Part], head: str) -> str | None:
    try:  # optional: only asked for when rich is installed
        from rich import box
        from rich.console import Console, Group
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for title, justify in _COLUMNS:
        table.add_column(title, justify=justify, no_wrap=True)
    for part in parts:
        title, _, note = part.section.title.partition(" ")
        table.add_row(Text(f"{title}:", style="bold"), "", note)
        for line in part.lines:
            table.add_row(Text("  " * (line.depth + 1) + line.label), str(line.ops), _traffic_text(line.traffic),
                          line.edge())
        table.add_row("  total", str(part.ops), _total_traffic(part), end_section=True)
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(Group(Text(head), table))
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())
