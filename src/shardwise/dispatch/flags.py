"""Per-context dispatch flags: implicit replication and the replicate fallback.

Both are context variables, not process globals: a ``with implicit_replication():`` in one
thread (or asyncio task) does not change what another thread's ops do, e.g. autograd running
a backward pass, a data loader or a checkpoint writer on their own threads. A new thread starts
with the defaults. The replicate fallback also has a process-wide default
(``allow_replicate_fallback.set``), which every context without its own setting follows.

The flags are part of the dispatch cache key (one ``ContextVar.get`` per op), so a decision made
under one setting is never reused under another.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any, NamedTuple

import torch

_dynamo_compiling = torch.compiler.is_dynamo_compiling

__all__ = ["Flags", "FLAGS", "current", "implicit", "fallback_enabled", "set_fallback_default", "push", "push_implicit", "pop"]


class Flags(NamedTuple):
    """``implicit``: False, True (plain tensors count as replicated) or an ``ImplicitScope``;
    ``fallback``: True / False, or None for the process-wide default."""

    implicit: Any = False
    fallback: bool | None = None


FLAGS: ContextVar[Flags] = ContextVar("shardwise_dispatch_flags", default=Flags())
_FALLBACK_DEFAULT = [False]


def current() -> Flags:
    return FLAGS.get()


def implicit() -> Any:
    """The implicit-replication setting of the current context."""
    return FLAGS.get().implicit


def fallback_enabled() -> bool:
    """Whether ops without sharding support run replicated in the current context."""
    fallback = FLAGS.get().fallback
    return _FALLBACK_DEFAULT[0] if fallback is None else fallback


def set_fallback_default(enabled: bool) -> bool:
    """Set the process-wide fallback default; whether it changed."""
    changed = _FALLBACK_DEFAULT[0] != enabled
    _FALLBACK_DEFAULT[0] = enabled
    return changed


def push(**changes: Any) -> Token | None:
    """Enter a context with some flags changed; ``pop`` the token to leave it.

    While Dynamo captures a program this does nothing (Dynamo cannot trace context variables,
    and would break the graph): the flags matter to the dispatcher, which runs when AOTAutograd
    traces the captured graph, outside the captured ``with`` block, as before."""
    if _dynamo_compiling():
        return None
    return FLAGS.set(FLAGS.get()._replace(**changes))


def push_implicit(scope: Any) -> Token | None:
    """``push`` for ``implicit_replication(scope)``: ``scope`` None means every plain tensor; a
    scope never narrows an enclosing full setting."""
    if _dynamo_compiling():
        return None
    before = FLAGS.get()
    return FLAGS.set(before._replace(implicit=True if scope is None or before.implicit is True else scope))


def pop(token: Token | None) -> None:
    """Leave the context ``push`` entered (restoring the flags it replaced)."""
    if token is None:
        return
    try:
        FLAGS.reset(token)
    except ValueError:  # left in another context than it was entered in: restore by value
        FLAGS.set(token.old_value if token.old_value is not Token.MISSING else Flags())
