"""Optimizer state keyed by parameter name, ready to save and to load in place.

``torch.optim.Optimizer.state_dict()`` numbers parameters by position and creates moments only
at the first ``step()``, so a fresh optimizer has nothing to load into. ``optimizer_state_dict``
names each parameter's state by the parameter's key in ``model.named_parameters()`` (stable
across layouts and wrappers that keep names) and first creates any missing state with a step
of zero gradients at learning rate 0, which leaves the parameters unchanged (as torch's own
distributed checkpoint helpers do). Its moment tensors are the optimizer's own (DTensors in the
layout of their parameters), so ``load`` fills them in place; ``load_optimizer_state_dict``
then hands the loaded hyperparameters and steps back to the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict"]


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {param_name: {...}}, "param_groups": [{..., "params": [param_name, ...]}]}``.

    Args:
        model: the module whose parameters the optimizer updates.
        optimizer: any torch optimizer; state it has not created yet is created (zero-gradient
            step at lr 0, parameters unchanged).

    Returns:
        A state dict sharing the optimizer's state tensors (``load`` fills them in place).

    Example:
        >>> state = {"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)}
        >>> shardwise.checkpoint.load(state, path)
        >>> load_optimizer_state_dict(model, opt, state["optim"])
    """
    _create_missing_state(optimizer)
    names = _names(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = [_name_of(p, names) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        for p, fqn in zip(group["params"], fqns):
            if optimizer.state.get(p):
                state[fqn] = optimizer.state[p]
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Give ``optimizer`` the name-keyed ``state_dict`` (as loaded by ``load``).

    Raises:
        CheckpointError: the state names a parameter the model does not have.
    """
    names = _names(model)
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[_name_of(p, names)] = len(index)
    try:
        state = {index[fqn]: s for fqn, s in state_dict["state"].items()}
        groups = [{**g, "params": [index[fqn] for fqn in g["params"]]} for g in state_dict["param_groups"]]
    except KeyError as err:
        raise CheckpointError(f"optimizer state names parameter {err.args[0]!r}, which the model does not have") from None
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _name_of(param: torch.Tensor, names: dict[int, str]) -> str:
    name = names.get(id(param))
    if name is None:
        raise CheckpointError(
            f"the optimizer updates a {list(param.shape)} parameter that is not in the model's named_parameters()"
        )
    return name


def _create_missing_state(optimizer: torch.optim.Optimizer) -> None:
    """Step once with zero gradients at lr 0 for parameters that have no state yet."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = {id(p) for p in params if not optimizer.state.get(p)}
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing else None
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
