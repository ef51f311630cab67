"""Where ops get their sharding support, by op overload, in priority order.

0. layout handler: takes the whole call when the input layouts match its predicate (softmax
   and nll_loss over a sharded class dim); other layouts go on down this list.
1. custom handler: takes the whole call (random ops, losses); no propagation.
2. strategy: candidate layouts, scored by redistribute cost (``strategy.choose``).
3. decomposition: torch's decomposition of the op into ops that have support.
4. replicate-everything fallback: off by default (``allow_replicate_fallback``).

An op lives in exactly one of the first two registries. Registries are open: users register
their own ops with ``register_sharding`` (per-axis candidates) or the decorators below.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from shardwise.core.spec import DTensorSpec
from shardwise.dispatch.cache import bump_registry_version

__all__ = [
    "register_custom_handler", "register_strategy", "register_sharding",
    "lookup", "Registration", "Kind", "allow_plain_indices", "is_plain_index",
    "register_layout_handler", "layout_handler", "SCALAR_SIGN_ONLY", "scalars_matter_by_sign_only",
]


class Kind(enum.Enum):
    """Which registry an op lives in (see the module docstring)."""

    CUSTOM = "custom handler"
    STRATEGY = "strategy"


@dataclass(frozen=True, slots=True)
class Registration:
    """How one op is supported."""

    kind: Kind
    fn: Callable
    per_axis: bool = False
    # CUSTOM only: ``specialize(op, args, kwargs) -> run | None`` (see register_custom_handler).
    specialize: Callable | None = None


_REGISTRY: dict[Any, Registration] = {}


def _overloads(ops: Iterable[Any]) -> list[Any]:
    """Every OpOverload named: packets (``aten.add``) stand for all their overloads."""
    out = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            out += [getattr(op, name) for name in op.overloads()]
        else:
            out.append(op)
    return out


def _register(ops: Iterable[Any], registration: Registration, replace: bool) -> None:
    for op in _overloads(ops):
        existing = _REGISTRY.get(op)
        if existing is not None and not replace and existing.kind != registration.kind:
            raise ValueError(
                f"{op} already has a sharding {existing.kind.value}; an op is registered in one place only"
            )
        _REGISTRY[op] = registration
    _invalidate_caches()


def _invalidate_caches() -> None:
    """Every change bumps the registry version, which empties the propagation cache (and keeps
    a decision computed meanwhile out of it): see ``shardwise.dispatch.cache``."""
    bump_registry_version()


def register_custom_handler(*ops: Any, replace: bool = False, specialize: Callable | None = None) -> Callable:
    """Decorator: ``fn(op, args, kwargs) -> result`` handles the whole call for ``ops``.

    ``specialize(op, args, kwargs)``, if given, is called once per call signature (what the
    dispatcher caches on: the DTensors' specs, the other arguments' kinds) and may return a
    leaner ``run(op, args, kwargs, dtensors) -> result`` that the dispatcher then calls for
    every call with that signature instead of ``fn``, or None to keep ``fn``. For handlers
    whose common layouts need no communication: the hot path then costs what an ordinary
    op's does (no per-call planning lookups)."""

    def wrap(fn: Callable) -> Callable:
        _register(ops, Registration(Kind.CUSTOM, fn, specialize=specialize), replace)
        return fn

    return wrap


def register_strategy(*ops: Any, per_axis: bool = True, replace: bool = False) -> Callable:
    """Decorator: ``fn(schema) -> candidates`` for ``ops``.

    With ``per_axis`` (the default) candidates are for ONE mesh axis: tuples of placements,
    outputs first then DTensor inputs (None for "not a DTensor"); they are expanded to every
    axis. Otherwise ``fn`` returns full ``Candidate`` objects.
    """

    def wrap(fn: Callable) -> Callable:
        _register(ops, Registration(Kind.STRATEGY, fn, per_axis), replace)
        return fn

    return wrap


def register_sharding(op: Any, *, replace: bool = True) -> Callable:
    """Public: teach shardwise how to shard ``op`` (an aten op or a ``torch.library`` custom op,
    or a list of them).

    The decorated function returns the layouts the op accepts on ONE mesh axis, as
    ``(output_placements, input_placements)`` pairs of lists; shardwise expands them to every
    mesh axis and picks the cheapest. It is called in one of two ways, told apart by its
    signature:

    * shardwise's: one parameter named ``schema`` (or annotated ``OpSchema``) receives the
      ``OpSchema`` (``schema.specs`` are the inputs' specs, ``schema.args`` the call's arguments
      with specs in place of DTensors); input placements are listed per DTensor input.
    * torch's: any other signature is called with the op's own arguments (a ``DTensorSpec`` in
      place of each DTensor); input placements are listed per positional argument, ``None``
      for those that are not tensors, as ``torch.distributed.tensor.experimental``'s.

    Example:
        >>> @shardwise.register_sharding(torch.ops.mylib.scale.default)
        ... def _(schema):
        ...     return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]
        >>> @shardwise.register_sharding(torch.ops.aten._softmax.default)
        ... def _(x, dim, half_to_float):  # torch's convention
        ...     return [([Replicate()], [Replicate(), None, None])]
    """
    ops = op if isinstance(op, (list, tuple)) else [op]

    def wrap(fn: Callable) -> Callable:
        candidates = _schema_candidates(fn) if _takes_schema(fn) else _torch_style_candidates(fn)
        _register(ops, Registration(Kind.STRATEGY, candidates, True), replace)
        return fn

    return wrap


