"""Placements: how a logical tensor is laid out along ONE mesh axis.

A DTensor carries one placement per mesh axis:

* ``Shard(dim)``: the tensor is cut along tensor dim ``dim`` into ``torch.chunk`` pieces, one per
  rank of the axis (ceil-sized pieces; trailing ranks may hold fewer or zero rows).
* ``Replicate()``: every rank of the axis holds the same values.
* ``Partial(op)``: every rank holds a same-shaped tensor; the logical value is the reduction
  (``sum``, ``avg``, ``max``, ``min``, ``product``) of them over the axis.

Placements are immutable values; they own their own arithmetic (chunk sizes and offsets, how to
split a replicated value into partial contributions) so that the contract
``reduce(partition(v)) == v`` lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from shardwise.core.foreign import foreign_note

__all__ = ["Placement", "Shard", "Replicate", "Partial", "check_placements", "as_placements"]


class Placement:
    """Base class of the three placements; use the ``is_*`` predicates rather than isinstance."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """True if this is ``Shard`` (on tensor dim ``dim``, when given)."""
        return False

    def is_replicate(self) -> bool:
        """True if this is ``Replicate()``."""
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """True if this is ``Partial`` (with reduce op ``reduce_op``, when given)."""
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Cut the tensor along tensor dim ``dim`` over the ranks of a mesh axis (torch.chunk rules).

    A negative ``dim`` is kept as given until the tensor's rank is known; specs normalize it.
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def normalized(self, ndim: int) -> "Shard":
        """This placement with ``dim`` made non-negative for a tensor of rank ``ndim``."""
        if not -ndim <= self.dim < max(ndim, 1) or ndim == 0:
            raise IndexError(f"Shard({self.dim}) is outside a tensor of rank {ndim}")
        return self if self.dim >= 0 else Shard(self.dim + ndim)

    @staticmethod
    def chunk(size: int, num_chunks: int, index: int) -> tuple[int, int]:
        """(length, offset) of piece ``index`` when ``size`` rows are cut into ``num_chunks``.

        torch.chunk semantics: every piece has ceil(size / num_chunks) rows except the trailing
        ones, which may be shorter or empty. Offsets of empty pieces are clamped to ``size``.
        """
        full = -(-size // num_chunks) if num_chunks > 0 else 0
        start = min(full * index, size)
        return min(full, size - start), start

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh axis holds the whole (possibly otherwise sharded) value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank holds a contribution; the value is their ``reduce_op`` over the mesh axis.

    ``sum`` and ``avg`` are linear, ``max`` and ``min`` are orders, ``product`` is
    multiplicative: only ops that commute with the pending reduction may keep a Partial (the
    dispatcher enforces this).
    """

    reduce_op: str = "sum"
    REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg", "max", "min", "product")
    # Other spellings of a reduction, kept as the one name so that rules and caches see one op:
    # ``prod`` is torch.prod's name for c10d's ``product``.
    ALIASES: ClassVar[dict[str, str]] = {"prod": "product"}

    def __post_init__(self) -> None:
        if self.reduce_op in self.ALIASES:
            object.__setattr__(self, "reduce_op", self.ALIASES[self.reduce_op])
        if self.reduce_op not in self.REDUCE_OPS:
            raise ValueError(
                f"Partial reduce_op must be one of {self.REDUCE_OPS} (or 'prod'), got {self.reduce_op!r}"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def identity(self) -> int | None:
        """The reduction's neutral element when repeating a value would change it (0 for sum,
        1 for product); None for avg, max and min, whose reduction of equal values is that value."""
        return _IDENTITY.get(self.reduce_op)

    def partition_value(self, value: torch.Tensor, axis_rank: int) -> torch.Tensor:
        """This rank's contribution such that reducing all contributions gives back ``value``.

        For ``sum`` the first rank keeps the value and the others hold zeros, for ``product``
        ones (the identity of the reduction): exact for every dtype, where dividing by the axis
        size or taking an n-th root would round. ``avg``, ``max`` and ``min`` keep it
        everywhere, since their reduction of equal values is that value.
        """
        if axis_rank != 0 and self.reduce_op in _IDENTITY:
            return torch.full_like(value, _IDENTITY[self.reduce_op])
        return value

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


# The neutral element of each reduction whose repeated value would not reduce to itself.
_IDENTITY = {"sum": 0, "product": 1}

ACCEPTED = "Shard(dim), Replicate() or Partial(reduce_op)"


def as_placements(value: object, what: str = "placements") -> tuple[Placement, ...]:
    """``value`` as a tuple of Placement objects, or one TypeError naming the bad entry.

    The single gate for placements given by users (distribute_tensor, from_local, redistribute,
    the factories, DTensorSpec): a string such as ``"S"`` is refused whole rather than iterated
    character by character, and the class ``Shard`` (no parentheses) is told apart from an
    instance.

    Raises:
        TypeError: ``value`` is not a list/tuple, or one of its entries is not a placement.
    """
    if isinstance(value, tuple) and all(isinstance(p, Placement) for p in value):
        return value  # the common case, kept cheap: specs are built on every cache miss
    if not isinstance(value, (list, tuple)):
        hint = f"; write [{value!r}]" if isinstance(value, Placement) else ""
        if foreign := foreign_note(value):
            hint = f": {foreign}"
        if isinstance(value, type) and issubclass(value, Placement):
            hint = f"; write [{value.__name__}({'0' if value is Shard else ''})], with parentheses"
        raise TypeError(
            f"{what} must be a list or tuple with one placement per mesh axis ({ACCEPTED}), "
            f"got {_describe(value)}{hint}"
        )
    for i, p in enumerate(value):
        if not isinstance(p, Placement):
            if foreign := foreign_note(p):
                raise TypeError(f"{what}[{i}] of {show_placements(value)} is {foreign}")
            raise TypeError(
                f"{what}[{i}] of {show_placements(value)} is {_describe(p)}; expected Placement objects: "
                f"{ACCEPTED}{_fix_hint(p)}"
            )
    return tuple(value)


def _describe(value: object) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__}"
    name = type(value).__name__
    return f"{value!r} ({'an' if name[0] in 'aeiou' else 'a'} {name})"


