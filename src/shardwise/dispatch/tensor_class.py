"""The DTensor class as dispatch sees it: bound once, from above, at import.

``shardwise.tensor.dtensor`` is built on dispatch (``DTensor.__torch_dispatch__`` calls
``dispatch``), and dispatch wraps op results in DTensors. So that the import arrow points one
way only (docs/architecture.md), dispatch never imports the tensor layer: ``tensor/dtensor.py``
calls ``bind_tensor_class`` right after defining the class, before anything can dispatch an op.
Handlers read ``tensor_class.DTensor`` (an attribute read, no import statement per call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from shardwise.core.spec import DTensorSpec

__all__ = ["bind_tensor_class", "dtensor_cls", "block_wrapper", "new_dtensor"]


class _Unbound:
    """Stands for DTensor until it is bound: nothing is an instance of it."""


def _not_bound(local: torch.Tensor, spec: "DTensorSpec") -> Any:
    raise RuntimeError("shardwise.dispatch: no DTensor class bound (import shardwise.tensor.dtensor first)")


DTensor: type = _Unbound
# ``DTensor(local, spec, requires_grad=False)`` without the constructor's frame (the hot path's wrap).
wrap_block: Callable[[torch.Tensor, "DTensorSpec"], Any] = _not_bound


def bind_tensor_class(cls: type, wrap: Callable[[torch.Tensor, "DTensorSpec"], Any]) -> None:
    """Make ``cls`` the class dispatch recognises and builds; ``wrap(local, spec)`` builds one fast."""
    global DTensor, wrap_block
    DTensor, wrap_block = cls, wrap


def dtensor_cls() -> type:
    """The DTensor class."""
    return DTensor


def block_wrapper() -> Callable[[torch.Tensor, "DTensorSpec"], Any]:
    """The fast wrap (``shardwise.tensor.dtensor.wrap_block``): for runners that wrap blocks on every call."""
    return wrap_block


def new_dtensor(local: torch.Tensor, spec: "DTensorSpec") -> Any:
    """``DTensor(local, spec, requires_grad=False)``, the fast way."""
    return wrap_block(local, spec)
