"""local_map: run a function written for local blocks on DTensors.

Some code is easier to write per rank: a fused kernel, a custom op without a sharding rule,
math that is correct blockwise by construction. ``local_map`` wraps such a function: DTensor
arguments are checked against (or moved to) the layouts the function expects and handed over
as their local blocks; tensor results are wrapped back as DTensors with the layouts the caller
declares. Nothing checks that the function's math agrees with those layouts: that is the
caller's promise, as in torch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Replicate, as_placements

__all__ = ["local_map"]

Layouts = Sequence[Sequence[Placement] | None] | Sequence[Placement] | None


def local_map(
    func: Callable | None = None,
    out_placements: Layouts = None,
    in_placements: Layouts = None,
    in_grad_placements: Layouts = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable:
    """Wrap ``func`` (local tensors in, local tensors out) to take and return DTensors.

    Args:
        func: the per-rank function; None returns a decorator.
        out_placements: per (flattened) result, its placements (None for a non-tensor result);
            one placements sequence when there is one result. A tensor result given None (or
            all of them, when ``out_placements`` is None) is taken as replicated, as torch's
            ``local_map`` takes it: the caller promises every rank computed the same block.
        in_placements: per (flattened) positional argument, the placements ``func`` expects
            (None for non-DTensor arguments); None: take DTensors as they are.
        in_grad_placements: per argument, how to read the gradient of its block
            (``DTensor.to_local``'s ``grad_placements``); e.g. ``[Partial()]`` for a replicated
            weight whose per-rank gradients are partial sums.
        device_mesh: the mesh of the results (default: the first DTensor argument's).
        redistribute_inputs: move DTensors whose placements differ from ``in_placements``
            (default: raise ``ValueError``).

    If no argument is a DTensor, ``func`` runs unchanged on its arguments.

    Example:
        >>> mm = local_map(torch.mm, out_placements=[Shard(0)],
        ...                in_placements=([Shard(0)], [Replicate()]),
        ...                in_grad_placements=([Shard(0)], [Partial()]))
        >>> y = mm(x, w)   # x: Shard(0), w: Replicate -> y: Shard(0), no communication
    """
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        flat, tree = pytree.tree_flatten(args)
        name = getattr(func, "__name__", repr(func))
        ins = _per_item(in_placements, len(flat), f"local_map({name}): in_placements", "arguments")
        grads = _per_item(in_grad_placements, len(flat), f"local_map({name}): in_grad_placements", "arguments")
        mesh = device_mesh or next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
        if mesh is None:
            return func(*args, **kwargs)
        local = [_to_local(a, i, ins, grads, redistribute_inputs, name) for i, a in enumerate(flat)]
        out = func(*pytree.tree_unflatten(local, tree), **kwargs)
        flat_out, out_tree = pytree.tree_flatten(out)
        outs = _per_item(_as_outputs(out_placements, len(flat_out)), len(flat_out),
                         f"local_map({name}): out_placements", "results")
        wrapped_out = [_from_local(o, mesh, outs[i] if outs else None, i, name) for i, o in enumerate(flat_out)]
        return pytree.tree_unflatten(wrapped_out, out_tree)

    return wrapped


def _as_outputs(layouts: Layouts, n: int) -> Layouts:
    """One placements sequence for a single result may be given without the outer tuple."""
    if layouts is not None and n == 1 and len(layouts) and isinstance(layouts[0], Placement):
        return (layouts,)
    return layouts


def _per_item(layouts: Layouts, n: int, what: str, items: str) -> list | None:
    if layouts is None:
        return None
    layouts = list(layouts)
    if len(layouts) != n:
        raise ValueError(f"{what} has {len(layouts)} entries for {n} {items} (flattened); give one per {items[:-1]}")
    return [None if p is None else as_placements(p, what) for p in layouts]


def _to_local(arg: Any, i: int, ins: list | None, grads: list | None, redistribute: bool, name: str) -> Any:
    if not isinstance(arg, DTensor):
        if ins is not None and ins[i] is not None and not isinstance(arg, torch.Tensor):
            raise ValueError(f"local_map({name}): argument {i} is {type(arg).__name__}, not a DTensor, "
                             f"but in_placements gives it {list(ins[i])}; give None")
        return arg
    want = ins[i] if ins is not None else None
    if ins is not None and want is None:
        raise ValueError(f"local_map({name}): argument {i} is a DTensor ({arg._spec.render()}) but its "
                         "in_placements entry is None; give the placements the function expects")
    if want is not None and tuple(arg.placements) != want:
        if not redistribute:
            raise ValueError(
                f"local_map({name}): argument {i} is {arg._spec.render()} with placements {list(arg.placements)}, "
                f"but the function expects {list(want)}; redistribute it first or pass redistribute_inputs=True"
            )
        arg = arg.redistribute(arg.device_mesh, want)
    grad = grads[i] if grads is not None else None
    return arg.to_local(grad_placements=grad)


def _from_local(value: Any, mesh: DeviceMesh, placements: tuple | None, i: int, name: str) -> Any:
    if not isinstance(value, torch.Tensor):
        if placements is not None:
            raise ValueError(f"local_map({name}): result {i} is {type(value).__name__}, not a tensor, but "
                             f"out_placements gives it {list(placements)}; give None")
        return value
    if isinstance(value, DTensor):
        raise ValueError(f"local_map({name}): result {i} is a DTensor; the function must return local tensors")
    if placements is None:  # torch's reading: the blocks are one replicated value
        placements = (Replicate(),) * mesh.ndim
    return DTensor.from_local(value, mesh, placements)
