"""The one walker over an op call's arguments and results.

Every part of dispatch that looks inside a call (finding its DTensors, keying the propagation
cache, swapping DTensors for local blocks or meta tensors, replacing them by their specs,
finding plain tensors, rendering the call, wrapping the results) walks it here, with one
semantics: ``torch.utils._pytree``'s. Lists, tuples and dicts are containers, nested to any
depth; everything else (tensors, DTensors, numbers, None, and the meshes, placements and
specs that ``shardwise.compile.opaque`` registers as pytree constants, which pytree alone would drop)
is a leaf; leaves come in pytree order, which for a call ``(args, kwargs)`` is the positional arguments depth-first, then the
keyword arguments in their order. "The DTensors of a call", in every module, means its
DTensor leaves in that order: the order of ``OpSchema.specs`` and of a candidate's inputs.

Two speeds, one semantics. Slow paths (propagation, custom handlers, error messages) call
``torch.utils._pytree`` itself. Pytree costs about 10 us per call, about the whole per-op
overhead budget, so the three walks on the cached path are flat loops instead, written to
give the same answer:

* ``signature``: the propagation cache's key, and the DTensors in leaf order;
* ``put``: DTensors swapped for local blocks, at the ``Slots`` (leaf positions) found once per
  call signature by pytree (``slots``) and kept with the cached plan;
* ``wrap_results``: the local results wrapped as DTensors, with specs in leaf order.

``signature`` relies on one fact of ATen schemas: a list argument has one element type
(``int[]``, ``Tensor[]``, ``Tensor?[]``, ``Scalar[]``), so a list that starts with an int holds
no tensor and is its own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Slots", "at", "leaves", "dtensors", "map_leaves", "freeze", "spec_tree", "labelled", "slots", "put",
    "signature", "float_class", "wrap_results", "render",
]

_Tensor = torch.Tensor
Path = tuple  # keys from the root (args, kwargs): 0 then positions, or 1 then a name then positions
_CONTAINERS = (list, tuple, dict)


def _is_leaf(value: Any) -> bool:
    return not isinstance(value, _CONTAINERS)


# ---------------------------------------------------------------------- slow paths: pytree
def leaves(tree: Any) -> list:
    """Every leaf of ``tree`` (a call is ``(args, kwargs)``), in pytree order."""
    return pytree.tree_leaves(tree, is_leaf=_is_leaf)


def dtensors(args: Iterable, kwargs: dict, DTensor: type) -> list:
    """The call's DTensors, in leaf order (the order of ``OpSchema.specs``)."""
    return [leaf for leaf in leaves((tuple(args), kwargs)) if isinstance(leaf, DTensor)]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf ``x`` replaced by ``fn(x)`` (containers keep their types)."""
    return pytree.tree_map(fn, tree, is_leaf=_is_leaf)


def freeze(value: Any) -> Any:
    """``value`` with every list made a tuple, at any depth: hashable, for plan caches (dicts
    stay dicts: no ATen argument holds one)."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    if isinstance(value, tuple):
        return _like(value, [freeze(v) for v in value])
    if isinstance(value, dict):
        return {k: freeze(v) for k, v in value.items()}
    return value


def spec_tree(args: Iterable, kwargs: dict, DTensor: type) -> tuple[tuple, tuple[tuple[str, Any], ...]]:
    """The call as strategies see it (``OpSchema.args``, ``OpSchema.kwargs``): each DTensor
    replaced by its spec, lists made tuples."""
    as_spec = lambda v: v._spec if isinstance(v, DTensor) else v  # noqa: E731
    args_, kwargs_ = map_leaves(as_spec, (tuple(args), kwargs))
    return freeze(args_), tuple((k, freeze(v)) for k, v in kwargs_.items())


