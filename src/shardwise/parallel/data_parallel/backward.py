"""Backward plumbing shared by fully_shard and replicate.

* ``queue_end_of_backward``: run a function once the autograd engine has finished the current
  backward pass, before ``backward()`` returns (flushes gradients whose hooks never completed).
* ``on_output_grad``: run a function when the first gradient for any of a module's outputs is
  computed, i.e. before that module's own backward starts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["queue_end_of_backward", "on_output_grad", "grad_tensors"]


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Call ``fn`` after the running backward pass (only valid from inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def grad_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output that requires grad."""
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def on_output_grad(output: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` once per backward pass, when the first gradient of ``output`` arrives."""
    tensors = grad_tensors(output)
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad: fn(), mode="any")
