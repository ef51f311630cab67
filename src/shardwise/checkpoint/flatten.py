"""State dicts as flat maps: nested dicts/lists/tuples <-> ``{"a.b.0.c": leaf}``.

A leaf is a tensor (plain or DTensor) or a JSON scalar (None, bool, int, finite float, str).
Keys are joined with "." (list and tuple positions, and integer dict keys such as an
optimizer's parameter indices, become their decimal string), so a nested model state dict
``{"model": {"layers.0.w": t}}`` gives the key ``"model.layers.0.w"``.

Loading is driven by the target: ``flatten`` of the target gives the keys to look up, and
``replace_values`` writes loaded scalars back into it in place (tuples, being immutable, are
rebuilt and stored into their parent).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

import torch

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["flatten", "replace_values", "is_json_scalar"]

Leaf = Any  # torch.Tensor | None | bool | int | float | str


def is_json_scalar(value: Any) -> bool:
    """True for values stored in ``metadata.json``: None, bool, int, finite float, str."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    return isinstance(value, float) and math.isfinite(value)


def flatten(state_dict: Mapping) -> dict[str, Leaf]:
    """Every leaf of ``state_dict`` by its dotted key; raises naming the key on bad input.

    Raises:
        CheckpointError: ``state_dict`` is not a dict, a key is neither str nor int, two paths
            give the same dotted key, or a leaf is neither a tensor nor a JSON scalar.
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}
    for key, leaf in _walk(state_dict, ""):
        if key in out:
            raise CheckpointError(f"two entries of the state dict have the same key {key!r}")
        _check_leaf(key, leaf)
        out[key] = leaf
    return out


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Leaf]]:
    for key, child in _children(node, prefix):
        if isinstance(child, (Mapping, list, tuple)):
            yield from _walk(child, key)
        else:
            yield key, child


def _children(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, child) of a container, in its own order."""
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    for name, child in items:
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            where = f"under {prefix!r}" if prefix else "at the top level"
            raise CheckpointError(f"state dict key {name!r} {where} is a {type(name).__name__}; keys must be str or int")
        yield (f"{prefix}.{name}" if prefix else str(name)), child


def _check_leaf(key: str, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor) or is_json_scalar(leaf):
        return
    if isinstance(leaf, float):
        raise CheckpointError(
            f"state dict entry {key!r} is the float {leaf}; JSON has no NaN/Infinity: store it as a tensor"
        )
    raise CheckpointError(
        f"state dict entry {key!r} is a {type(leaf).__name__} ({leaf!r:.60}); a checkpoint holds tensors "
        "and JSON scalars (None, bool, int, float, str) in nested dicts/lists"
    )


def replace_values(state_dict: dict, new_value: Callable[[str, Leaf], Leaf]) -> None:
    """Set every leaf of ``state_dict`` to ``new_value(key, old)``, in place.

    Dicts and lists are updated in place; a tuple is rebuilt and stored into its parent.
    """
    _replace(state_dict, "", new_value)


def _replace(node: Any, prefix: str, new_value: Callable[[str, Leaf], Leaf]) -> Any:
    updated = []
    for key, child in _children(node, prefix):
        if isinstance(child, (Mapping, list, tuple)):
            updated.append(_replace(child, key, new_value))
        else:
            updated.append(new_value(key, child))
    if isinstance(node, tuple):
        return type(node)(updated) if type(node) is tuple else type(node)(*updated)
    names = list(node.keys()) if isinstance(node, Mapping) else range(len(node))
    for name, value in zip(names, updated):
        if node[name] is not value:
            node[name] = value
    return node