def _paths(args: Iterable, kwargs: dict) -> list[tuple[Path, Any]]:
    """Every leaf with its path of indices and keys (a namedtuple's field name becomes its index)."""
    root = (tuple(args), kwargs)
    flat, _ = pytree.tree_flatten_with_path(root, is_leaf=_is_leaf)
    out = []
    for entries, leaf in flat:
        node, path = root, []
        for entry in entries:
            if isinstance(entry, pytree.SequenceKey):
                key = entry.idx
            elif isinstance(entry, pytree.MappingKey):
                key = entry.key
            elif isinstance(entry, pytree.GetAttrKey) and hasattr(node, "_fields"):
                key = node._fields.index(entry.name)
            else:
                raise TypeError(f"walk: pytree opens a container dispatch cannot rebuild ({entry!r})")
            node = node[key]
            path.append(key)
        out.append((tuple(path), leaf))
    return out


def labelled(args: Iterable, kwargs: dict) -> list[tuple[str, Any]]:
    """Every leaf with where it sits, as messages name it: ``#1``, ``#2[0]``, ``weight``,
    ``indices[1]`` (``registry.is_plain_index`` reads these)."""
    out = []
    for path, leaf in _paths(args, kwargs):
        head = f"#{path[1]}" if path[0] == 0 else str(path[1])
        out.append((head + "".join(f"[{k}]" for k in path[2:]), leaf))
    return out


@dataclass(frozen=True, slots=True)
class Slots:
    """Where a call's DTensors sit: one path per DTensor, in leaf order.

    Found once per call signature (``slots``) and cached with its plan; ``put`` then swaps
    values in without searching. ``positional``: the positions, when every DTensor is a
    top-level positional argument (the common case, a flat loop). ``shallow``: (root, key,
    index or None) per DTensor, when each is an argument or an element of a list or tuple
    argument (``cat``, ``index``, ``_foreach_*``, ``out=``: also a flat loop)."""

    paths: tuple[Path, ...]
    positional: tuple[int, ...] | None
    shallow: tuple[tuple[int, Any, int | None], ...] | None = None


def slots(args: Iterable, kwargs: dict, DTensor: type) -> Slots:
    """The ``Slots`` of the DTensors of a call."""
    paths = tuple(path for path, leaf in _paths(args, kwargs) if isinstance(leaf, DTensor))
    flat = all(len(p) == 2 and p[0] == 0 for p in paths)
    shallow = all(len(p) == 2 or (len(p) == 3 and isinstance(at(args, kwargs, p[:2]), (list, tuple))) for p in paths)
    return Slots(paths, tuple(p[1] for p in paths) if flat else None,
                 tuple((p[0], p[1], p[2] if len(p) == 3 else None) for p in paths) if shallow else None)


def at(args: tuple, kwargs: dict, path: Path) -> Any:
    """The leaf of ``(args, kwargs)`` at ``path`` (one of a ``Slots``' paths)."""
    node: Any = (args, kwargs)[path[0]]
    for key in path[1:]:
        node = node[key]
    return node


# ---------------------------------------------------------------------- the cached path
def put(args: tuple, kwargs: dict, where: Slots, values: Iterable) -> tuple[list, dict]:
    """``(args, kwargs)`` with the leaf at each of ``where``'s paths replaced by the next of
    ``values``; the containers on the way are copies of the same types (the caller's are
    left alone)."""
    if where.positional is not None:
        local = list(args)
        for position, value in zip(where.positional, values):
            local[position] = value
        return local, kwargs
    if where.shallow is not None:
        return _put_shallow(args, kwargs, where.shallow, values)
    in_args, in_kwargs = [], []
    for path, value in zip(where.paths, values):
        (in_args if path[0] == 0 else in_kwargs).append((path[1:], value))
    return list(_rebuild(args, in_args)), _rebuild(kwargs, in_kwargs) if in_kwargs else kwargs


