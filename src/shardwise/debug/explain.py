"""explain(): what every DTensor op of a block of code did, and why, on this rank.

``with shardwise.debug.explain() as ex:`` records, for each ATen op that reaches the DTensor
dispatcher: the module running it (named as ``CommDebugMode`` names them), forward or backward,
the op, its input and output layouts, the strategy the dispatcher chose with the bytes it
costs and the cheapest alternatives it rejected, and every collective issued for it (mesh axis,
bytes this rank sends). Collectives outside any op (an explicit
``redistribute``, fully_shard's gathers) are filed under their module too.

Layouts are written in shardwise's compact syntax (the one every error message uses):

* ``f32[2048@tp,256]``: dtype short name (f32, bf16, i64, b8 ...), then each dim's GLOBAL
  size; ``@axis`` after a dim sharded on that mesh axis.
* ``f32[2048@dp@tp,256]``: a dim sharded on several mesh axes lists them in mesh order.
* ``f32[8,16]{P(sum)@tp}``: a trailing ``{...}`` lists pending reductions (Partial) and their
  mesh axes; a tensor without ``@`` or ``{}`` is replicated on every axis.

``print(ex)`` renders, by default, a summary (``Detail.SUMMARY``, ``explain_summary``): one line
per module per phase (forward, backward, then clipping and the optimizer step after backward)
with its collectives and the layouts at its boundary, repeated identical blocks folded;
``explain(detail=Detail.FULL)`` (the trainer's ``--explain full``) renders the whole tree per
module, every op with its strategy. Both draw with ``rich`` when it is installed, plain text
otherwise (docs/explain.md). ``ex.to_json()`` holds everything either shows, as JSON text, and
``Explanation.from_json`` reads it back.

Cost: nothing when not explaining. Entering swaps the function ``DTensor.__torch_dispatch__``
calls (``shardwise.tensor.dtensor.dispatch``) for a recording wrapper and adds a collective recorder; leaving puts both back. The
dispatch cache is untouched: the wrapper asks the dispatcher's propagation (a pure, per-rank
computation on global metadata) for every call it sees, so a cached call is explained like a
first one.

Example:
    >>> with shardwise.debug.explain() as ex:
    ...     loss = model(x).sum(); loss.backward()
    >>> print(ex)
    >>> ex.ops[0].op, ex.ops[0].inputs
    ('aten.mm', ['f32[8,16]', 'f32[16,64@tp]'])
"""

from __future__ import annotations

import enum
import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from shardwise import comm
from shardwise.compile.opaque import never_compiled
from shardwise.debug import explain_summary
from shardwise.debug.module_tracker import GLOBAL, Boundary, ModuleTracker, current_phase
from shardwise.dispatch import dispatcher, propagation, registry, walk
from shardwise.dispatch.render import plain
from shardwise.dispatch.strategy import OpSchema, changed_axes, input_bytes, input_cost, replicate_all
from shardwise.tensor import dtensor
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh
from shardwise.core.spec import DTensorSpec, render_layout
from shardwise.units import format_bytes

__all__ = ["explain", "Detail", "Explanation", "OpEntry", "Strategy", "CollectiveEntry", "Boundary"]


class Detail(enum.Enum):
    """What ``print(ex)`` shows: a line per module per phase, or every op (docs/explain.md)."""

    SUMMARY = "summary"
    FULL = "full"


# ---------------------------------------------------------------------- records
@dataclass
class CollectiveEntry:
    """One collective: kind, mesh axis, bytes this rank sent, module, phase; for an expert-parallel
    all_to_all (token dispatch and combine, docs/parallelism.md, "Mixture of experts and expert parallelism")
    the bytes sent to each peer of the axis, this rank's own entry 0."""

    kind: str
    axis: str
    bytes: int
    module: str = GLOBAL
    phase: str = "forward"
    per_peer: list[int] | None = None
    order: int = -1  # when it ran among the explanation's ops and collectives (-1: not known)

    def describe(self) -> str:
        peers = f" (per peer: {', '.join(format_bytes(b) for b in self.per_peer)})" if self.per_peer else ""
        return f"{self.kind} on {self.axis}: {format_bytes(self.bytes)}{peers}"


