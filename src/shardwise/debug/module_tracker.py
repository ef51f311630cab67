"""Which modules are running, forward and backward: what ``CommDebugMode`` files collectives under.

Modules are named by their path from the outermost module entered, that module being named by
its class: ``Sequential``, ``Sequential.0``, ``Transformer.layers.3.attention.wq`` (torch's
CommDebugMode names them the same way). A collective is filed under every module active at the
time (inclusive counts: a parent counts what its children issued) and the innermost one is its
home in the table.

Forward: a global forward pre-hook marks the module active; a forward hook registered on the
module itself (on first entry, ``always_call`` so that an exception still clears it) marks it
inactive. Module-level hooks run after global ones, so the input and output hooks of parallel
styles and of fully_shard, registered earlier, run while the module counts as active: their
collectives belong to the module, as a reader expects.

Backward: when a module's forward returns outputs that require grad, a hook on their gradients
marks the module active in backward (the first output gradient arrives just before the module's
backward runs); a hook on its inputs' gradients marks it inactive (all of them computed: the
module's backward is done). A module none of whose inputs require grad (an embedding fed token
ids, the root fed data) stays active until that backward ends. Activation-checkpoint recompute
runs forward hooks inside backward: those collectives are filed under the module, in backward.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

__all__ = ["Phase", "ModuleInfo", "ModuleTracker", "GLOBAL", "current_phase"]

GLOBAL = "Global"  # the pseudo-module every collective is filed under


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(slots=True)
class ModuleInfo:
    """A module entered while tracking: its type and the layouts of its own DTensor parameters."""

    fqn: str
    type_name: str
    parameters: dict[str, Any] = field(default_factory=dict)  # name -> DTensorSpec (or placements)


def _graph_task_id() -> int:
    """The running backward's id, -1 outside backward."""
    return torch._C._current_graph_task_id()


def current_phase() -> Phase:
    """BACKWARD while autograd runs a backward on this thread (hooks, recompute), else FORWARD."""
    return Phase.BACKWARD if _graph_task_id() != -1 else Phase.FORWARD


def _hooks_can_fire() -> bool:
    """Whether gradient hooks registered now can fire: grad mode on, and not inside a backward.

    A forward run inside a backward is an activation-checkpoint recompute (non-reentrant, as the
    trainer's): its outputs are detached before autograd sees them, so hooks on them would never
    fire, and each one (a closure holding the tensor, held by the tensor) would keep its tensor
    alive until a full garbage collection, at a moment no program chooses. ``CommDebugMode``
    measures every simulated step (``shardwise.simulate``), whose peak memory then depended on
    when Python happened to collect.
    """
    return torch.is_grad_enabled() and _graph_task_id() == -1


def _grad_tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad]


class ModuleTracker:
    """Tracks the active modules between ``start()`` and ``stop()`` (one process, any thread).

    Example:
        >>> tracker = ModuleTracker(); tracker.start()
        >>> model(x)          # inside, tracker.active() == ("Model", "Model.layer")
        >>> tracker.stop()
    """

    def __init__(self) -> None:
        self.modules: dict[str, ModuleInfo] = {}  # the modules entered, in order of first entry
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._forward: list[str] = []
        self._backward: Counter[str] = Counter()
        self._backward_task = -1
        self._handles: list = []
        self._post_hooked: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self._on = False

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        self._on = True
        self._handles.append(register_module_forward_pre_hook(self._enter))

    def stop(self) -> None:
        """Remove every hook; gradient hooks still pending on activations become no-ops."""
        self._on = False
        for handle in [*self._handles, *self._post_hooked.values()]:
            handle.remove()
        self._handles.clear()
        self._post_hooked = weakref.WeakKeyDictionary()
        self._forward.clear()
        self._backward.clear()

    # ------------------------------------------------------------------ where are we
    def active(self) -> tuple[str, ...]:
        """Names of the active modules, outermost first (forward stack, then backward ones)."""
        names = list(dict.fromkeys(self._forward))
        if self._backward and self._backward_task == _graph_task_id() != -1:
            names += [n for n, c in self._backward.items() if c > 0 and n not in names]
        return tuple(sorted(names, key=lambda n: n.count(".")))

    # ------------------------------------------------------------------ forward
    def _enter(self, module: nn.Module, args: tuple) -> None:
        if not self._on:
            return
        name = self._name(module)
        if name not in self.modules:
            self.modules[name] = ModuleInfo(name, type(module).__name__, _dtensor_parameters(module))
        self._forward.append(name)
        if module not in self._post_hooked:
            self._post_hooked[module] = module.register_forward_hook(self._leave, always_call=True)
        inputs = _grad_tensors(args)
        if inputs and _hooks_can_fire():
            register_multi_grad_hook(inputs, partial(self._backward_done, name), mode="all")

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._on:
            return
        name = self._names.get(module)
        if name in self._forward:  # the last entry of that name: the call that is returning
            del self._forward[len(self._forward) - 1 - self._forward[::-1].index(name)]
        outputs = _grad_tensors(output)
        if outputs and _hooks_can_fire():
            register_multi_grad_hook(outputs, partial(self._backward_starts, name), mode="any")

    # ------------------------------------------------------------------ backward
    def _backward_starts(self, name: str, grad: Any) -> None:
        if not self._on:
            return
        task = _graph_task_id()
        if task != self._backward_task:  # a new backward: forget what the last one left open
            self._backward.clear()
            self._backward_task = task
        self._backward[name] += 1

    def _backward_done(self, name: str, grads: Any) -> None:
        if self._on and self._backward[name] > 0 and self._backward_task == _graph_task_id():
            self._backward[name] -= 1

    # ------------------------------------------------------------------ names
    def _name(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is None:
            prefix = f"{self._forward[-1]}." if self._forward else ""
            name = self._register_tree(module, prefix + type(module).__name__)
        return name

    def _register_tree(self, root: nn.Module, root_name: str) -> str:
        """Name ``root`` and every submodule not yet named, by path from ``root``."""
        for path, sub in root.named_modules():
            if sub not in self._names:
                self._names[sub] = f"{root_name}.{path}" if path else root_name
        return self._names[root]


def _dtensor_parameters(module: nn.Module) -> dict[str, Any]:
    """The module's own DTensor parameters and their specs (layouts shown in the table)."""
    return {name: p._spec for name, p in module.named_parameters(recurse=False) if hasattr(p, "_spec")}