def show_placements(value: object) -> str:
    """``[Shard(dim=0), Replicate()]``; classes by name, anything else by repr (for messages)."""
    if not isinstance(value, (list, tuple)):
        return value.__name__ if isinstance(value, type) else repr(value)
    return "[" + ", ".join(p.__name__ if isinstance(p, type) else repr(p) for p in value) + "]"


def _fix_hint(p: object) -> str:
    """How to write what the user probably meant."""
    if isinstance(p, type) and issubclass(p, Placement):
        return f": call it, e.g. {p.__name__}(0)" if p is Shard else f": call it, {p.__name__}()"
    if isinstance(p, int) and not isinstance(p, bool):
        return f" (to shard tensor dim {p}, write Shard({p}))"
    if isinstance(p, str):
        names = {"s": "Shard(dim)", "shard": "Shard(dim)", "r": "Replicate()", "replicate": "Replicate()",
                 "p": "Partial()", "partial": "Partial()"}
        guess = names.get(p.strip().lower().split("(")[0])
        return f" (write {guess}, not a string)" if guess else " (not a string)"
    return ""


def check_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Validate a placement list on its own (no mesh or shape needed) and return it as a tuple.

    Raises:
        TypeError: not a list/tuple of Placements (see ``as_placements``).
        ValueError: Partials with different reduce ops are mixed; no single reduction order
            would give the value back (sum and max do not commute).
    """
    placements = as_placements(placements)
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1:
        raise ValueError(
            f"placements {list(placements)} mix Partial reduce ops {sorted(ops)}; a DTensor may "
            "carry only one kind of pending reduction"
        )
    return placements
