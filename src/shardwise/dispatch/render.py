"""How messages show an op call: ``aten.add.Tensor(f32[8@dp,4], f32[8,4]) on mesh(dp=4)``.

Every error of the dispatcher and the propagation names the call in this form (docs/concepts.md,
"Ordinary PyTorch code on DTensors"): DTensors as their layout, plain tensors as dtype and
shape, other arguments as ``repr``.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.dispatch import tensor_class, walk
from shardwise.core.spec import dtype_name

__all__ = ["render_call", "plain"]


def render_call(func, args: tuple, kwargs: dict) -> str:
    """``aten.add.Tensor(f32[8@dp,4], f32[8,4]) on mesh(dp=4)``: the form every message uses."""
    DTensor = tensor_class.DTensor
    meshes: list = []

    def show(a: Any) -> str:
        if isinstance(a, DTensor):
            if a.device_mesh not in meshes:
                meshes.append(a.device_mesh)
            return a._spec.render()
        if isinstance(a, torch.Tensor):
            return plain(a)
        return repr(a)

    shown = [walk.render(a, show) for a in args] + [f"{k}={walk.render(v, show)}" for k, v in kwargs.items()]
    where = " and ".join(map(repr, meshes))
    name = str(func).replace("aten::", "aten.").replace(".default", "")
    return f"{name}({', '.join(shown)})" + (f" on {where}" if where else "")


def plain(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)}[{','.join(map(str, t.shape))}](plain)"
