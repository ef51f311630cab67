"""Helpers shared by strategy modules: finding ops by tag, broadcasting, placement lists."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from shardwise.dispatch import tensor_class, walk
from shardwise.dispatch.cache import PLANS
from shardwise.dispatch.strategy import Candidate, OpSchema, choose
from shardwise.core.placement import Placement, Replicate, Shard
from shardwise.redistribute.execute import redistribute_local
from shardwise.core.spec import DTensorSpec, TensorMeta

aten = torch.ops.aten
R = Replicate()


def aten_ops_tagged(tag: torch.Tag, *, without: tuple[torch.Tag, ...] = ()) -> Iterator[Any]:
    """Every aten OpOverload carrying ``tag`` (and none of ``without``).

    Tags are read from the dispatcher before an OpOverload is built: building one for each of
    the ~3,000 aten overloads cost a quarter of a second of every process's ``import shardwise``.
    """
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[6:].partition(".")
        tags = _tags(base, overload)
        if tags is not None and tag not in tags:
            continue
        packet = getattr(aten, base, None)
        if packet is None:
            continue
        try:
            op = getattr(packet, overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if tag in op.tags and not any(t in op.tags for t in without):
            yield op


_READ_OVERLOAD = getattr(torch._C, "_get_operation_overload", None)  # (op, op_dk, tags) or None


def _tags(base: str, overload: str) -> tuple[torch.Tag, ...] | None:
    """The tags of ``aten::base.overload`` (none when torch cannot resolve it), or None when
    this torch cannot read them without building the OpOverload (a private call)."""
    if _READ_OVERLOAD is None:
        return None
    try:
        found = _READ_OVERLOAD(f"aten::{base}", overload)
    except RuntimeError:
        return ()
    return tuple(found[2]) if found is not None else ()


def bind_arguments(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of a call by schema position, defaults filled in (for custom handlers)."""
    values = list(args)
    for argument in op._schema.arguments[len(args):]:
        values.append(kwargs[argument.name] if argument.name in kwargs else argument.default_value)
    return values


def num_tensor_outputs(op: Any) -> int:
    """Tensor results in an op's schema (lists count as one)."""
    return sum("Tensor" in str(r.type) for r in op._schema.returns)


def broadcast_dim(spec: DTensorSpec, out_shape: tuple[int, ...], out_dim: int, singleton: bool = False) -> Placement:
    """How an input must be laid out on one axis for the output to be Shard(out_dim) there.

    Shard on the matching input dim, or Replicate when that dim is broadcast (absent or 1).
    ``singleton``: the output dim has size 1 and is sharded, so an input dim of size 1 is not
    broadcast but sharded alike.
    """
    in_dim = out_dim - (len(out_shape) - spec.ndim)
    if in_dim >= 0 and spec.shape[in_dim] == out_shape[out_dim] and (out_shape[out_dim] != 1 or singleton):
        return Shard(in_dim)
    return R


def tensor_shapes(values: Any) -> list[tuple[int, ...]]:
    """Shapes of every spec / plain tensor among ``values`` (its leaves, at any depth)."""
    return [tuple(v.shape) for v in walk.leaves(values) if isinstance(v, (DTensorSpec, torch.Tensor))]


# ---------------------------------------------------------------------- custom handlers
# Custom and layout handlers (losses, attention, vocab-parallel ops) choose a layout the way the
# propagator does, then run local code around the op; these are their shared pieces.
def cached_choice(key: tuple, schema: OpSchema, make: Callable[[], list[Candidate]]) -> Candidate:
    """The cheapest of ``make()``'s candidates for ``schema``, cached under ``key`` (which must
    determine the candidates: the op, the input specs and the relevant non-tensor arguments)
    in the propagation cache, so a registration invalidates it like every other decision."""
    return PLANS.memo(("choice", key), lambda: _cheapest(schema, make()))


def _cheapest(schema: OpSchema, candidates: list[Candidate]) -> Candidate:
    plan = choose(schema, candidates)
    if plan is None:
        raise ValueError(f"{schema.op}: no valid layout")
    return plan


def local_block(t: Any, placements: Sequence[Placement] | None) -> torch.Tensor:
    """DTensor ``t``'s local block laid out by ``placements`` (communicates only if they differ)."""
    if placements is None or tuple(placements) == t._spec.placements:
        return t._local_tensor
    return redistribute_local(t._local_tensor, t._spec, t._spec.with_placements(placements))


def localize(dtensors: list[Any], plan: Candidate) -> list[torch.Tensor]:
    """Each DTensor's local block under the plan's input placements (collectives if moved)."""
    return [local_block(t, target) for t, target in zip(dtensors, plan.inputs)]


def meta_of(value: Any) -> Any:
    """A meta tensor shaped like a spec or tensor (to compute output metadata); others pass."""
    if isinstance(value, (DTensorSpec, torch.Tensor)):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def make_spec(mesh: Any, placements: tuple[Placement, ...], meta: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(meta.shape, tuple(meta.stride()), meta.dtype))


def wrap_local(local: torch.Tensor, mesh: Any, placements: tuple[Placement, ...], meta: torch.Tensor) -> Any:
    """A DTensor of ``local`` blocks whose global metadata is the meta tensor ``meta``'s."""
    return tensor_class.DTensor(local, make_spec(mesh, placements, meta), requires_grad=False)
