"""Random ops on DTensors: values independent of the layout (``shardwise.tensor.random``).

Each op draws the block this rank holds of one fresh global random tensor, so a dropout mask
or a ``normal_`` fill is the same logical tensor whatever the mesh and placements, and a
replicated result is identical on every rank (same seed on every rank assumed, as with any
SPMD program). These ops are custom handlers: they need no propagation, only the input's spec.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.registry import register_custom_handler
from shardwise.core.placement import Partial, Replicate
from shardwise.tensor.random import random_block
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.dispatch import tensor_class


def _dtensor(local: torch.Tensor, spec: DTensorSpec):
    return tensor_class.DTensor(local, spec, requires_grad=False)


def _whole(spec: DTensorSpec, dtype: torch.dtype | None = None) -> DTensorSpec:
    """The spec of a fresh tensor laid out like ``spec`` (pending reductions dropped)."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, placements, TensorMeta(meta.shape, meta.stride, dtype or meta.dtype))


@register_custom_handler(aten.native_dropout.default)
def native_dropout(op: Any, args: tuple, kwargs: dict) -> Any:
    """Zero each element with probability p and scale the rest by 1/(1-p).

    The mask is the same on every rank holding an element, and scaling commutes with every
    pending reduction (a mask value is >= 0), so the input keeps its layout, Partial included.
    """
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    spec = x._spec
    if train is False or p == 0:
        return x.clone(), _dtensor(torch.ones_like(x._local_tensor, dtype=torch.bool), _whole(spec, torch.bool))
    keep = random_block("uniform", _whole(spec, torch.float32)) >= p
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    out = x._local_tensor * keep * scale
    return _dtensor(out, spec), _dtensor(keep, _whole(spec, torch.bool))


@register_custom_handler(aten.uniform_.default, aten.normal_.default)
def fill_random_(op: Any, args: tuple, kwargs: dict) -> Any:
    """In-place fills: the self tensor keeps its layout (Partial axes hold contributions)."""
    x = args[0]
    local = x._local_tensor
    if op is aten.uniform_.default:
        low, high = _params(args, kwargs, ("from", "to"), (0.0, 1.0))
        random_block("uniform", _whole(x._spec), out=local, scale=high - low, shift=low)  # written in place
    else:
        mean, std = _params(args, kwargs, ("mean", "std"), (0.0, 1.0))
        random_block("normal", _whole(x._spec), out=local, scale=std, shift=mean)
    _partition_like(local, x._spec)
    return x


def _partition_like(block: torch.Tensor, spec: DTensorSpec) -> None:
    """Zero the contributions of non-first ranks on Partial(sum) axes after an affine map."""
    coordinate = spec.mesh.get_coordinate()
    for axis, placement in enumerate(spec.placements):
        if isinstance(placement, Partial) and coordinate is not None:
            block.copy_(placement.partition_value(block, coordinate[axis]))


def _params(args: tuple, kwargs: dict, names: tuple[str, str], defaults: tuple[float, float]) -> tuple[float, float]:
    values = list(args[1:3]) + [None] * (3 - len(args))
    return tuple(
        kwargs.get(name, values[i] if values[i] is not None else default)
        for i, (name, default) in enumerate(zip(names, defaults))
    )


@register_custom_handler(aten.bernoulli.default, aten.bernoulli_.float, aten.bernoulli.p)
def bernoulli(op: Any, args: tuple, kwargs: dict) -> Any:
    """0/1 draws; probabilities come from the tensor itself (``bernoulli(x)``) or ``p``."""
    x = args[0]
    if op is aten.bernoulli.default:
        if x._spec.has_partial:
            x = x.redistribute(x.device_mesh, _whole(x._spec).placements)
        spec = x._spec
        out = random_block("uniform", _whole(spec, torch.float64)) < x._local_tensor.double()
        return _dtensor(out.to(spec.dtype), spec)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    block = (random_block("uniform", _whole(x._spec, torch.float64)) < p).to(x.dtype)
    if op is aten.bernoulli.p:
        return _dtensor(block, _whole(x._spec))
    _partition_like(block, x._spec)
    x._local_tensor.copy_(block)
    return x


@register_custom_handler(aten.rand_like.default, aten.randn_like.default)
def random_like(op: Any, args: tuple, kwargs: dict) -> Any:
    """A fresh random tensor laid out like the input (whose values are not read)."""
    x = args[0]
    spec = _whole(x._spec, kwargs.get("dtype") or x.dtype)
    kind = "uniform" if op is aten.rand_like.default else "normal"
    return _dtensor(random_block(kind, spec), spec)