def _takes_schema(fn: Callable) -> bool:
    """shardwise's convention: one parameter, named ``schema`` or annotated ``OpSchema``."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return False
    note = params[0].annotation
    return params[0].name in ("schema", "op_schema") or getattr(note, "__name__", note) == "OpSchema"


def _schema_candidates(fn: Callable) -> Callable:
    def per_axis(schema: Any) -> list[tuple]:
        return [tuple(outs) + tuple(ins) for outs, ins in fn(schema)]

    return per_axis


def _torch_style_candidates(fn: Callable) -> Callable:
    """``fn`` called as torch calls a sharding function; its per-argument input placements
    mapped to shardwise's per-DTensor list (a list of DTensors takes its argument's entry)."""
    def per_axis(schema: Any) -> list[tuple]:
        out = []
        for outs, ins in fn(*schema.args, **dict(schema.kwargs)):
            ins = list(ins) + [None] * (len(schema.args) - len(ins))
            per_spec = [p for arg, p in zip(schema.args, ins) for _ in range(_spec_count(arg))]
            if len(per_spec) != len(schema.specs):
                raise ValueError(f"register_sharding({schema.op}): {getattr(fn, '__name__', fn)} gives input "
                                 f"placements per positional argument (torch's convention), but "
                                 f"{len(schema.specs) - len(per_spec)} DTensor(s) came as keyword arguments")
            out.append(tuple(outs) + tuple(per_spec))
        return out

    return per_axis


def _spec_count(arg: Any) -> int:
    if isinstance(arg, DTensorSpec):
        return 1
    if isinstance(arg, (list, tuple)):
        return sum(isinstance(a, DTensorSpec) for a in arg)
    return 0


# Ops whose layouts depend on a Python float argument only through its sign (and whether it
# is 1): pointwise ops. The dispatch cache keys their floats by that class, so a learning rate
# or bias correction that changes every step does not re-run propagation every step.
SCALAR_SIGN_ONLY: set = set()


def scalars_matter_by_sign_only(*ops: Any) -> None:
    """Declare that ``ops``' layouts and output metadata depend on float arguments only through
    their sign, whether they are 0 or 1, or NaN (never shapes: not for ops with scale factors)."""
    SCALAR_SIGN_ONLY.update(_overloads(ops))
    _invalidate_caches()


_LAYOUT_HANDLERS: dict[Any, list[tuple[Callable, Callable]]] = {}


def register_layout_handler(*ops: Any, applies: Callable[[Any], bool]) -> Callable:
    """Decorator: ``fn(op, args, kwargs)`` handles calls of ``ops`` whose ``OpSchema`` satisfies
    ``applies``, ahead of the op's regular registration (which keeps every other layout).

    For layouts that need communication inside the op, e.g. softmax over a sharded dim: two
    small all-reduces instead of gathering the whole tensor. The predicate sees only layouts,
    so its answer is cached with the rest of the propagation.
    """

    def wrap(fn: Callable) -> Callable:
        for op in _overloads(ops):
            _LAYOUT_HANDLERS.setdefault(op, []).append((applies, fn))
        _invalidate_caches()
        return fn

    return wrap


def layout_handler(op: Any, schema: Any) -> Callable | None:
    """The layout handler of ``op`` whose predicate accepts ``schema``, if any."""
    for applies, fn in _LAYOUT_HANDLERS.get(op, ()):
        if applies(schema):
            return fn
    return None


def lookup(op: Any) -> Registration | None:
    """The registration of ``op``, if any."""
    return _REGISTRY.get(op)


_PLAIN_INDICES: dict[Any, tuple[frozenset[str], frozenset[str]]] = {}


def allow_plain_indices(*ops: Any, arguments: tuple[str, ...] = ("indices", "index"), values: tuple[str, ...] = ()) -> None:
    """Plain integer tensors passed to ``ops`` as ``arguments`` are indices, not data.

    Like int arguments they are taken to be the same on every rank (replicated), so
    ``x[torch.tensor([0, 2])]`` works on a DTensor ``x`` without ``implicit_replication``.
    ``values`` names arguments taken as replicated whatever their dtype (autograd's backward
    of ``index_put`` passes its zeros as a plain tensor).
    """
    for op in _overloads(ops):
        _PLAIN_INDICES[op] = (frozenset(arguments), frozenset(values))
    _invalidate_caches()


def is_plain_index(op: Any, where: str, tensor: torch.Tensor) -> bool:
    """Whether the plain tensor at ``where`` (``#i``, ``#i[j]`` or a keyword) may stay plain in ``op``."""
    names = _PLAIN_INDICES.get(op)
    if names is None:
        return False
    if where.startswith("#"):
        position = int(where[1:].split("[")[0])
        arguments = op._schema.arguments
        where = arguments[position].name if position < len(arguments) else ""
    indices, values = names
    return where in values or (where in indices and not (tensor.is_floating_point() or tensor.is_complex()))