def _put_shallow(args: tuple, kwargs: dict, shallow: tuple, values: Iterable) -> tuple[list, dict]:
    roots = (list(args), dict(kwargs) if kwargs else kwargs)
    inner_lists: dict = {}
    for (root, key, index), value in zip(shallow, values):
        if index is None:
            roots[root][key] = value
            continue
        inner = inner_lists.get((root, key))
        if inner is None:
            inner = inner_lists[(root, key)] = list(roots[root][key])
        inner[index] = value
    for (root, key), inner in inner_lists.items():
        original = (args, kwargs)[root][key]
        roots[root][key] = inner if type(original) is list else _like(original, inner)
    return roots[0], roots[1]


def _rebuild(node: Any, pairs: list) -> Any:
    """A copy of container ``node`` with the leaf at each (path, value) of ``pairs`` replaced."""
    groups: dict = {}
    for path, value in pairs:
        groups.setdefault(path[0], []).append((path[1:], value))
    new = dict(node) if isinstance(node, dict) else list(node)
    for key, inner in groups.items():
        new[key] = inner[0][1] if not inner[0][0] else _rebuild(node[key], inner)
    return new if isinstance(node, dict) or type(node) is list else _like(node, new)


def signature(values: Iterable, found: list, DTensor: type, func: Any = None, sign_only: Container = ()) -> tuple:
    """Hashable summary of arguments (the propagation cache's key): specs for DTensors,
    metadata for plain tensors, values for the rest (floats by ``float_class`` when ``func``
    is in ``sign_only``: its layouts depend on their sign only). Appends the DTensors to
    ``found``, in leaf order."""
    out = []
    for value in values:
        if isinstance(value, DTensor):
            found.append(value)
            out.append(value._spec)
        elif isinstance(value, _Tensor):
            out.append((value.dtype, value.shape, value.device.type))
        elif isinstance(value, (list, tuple)):
            # A list of ints (a size, dims) is its own key (see the module docstring).
            out.append(tuple(value) if value and type(value[0]) is int
                       else signature(value, found, DTensor, func, sign_only))
        elif type(value) is float and func in sign_only:
            out.append(float_class(value))
        elif type(value) is dict:
            out.append((signature(value.values(), found, DTensor, func, sign_only), tuple(value)))
        else:
            out.append(value)
    return tuple(out)


def float_class(value: float) -> tuple:
    """What a pointwise op's layout can depend on: sign (NaN apart), and being 0 or 1."""
    return (float, (value > 0) - (value < 0) if value == value else 2, value == 1.0)


def wrap_results(out: Any, specs: tuple, wrap: Callable[[Any, Any], Any]) -> Any:
    """An op's local results with the tensor leaves wrapped: leaf ``i`` (pytree order) as
    ``wrap(leaf, specs[i])`` where that spec is not None; the rest pass unchanged."""
    if not isinstance(out, (tuple, list, dict)):
        spec = specs[0] if specs else None
        return wrap(out, spec) if spec is not None else out
    return _wrap_items(out, specs, [0], wrap)


def _wrap_items(items: Any, specs: tuple, counter: list, wrap: Callable) -> Any:
    if isinstance(items, dict):
        return dict(zip(items, _wrap_items(list(items.values()), specs, counter, wrap)))
    count, i, out = len(specs), counter[0], []
    for item in items:
        if isinstance(item, (tuple, list, dict)):
            counter[0] = i
            out.append(_wrap_items(item, specs, counter, wrap))
            i = counter[0]
        else:
            spec = specs[i] if i < count else None
            i += 1
            out.append(wrap(item, spec) if spec is not None and isinstance(item, _Tensor) else item)
    counter[0] = i
    return out if type(items) is list else _like(items, out)


def _like(original: Any, items: list) -> Any:
    """``items`` as a container of ``original``'s type (a namedtuple takes them as arguments)."""
    if type(original) is tuple:
        return tuple(items)
    return type(original)(*items) if hasattr(original, "_fields") else type(original)(items)


# ---------------------------------------------------------------------- rendering
def render(value: Any, show: Callable[[Any], str]) -> str:
    """``value`` as text: leaves by ``show``, lists and tuples as ``[...]``, dicts as ``{k: ...}``."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render(v, show) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render(v, show)}" for k, v in value.items()) + "}"
    return show(value)
