"""Helpers shared by strategy modules: finding ops by tag, broadcasting, placement lists."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from shardwise.placement import Placement, Replicate, Shard
from shardwise.spec import DTensorSpec

aten = torch.ops.aten
R = Replicate()


def aten_ops_tagged(tag: torch.Tag, *, without: tuple[torch.Tag, ...] = ()) -> Iterator[Any]:
    """Every aten OpOverload carrying ``tag`` (and none of ``without``)."""
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[6:].partition(".")
        packet = getattr(aten, base, None)
        if packet is None:
            continue
        try:
            op = getattr(packet, overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if tag in op.tags and not any(t in op.tags for t in without):
            yield op


def bind_arguments(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of a call by schema position, defaults filled in (for custom handlers)."""
    values = list(args)
    for argument in op._schema.arguments[len(args):]:
        values.append(kwargs[argument.name] if argument.name in kwargs else argument.default_value)
    return values


def num_tensor_outputs(op: Any) -> int:
    """Tensor results in an op's schema (lists count as one)."""
    return sum("Tensor" in str(r.type) for r in op._schema.returns)


def broadcast_dim(spec: DTensorSpec, out_shape: tuple[int, ...], out_dim: int) -> Placement:
    """How an input must be laid out on one axis for the output to be Shard(out_dim) there.

    Shard on the matching input dim, or Replicate when that dim is broadcast (absent or 1).
    """
    in_dim = out_dim - (len(out_shape) - spec.ndim)
    if in_dim >= 0 and spec.shape[in_dim] == out_shape[out_dim] and out_shape[out_dim] != 1:
        return Shard(in_dim)
    return R


def tensor_shapes(values: Any) -> list[tuple[int, ...]]:
    """Shapes of every spec / plain tensor among ``values`` (one level of lists)."""
    shapes = []
    for v in values:
        if isinstance(v, DTensorSpec):
            shapes.append(tuple(v.shape))
        elif isinstance(v, torch.Tensor):
            shapes.append(tuple(v.shape))
        elif isinstance(v, (list, tuple)):
            shapes += tensor_shapes(v)
    return shapes