@dataclass
class Strategy:
    """One candidate layout of an op: where its DTensor inputs must be, where its outputs land,
    the bytes the busiest rank sends to move the inputs there, and the predicted time of that
    move (``shardwise.cost``, the active profile): what the dispatcher chooses by."""

    inputs: list[str]
    outputs: list[str]
    cost_bytes: float
    cost_s: float = 0.0

    def describe(self) -> str:
        if self.cost_bytes == float("inf"):
            cost = "impossible"
        else:
            cost = f"{format_bytes(int(self.cost_bytes))}, {self.cost_s * 1e6:.0f} us predicted"
        return f"({', '.join(self.inputs)}) -> ({', '.join(self.outputs)}) [{cost}]"


@dataclass
class OpEntry:
    """One op on DTensors: where it ran, its layouts, its strategy and its collectives.

    ``kind`` is the dispatcher's action: "run" (a sharding strategy chose the layouts: see
    ``chosen`` and ``alternatives``), "custom" (a handler of its own), "decompose" (its parts
    follow as ops of ``depth + 1``), "error" (the op raised) or "unknown" (its strategy could not
    be recomputed; layouts and collectives are still recorded).
    """

    op: str
    module: str
    phase: str
    inputs: list[str]
    outputs: list[str] = field(default_factory=list)
    kind: str = "run"
    chosen: Strategy | None = None
    alternatives: list[Strategy] = field(default_factory=list)
    collectives: list[CollectiveEntry] = field(default_factory=list)
    depth: int = 0
    order: int = -1  # when it started among the explanation's ops and collectives (-1: not known)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)


@dataclass
class Explanation:
    """What ``explain`` recorded on this rank (``print`` it, or read ``ops`` / ``to_json``)."""

    rank: int = 0
    modules: list[str] = field(default_factory=list)  # in order of first entry
    ops: list[OpEntry] = field(default_factory=list)
    collectives: list[CollectiveEntry] = field(default_factory=list)  # outside any op
    boundaries: list[Boundary] = field(default_factory=list)  # layouts at module edges, first call

    def all_collectives(self) -> list[CollectiveEntry]:
        """Every collective, those of ops and those outside any op."""
        return [c for op in self.ops for c in op.collectives] + self.collectives

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes for c in self.all_collectives())

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        """The explanation as JSON text (``Explanation.from_json`` reads it back)."""
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    @classmethod
    def from_json(cls, text: str | dict) -> "Explanation":
        data = json.loads(text) if isinstance(text, str) else text
        ops = []
        for o in data["ops"]:
            chosen = Strategy(**o["chosen"]) if o["chosen"] is not None else None
            ops.append(OpEntry(**{**o, "chosen": chosen,
                                  "alternatives": [Strategy(**a) for a in o["alternatives"]],
                                  "collectives": [_collective(c) for c in o["collectives"]]}))
        boundaries = [Boundary(**b) for b in data.get("boundaries", [])]
        return cls(data["rank"], list(data["modules"]), ops, [_collective(c) for c in data["collectives"]],
                   boundaries)

    # ------------------------------------------------------------------ rendering
    def render(self, rich: bool | None = None, detail: Detail = Detail.SUMMARY) -> str:
        """The summary (``Detail.SUMMARY``) or the tree of every op (``Detail.FULL``) as text;
        ``rich`` (default: when installed) draws it with rich."""
        if not isinstance(detail, Detail):
            raise TypeError(f"detail must be a shardwise.debug.Detail (SUMMARY or FULL), not {detail!r}")
        if rich is None:
            rich = _rich_available()
        if detail is Detail.SUMMARY:
            head = f"{_header(self)} (a line per module; every op: --explain full, explain(detail=Detail.FULL))"
            return explain_summary.render(self, head, rich)
        return _render_rich(self) if rich else _render_plain(self)

    def __str__(self) -> str:
        return self.render()


