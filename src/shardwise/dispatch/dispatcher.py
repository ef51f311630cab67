"""The op dispatcher (first version): ops whose inputs all share one layout run block by block.

This covers what autograd itself needs on DTensors (detach, clone, gradient accumulation,
``*_like``). Sharding propagation with strategies and a cost model replaces the table below.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.placement import Replicate
from shardwise.spec import DTensorSpec, TensorMeta

__all__ = ["dispatch", "render_call"]

aten = torch.ops.aten


def _dtensor_cls():
    from shardwise.dtensor import DTensor

    return DTensor


def render_call(func, args: tuple, kwargs: dict) -> str:
    """``aten.add.Tensor(f32[8@dp,4], f32[8,4]) on mesh(dp=4)``: the form every message uses."""
    DTensor = _dtensor_cls()
    meshes = []

    def show(a: Any) -> str:
        if isinstance(a, DTensor):
            if a.device_mesh not in meshes:
                meshes.append(a.device_mesh)
            return a._spec.render()
        if isinstance(a, torch.Tensor):
            return _plain(a)
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(show(x) for x in a) + "]"
        return repr(a)

    shown = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    where = " and ".join(map(repr, meshes))
    return f"{func}({', '.join(shown)})" + (f" on {where}" if where else "")


def _plain(t: torch.Tensor) -> str:
    from shardwise.spec import dtype_name

    return f"{dtype_name(t.dtype)}[{','.join(map(str, t.shape))}] (plain tensor)"


# Ops that act element by element on inputs sharing one layout, keeping that layout.
# Partial inputs stay Partial only for ops that commute with a linear reduction.
_SAME_LAYOUT: dict[Any, bool] = {  # op -> keeps Partial(sum/avg)
    aten.detach.default: True,
    aten.alias.default: True,
    aten.clone.default: True,
    aten.add.Tensor: True,
    aten.add_.Tensor: True,
    aten.zeros_like.default: True,
    aten.empty_like.default: True,
    aten.copy_.default: True,
    aten.ones_like.default: False,
    aten.full_like.default: False,
}


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the local blocks of its DTensor arguments and wrap the results."""
    DTensor = _dtensor_cls()
    flat, _ = tree_flatten((args, kwargs))
    specs = [a._spec for a in flat if isinstance(a, DTensor)]
    plain = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0]
    keeps_partial = _SAME_LAYOUT.get(func)
    if keeps_partial is None or plain or len({s.placements for s in specs}) != 1 or len({s.mesh for s in specs}) != 1:
        raise NotImplementedError(
            f"shardwise has no sharding rule for {render_call(func, args, kwargs)}"
        )
    spec = specs[0]
    if spec.has_partial and not (keeps_partial and all(p.reduce_op in ("sum", "avg") for p in spec.placements if p.is_partial())):
        raise NotImplementedError(
            f"{render_call(func, args, kwargs)}: pending reductions do not commute with this op"
        )
    unwrap: Callable = lambda a: a._local_tensor if isinstance(a, DTensor) else a
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if func._schema.name.endswith("_") or func is aten.copy_.default:
        return args[0]
    meta = TensorMeta(spec.shape, spec.tensor_meta.stride, out.dtype)
    return DTensor(out, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=False)
