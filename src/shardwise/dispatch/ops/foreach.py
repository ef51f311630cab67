"""The ``aten._foreach_*`` family (optimizers, grad clipping) on lists of DTensors.

A foreach op applies one per-tensor op to every position of its lists: element ``i`` of the
result depends only on element ``i`` of each list (and on the arguments shared by all). So each
position is simply run as that per-tensor op on DTensors, and takes its layout from the
ordinary rules for that op (pointwise rules, norms via ``reduction.py``): a gradient laid out
differently from its parameter is redistributed to match, a norm of a sharded tensor is a
local partial norm plus one small all_reduce. Positions holding plain tensors (an optimizer's
step counters) run as plain torch.

The per-tensor op is found from the name (``_foreach_add_.List`` -> ``aten.add_``); the few
whose names or arguments differ from their per-tensor op are adapted in ``_ELEMENT``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.dispatcher import allow_mixed_meshes
from shardwise.dispatch.registry import register_custom_handler
from shardwise.dispatch import tensor_class

__all__ = ["foreach_ops"]

_PREFIX = "_foreach_"


def foreach_ops() -> list[Any]:
    """Every overload of every ``aten._foreach_*`` op."""
    names = {n[6:].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::" + _PREFIX)}
    ops = []
    for name in sorted(names):
        packet = getattr(aten, name, None)
        if packet is not None:
            ops += [getattr(packet, overload) for overload in packet.overloads()]
    return ops


def _is_list(argument: Any) -> bool:
    return isinstance(argument.type, torch.ListType) or str(argument.type).endswith("[]")


def _columns(op: Any, args: tuple, kwargs: dict) -> tuple[list[tuple[str, Any, bool]], int]:
    """(name, value, per_position) for every argument given, and the list length."""
    columns, length = [], None
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        per_position = _is_list(argument) or (argument.name == "scalars" and isinstance(value, torch.Tensor))
        if per_position and argument.name != "out":
            length = len(value) if length is None else length
            if len(value) != length:
                raise ValueError(f"{op}: argument {argument.name} has {len(value)} entries, expected {length}")
        columns.append((argument.name, value, per_position))
    return columns, length or 0


def _element(value: Any) -> Any:
    """One position of a per-position argument (a per-position scalar tensor becomes a number)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not _is_dtensor(value):
        return value.item()
    return value


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, tensor_class.DTensor)


# Per-tensor ops whose call differs from "same name, same positional arguments".
def _addc(name: str) -> Callable:
    def call(self, tensor1, tensor2, value=1, scalars=None):
        return getattr(aten, name)(self, tensor1, tensor2, value=value if scalars is None else scalars)

    return call


def _extremum(tensor_op: Any, scalar_op: Any) -> Callable:
    """maximum / minimum with a tensor; with a number they are clamp_min / clamp_max."""

    def call(self, other=None, scalar=None, scalars=None):
        bound = other if other is not None else (scalar if scalar is not None else scalars)
        return tensor_op(self, bound) if isinstance(bound, torch.Tensor) else scalar_op(self, bound)

    return call


def _norm(self, ord=2, dtype=None):
    return aten.linalg_vector_norm.default(self, ord, None, False, dtype=dtype)


def _powsum(self, ord=2, dtype=None):
    """sum(|x|^ord): a norm without the final root."""
    x = self if dtype is None else aten._to_copy.default(self, dtype=dtype)
    return aten.sum.default(aten.pow.Tensor_Scalar(aten.abs.default(x), ord))


_KEYWORD_ONLY = ("alpha", "memory_format")

_ELEMENT: dict[str, Callable] = {
    "addcmul": _addc("addcmul"), "addcmul_": _addc("addcmul_"),
    "addcdiv": _addc("addcdiv"), "addcdiv_": _addc("addcdiv_"),
    "maximum": _extremum(aten.maximum, aten.clamp_min), "minimum": _extremum(aten.minimum, aten.clamp_max),
    "norm": _norm, "powsum": _powsum,
    "max": lambda self: aten.max.default(self),
    "copy": lambda self, src, non_blocking=False: aten.copy_.default(aten.clone.default(self), src, non_blocking),
    "zero": lambda self: aten.zeros_like.default(self),
    "copy_": lambda self, src, non_blocking=False: aten.copy_.default(self, src, non_blocking),
}


@functools.lru_cache(maxsize=None)
def _per_tensor(base: str, in_place: bool) -> Callable:
    """The per-tensor callable for ``_foreach_<base>[_]``: in place where aten has it, else
    out of place then copied into ``self``."""
    name = base + ("_" if in_place else "")
    if name in _ELEMENT:
        return _ELEMENT[name]
    if not in_place or hasattr(aten, name):
        return _by_name(name)
    functional = _per_tensor(base, False)

    def call(self, *args, **kwargs):
        return aten.copy_.default(self, functional(self, *args, **kwargs))

    return call


def _by_name(name: str) -> Callable:
    packet = getattr(aten, name)

    def call(self, *args, **kwargs):
        # Foreach names differ (``scalar``, ``scalars``, ``tensors1``...): pass them positionally,
        # in schema order; only the keyword-only ones keep their names.
        keywords = {k: kwargs.pop(k) for k in _KEYWORD_ONLY if k in kwargs}
        return packet(self, *args, *kwargs.values(), **keywords)

    return call


def foreach_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run a ``_foreach_*`` call position by position with the per-tensor op on DTensors."""
    name = op._schema.name.split("::")[-1][len(_PREFIX):]
    in_place = name.endswith("_")
    element = _per_tensor(name.rstrip("_"), in_place)
    columns, length = _columns(op, args, kwargs)
    out = next((v for n, v, _ in columns if n == "out"), None)
    results = []
    for i in range(length):
        values = {n: _element(v[i]) if n == "scalars" else v[i] if per else v for n, v, per in columns if n != "out"}
        result = element(values.pop("self"), **values)  # ``self`` is a number for pow.ScalarAndTensor
        if out is not None:
            aten.copy_.default(out[i], result)
        results.append(result)
    return None if in_place or out is not None else results


register_custom_handler(*foreach_ops())(foreach_handler)
# Position i only ever meets position i of the other lists, so the lists may mix meshes.
allow_mixed_meshes(*foreach_ops())