def _json_default(value: Any) -> Any:
    if value == float("inf"):
        return "inf"
    raise TypeError(f"not JSON serializable: {value!r}")


# ---------------------------------------------------------------------- recording
_ACTIVE: list["explain"] = []


class explain:
    """Context manager: record every DTensor op and collective inside it (see the module docstring).

    Args:
        alternatives: how many rejected candidates to keep per op, cheapest first.
        detail: what ``print`` shows: ``Detail.SUMMARY`` (a line per module per phase) or
            ``Detail.FULL`` (every op); ``render(detail=...)`` gives either at any time.
    """

    def __init__(self, alternatives: int = 2, detail: Detail = Detail.SUMMARY) -> None:
        if not isinstance(detail, Detail):
            raise TypeError(f"explain(detail=...) takes shardwise.debug.Detail.SUMMARY or Detail.FULL, "
                            f"not {detail!r}")
        self.alternatives = alternatives
        self.detail = detail
        self._order = 0
        self.explanation = Explanation()
        self._stack: list[OpEntry] = []
        self._tracker: ModuleTracker | None = None
        self._saved: Callable | None = None

    # The Explanation's reading side, so ``ex`` works as the result directly.
    def __getattr__(self, name: str) -> Any:
        if name == "explanation":  # not set yet (construction failed): no recursion
            raise AttributeError(name)
        return getattr(self.explanation, name)

    def __str__(self) -> str:
        return self.explanation.render(detail=self.detail)

    def __enter__(self) -> "explain":
        if _ACTIVE:
            raise RuntimeError("shardwise.debug.explain() is already active: explain blocks do not nest")
        self.explanation = Explanation(rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self._order = 0
        self._tracker = ModuleTracker(describe=_layouts, clock=self._next)
        self._tracker.start()
        self._saved = dtensor.dispatch
        dtensor.dispatch = _recording_dispatch
        comm.add_recorder(self)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        dtensor.dispatch = self._saved
        comm.remove_recorder(self)
        _ACTIVE.remove(self)
        if self._tracker is not None:
            self.explanation.modules = list(self._tracker.modules)
            self.explanation.boundaries = list(self._tracker.boundaries.values())
            self._tracker.stop()

    # ------------------------------------------------------------------ hooks
    def _next(self) -> int:
        """The next place in the order ops and collectives happen (what the summary sorts by)."""
        self._order += 1
        return self._order

    def _where(self) -> tuple[str, str]:
        active = self._tracker.active() if self._tracker is not None else ()
        return (active[-1] if active else GLOBAL), current_phase().value

    @never_compiled
    def _dispatch(self, inner: Callable, func: Any, args: tuple, kwargs: dict) -> Any:
        module, phase = self._where()
        dtensors = _dtensors(args, kwargs)
        entry = OpEntry(_op_name(func), module, phase, [dt._spec.render() for dt in dtensors], depth=len(self._stack),
                        order=self._next())
        self.explanation.ops.append(entry)
        try:
            _strategy(entry, func, args, kwargs, dtensors, self.alternatives)
        except Exception:  # noqa: BLE001 - a bad call raises below, with its own message
            entry.kind = "unknown"
        self._stack.append(entry)
        try:
            out = inner(func, args, kwargs)
        except BaseException:
            entry.kind = "error"
            raise
        finally:
            self._stack.pop()
        entry.outputs = [dt._spec.render() for dt in _dtensors(out, {})]
        return out

    def record(self, kind: str, mesh: DeviceMesh, axis: int, bytes_sent: int) -> None:
        """Called by ``comm`` for each collective (the ``CommRecorder`` protocol); an uneven
        all_to_all (expert-parallel dispatch and combine) also tells its bytes per peer."""
        module, phase = self._where()
        entry = CollectiveEntry(kind, mesh.axis_name(axis), bytes_sent, module, phase, comm.per_peer_bytes(),
                                self._next())
        (self._stack[-1].collectives if self._stack else self.explanation.collectives).append(entry)


def _collective(data: dict) -> CollectiveEntry:
    """A collective read back from JSON (files written before ``cause`` was dropped still load)."""
    return CollectiveEntry(**{k: v for k, v in data.items() if k != "cause"})


@never_compiled
def _recording_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """What ``DTensor.__torch_dispatch__`` calls while explaining: record, then dispatch."""
    active = _ACTIVE[-1]
    return active._dispatch(active._saved, func, args, kwargs)


def _dtensors(args: Any, kwargs: dict) -> list:
    """The DTensors among the arguments (or results), in the dispatcher's order (``walk.dtensors``)."""
    return walk.dtensors(args if isinstance(args, (tuple, list)) else (args,), kwargs, DTensor)


def _layouts(values: Any) -> list[str]:
    """The layout of every tensor among ``values`` (a module's arguments, results or gradients):
    DTensors in the compact syntax, plain tensors as ``f32[8,16](plain)`` (their local shape)."""
    leaves = [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
    return [v._spec.render() if isinstance(v, DTensor) else plain(v) for v in leaves]


def _op_name(func: Any) -> str:
    return str(func).replace("aten::", "aten.").replace(".default", "")


# ---------------------------------------------------------------------- strategies
def _strategy(entry: OpEntry, func: Any, args: tuple, kwargs: dict, dtensors: list, keep: int) -> None:
    """Fill ``entry.kind``, ``chosen`` and ``alternatives`` from the dispatcher's own propagation."""
    if not dtensors:
        entry.kind = "custom"
        return
    plan = dispatcher.plan_call(func, args, kwargs, dtensors)
    entry.kind = plan.action.value
    if plan.action is not propagation.Action.RUN:
        return
    specs = [dt._spec for dt in dtensors]
    outputs = [s for s in plan.output_specs]
    chosen_inputs = tuple(t.placements if t is not None else s.placements for s, t in zip(specs, plan.input_specs))
    entry.chosen = _as_strategy(specs, chosen_inputs, outputs, [s.placements if s is not None else None for s in outputs])
    candidates = _candidates(func, args, kwargs, specs, len(outputs))
    chosen_key = (chosen_inputs, tuple(s.placements if s is not None else None for s in outputs))
    ranked = []
    for index, c in enumerate(candidates):
        inputs = tuple(t if t is not None else s.placements for s, t in zip(specs, c.inputs))
        if (inputs, tuple(c.outputs)) == chosen_key or len(c.inputs) != len(specs):
            continue
        cost = _cost(specs, c.inputs)
        if cost[0] != float("inf"):
            ranked.append((cost, index, inputs, c.outputs))
    ranked.sort(key=lambda r: (r[0], r[1]))
    seen: set = set()
    for _, _, inputs, outs in ranked:
        if (inputs, tuple(outs)) in seen:
            continue
        seen.add((inputs, tuple(outs)))
        entry.alternatives.append(_as_strategy(specs, inputs, outputs, list(outs)))
        if len(entry.alternatives) >= keep:
            break


def _candidates(func: Any, args: tuple, kwargs: dict, specs: list, num_outputs: int) -> list:
    """Every candidate the op's registration lists that propagation would consider."""
    schema = OpSchema(func, *walk.spec_tree(args, kwargs, DTensor), tuple(specs))
    registration = registry.lookup(func)
    if registration is None:
        return [replicate_all(schema, num_outputs)]
    return [c for c in propagation.registered_candidates(schema, registration, num_outputs)
            if propagation.keeps_mutated(func, schema, c)]


def _cost(specs: list, targets: tuple) -> tuple[float, int]:
    """What ``strategy.choose`` ranks by: predicted seconds, then mesh axes changed."""
    return (sum(input_cost(s, t) for s, t in zip(specs, targets)), sum(changed_axes(s, t) for s, t in zip(specs, targets)))


def _as_strategy(specs: list, inputs: tuple, out_specs: list, out_placements: list) -> Strategy:
    ins = [render_layout(s.mesh, p, s.tensor_meta) for s, p in zip(specs, inputs)]
    outs = [render_layout(o.mesh, p, o.tensor_meta) for o, p in zip(out_specs, out_placements)
            if isinstance(o, DTensorSpec) and p is not None]
    return Strategy(ins, outs, sum(input_bytes(s, p) for s, p in zip(specs, inputs)),
                    sum(input_cost(s, p) for s, p in zip(specs, inputs)))


# ---------------------------------------------------------------------- rendering


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _op_lines(op: OpEntry) -> list[str]:
    """The op's own line, then its strategy and collectives (indented by the caller)."""
    back = " (backward)" if op.phase == "backward" else ""
    head = f"{op.op}{back}: {', '.join(op.inputs)} -> {', '.join(op.outputs) or '-'}"
    lines = [head]
    if op.kind != "run":
        lines.append(f"  strategy: {op.kind}")
    elif op.chosen is not None:
        lines.append(f"  chose {op.chosen.describe()}")
        lines += [f"  over  {alt.describe()}" for alt in op.alternatives]
    lines += [f"  {c.describe()}" for c in op.collectives]
    return lines


def _by_module(ex: Explanation) -> list[tuple[str, list]]:
    """(module, its ops and loose collectives in order) for Global and every module entered."""
    names = [GLOBAL, *[m for m in ex.modules if m != GLOBAL]]
    names += [m for m in dict.fromkeys(o.module for o in ex.ops) if m not in names]
    items: dict[str, list] = {n: [] for n in names}
    for op in ex.ops:
        items[op.module].append(op)
    for c in ex.collectives:
        items.setdefault(c.module, []).append(c)
    return [(n, items[n]) for n in names]


def _item_lines(item: Any) -> list[str]:
    if isinstance(item, OpEntry):
        pad = "  " * item.depth
        return [pad + line for line in _op_lines(item)]
    return [f"{item.describe()} (outside any op" + (", backward)" if item.phase == "backward" else ")")]


def _header(ex: Explanation) -> str:
    n = len(ex.all_collectives())
    return f"explain (rank {ex.rank}): {len(ex.ops)} ops, {n} collectives, {format_bytes(ex.bytes_sent)} sent"


def _render_plain(ex: Explanation) -> str:
    lines = [_header(ex)]
    modules = _by_module(ex)
    names = [m for m, _ in modules if m != GLOBAL]
    for module, items in modules:
        if not items and module == GLOBAL:
            continue
        # Indented under the modules entered that contain it (a ModuleList never runs itself).
        depth = 0 if module == GLOBAL else sum(module.startswith(m + ".") for m in names) + 1
        lines.append("  " * depth + f"{module}")
        for item in items:
            lines += ["  " * (depth + 1) + line for line in _item_lines(item)]
    return "\n".join(lines)


def _render_rich(ex: Explanation) -> str:
    try:  # optional: only called when rich is installed (``_rich_available``)
        from rich.console import Console
        from rich.text import Text
        from rich.tree import Tree
    except ImportError:
        return _render_plain(ex)

    root = Tree(Text(_header(ex)))
    nodes: dict[str, Any] = {}
    for module, items in _by_module(ex):
        if not items and module == GLOBAL:
            continue
        parents = [m for m in nodes if module.startswith(m + ".")]
        parent = nodes[max(parents, key=len)] if parents else root
        node = nodes[module] = parent.add(Text(module, style="bold"))
        for item in items:
            lines = _item_lines(item)
            sub = node.add(Text(lines[0].strip()))
            for line in lines[1:]:
                sub.add(Text(line.strip()))
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(root)
    return out.getvalue().rstrip("\n")
