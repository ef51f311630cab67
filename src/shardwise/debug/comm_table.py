"""CommDebugMode's per-module table: the module tree, each module's collectives by phase.

Pure: built from the records and the modules entered, no process group. A module's lines
count every collective issued while it was active (its submodules' included), grouped by
kind and mesh axis; at noise level 2 and above each collective is also listed once, under
the innermost module that issued it. Example (noise level 1)::

    Global
      forward   all_reduce  x1  on tp  96 B
      backward  all_reduce  x1  on tp  96 B
      Sequential (Sequential)
        ...
        Sequential.2 (Linear)  weight: f32[8,16@tp]  bias: f32[8]
          forward   all_reduce  x1  on tp  96 B
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Iterable

from shardwise.units import format_bytes
from shardwise.debug.module_tracker import GLOBAL, ModuleInfo, Phase

if TYPE_CHECKING:
    from shardwise.debug.comm_mode import CommRecord

__all__ = ["render_table", "format_bytes"]

INDENT = "  "


def render_table(records: list["CommRecord"], modules: dict[str, ModuleInfo], noise_level: int) -> str:
    """The tree of ``GLOBAL`` and ``modules`` (by path prefix), each with its collectives."""
    children = _children(list(modules))
    lines: list[str] = []

    def visit(name: str, depth: int) -> None:
        pad = INDENT * depth
        lines.append(pad + _heading(name, modules.get(name), noise_level))
        mine = [r for r in records if name == GLOBAL or name in r.modules]
        lines.extend(pad + INDENT + line for line in _aggregate(mine))
        issued = [(i, r) for i, r in enumerate(records, 1) if r.module == name]
        if noise_level >= 2 and issued:
            lines.append(pad + INDENT + "issued here:")
            lines.extend(pad + INDENT * 2 + _one(i, r) for i, r in issued)
        for child in children[name]:
            visit(child, depth + 1)

    visit(GLOBAL, 0)
    if not records:
        lines.append(INDENT + "no collectives")
    return "\n".join(lines)


def _children(names: list[str]) -> dict[str, list[str]]:
    """Parent of each module: the longest other path that is a dotted prefix, else Global."""
    children: dict[str, list[str]] = defaultdict(list)
    known = set(names)
    for name in names:
        parts = name.split(".")
        parent = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)
                       if ".".join(parts[:k]) in known), GLOBAL)
        children[parent].append(name)
    return children


def _heading(name: str, info: ModuleInfo | None, noise_level: int) -> str:
    if info is None or noise_level < 1:
        return name
    params = "  ".join(f"{p}: {_layout(spec)}" for p, spec in info.parameters.items())
    return f"{name} ({info.type_name})" + (f"  {params}" if params else "")


def _layout(spec) -> str:
    render = getattr(spec, "render", None)
    return render() if render is not None else str(spec)


def _aggregate(records: Iterable["CommRecord"]) -> list[str]:
    """One line per (phase, kind, mesh axis): count and bytes sent."""
    totals: dict[tuple, list[int]] = {}
    for r in records:
        count_bytes = totals.setdefault((r.phase, r.kind, r.axis_name), [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += r.bytes_sent
    order = {Phase.FORWARD: 0, Phase.BACKWARD: 1}
    rows = sorted(totals.items(), key=lambda item: order[item[0][0]])
    return [f"{phase.value:<9} {kind:<15} x{count:<3} on {axis:<8} {format_bytes(nbytes)}"
            for (phase, kind, axis), (count, nbytes) in rows]


def _one(index: int, r: "CommRecord") -> str:
    return f"#{index:<3} {r.phase.value:<9} {r.kind:<15} on {r.axis_name:<8} {format_bytes(r.bytes_sent)}"
