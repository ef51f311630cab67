"""Why a collective runs: the layout change it serves, and the op that needed it.

``comm`` only knows a collective's kind, mesh axis and bytes. The code that decides to move a
tensor knows more: the redistribute executor knows the tensor's layout before and after
(``f32[8@tp,4]{P(sum)@tp} -> f32[8,4]``), the op dispatcher knows the op whose inputs it moves
(``aten.mm``). They announce it here for the duration of the move, and ``CommDebugMode``
attaches it to each collective it records, for its per-module table. A context variable, so
that autograd threads and nested moves each see their own; setting one costs a few hundred ns.

Example (in the redistribute executor):
    >>> with context.redistributing(src_spec, dst_spec):
    ...     run_the_plan()
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.core.spec import DTensorSpec

__all__ = ["Cause", "redistributing", "during_op", "current_cause"]


@dataclass(frozen=True, slots=True)
class Cause:
    """What a collective served: a layout change and, when known, the op that asked for it."""

    src: "DTensorSpec | None" = None
    dst: "DTensorSpec | None" = None
    op: Any = None  # an ATen op (rendered with str) or a label

    def describe(self) -> str:
        """E.g. ``f32[8,4@tp] -> f32[8,4] for aten.mm.default``."""
        parts = []
        if self.src is not None and self.dst is not None:
            parts.append(f"{self.src.render()} -> {self.dst.render()}")
        if self.op is not None:
            parts.append(f"for {self.op}")
        return " ".join(parts)


_LAYOUTS: ContextVar[tuple | None] = ContextVar("shardwise_comm_layouts", default=None)
_OP: ContextVar[Any] = ContextVar("shardwise_comm_op", default=None)


def current_cause() -> Cause | None:
    """The layout change and op announced by the innermost enclosing move, if any."""
    layouts, op = _LAYOUTS.get(), _OP.get()
    if layouts is None and op is None:
        return None
    src, dst = layouts if layouts is not None else (None, None)
    return Cause(src, dst, op)


class _Scoped:
    """Set a context variable for a ``with`` block (a class, not a generator: this sits on the
    redistribute path)."""

    __slots__ = ("_var", "_value", "_token")

    def __init__(self, var: ContextVar, value: Any) -> None:
        self._var, self._value = var, value
        self._token: Token | None = None

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc) -> None:
        self._var.reset(self._token)


def redistributing(src: "DTensorSpec", dst: "DTensorSpec") -> _Scoped:
    """Collectives issued inside move a tensor from layout ``src`` to layout ``dst``."""
    return _Scoped(_LAYOUTS, (src, dst))


def during_op(op: Any) -> _Scoped:
    """Collectives issued inside move the inputs (or outputs) of ``op``."""
    return _Scoped(_OP, op)
