"""Where a module's parameters are registered, so they can be swapped in place.

A parameter object may be registered on several modules (weight tying); forward must see the
gathered tensor under every one of those names, and the optimizer the sharded one afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ParamOwners", "find_owners"]


@dataclass
class ParamOwners:
    """One parameter object and every (module, attribute) it is registered under."""

    fqn: str
    param: nn.Parameter
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` what every owner's attribute returns (no checks, no hooks)."""
        for module, attr in self.slots:
            module._parameters[attr] = tensor


def find_owners(module: nn.Module, skip: set[int]) -> list[ParamOwners]:
    """Parameters reachable from ``module`` whose ids are not in ``skip``, first name first."""
    found: dict[int, ParamOwners] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or id(param) in skip:
                continue
            fqn = f"{prefix}.{attr}" if prefix else attr
            entry = found.setdefault(id(param), ParamOwners(fqn, param))
            if not any(m is sub and a == attr for m, a in entry.slots):
                entry.slots.append((sub, attr))
    return list(found.values())
