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
In backward the innermost module is the deepest of the subtree whose backward started last: a
module whose input another module also reads (a shared expert beside the routed experts) stays
active until that input's whole gradient is computed, through its sibling's backward, so depth
alone would misplace the sibling's collectives.

Boundaries (``ModuleTracker(describe=...)``, what ``explain``'s summary shows): on a module's
first call in each phase, the layouts crossing its edge as its caller sees them: in forward the
inputs it is given (before its own input hooks) and the outputs it returns (after its output
hooks); in backward the gradient of its output that arrives first and its inputs' gradients.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

__all__ = ["Phase", "ModuleInfo", "Boundary", "ModuleTracker", "GLOBAL", "current_phase"]

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


@dataclass(slots=True)
class Boundary:
    """The layouts crossing a module's edge on its first call in ``phase`` (see the module docstring):
    ``inputs`` what enters it (forward: its arguments; backward: its output's gradient), ``outputs``
    what leaves it (forward: its results; backward: its inputs' gradients), None until seen."""

    module: str
    phase: str  # a ``Phase`` value, as the other records of ``explain`` hold it
    inputs: list[str]
    outputs: list[str] | None = None
    order: int = -1  # the tracker's clock when it was entered (-1: no clock)


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

    def __init__(self, describe: Callable[[Any], list[str]] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.modules: dict[str, ModuleInfo] = {}  # the modules entered, in order of first entry
        self.boundaries: dict[tuple[str, Phase], Boundary] = {}  # filled only with ``describe``
        self._describe = describe  # values -> the layouts of their tensors
        self._clock = clock  # stamps each boundary (``explain`` orders them among its ops)
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
        """Names of the active modules, the innermost last: in backward those whose backward
        started (``_backward_order``), then the forward stack (a recompute inside backward)."""
        names: list[str] = []
        if self._backward and self._backward_task == _graph_task_id() != -1:
            names = _backward_order([n for n, c in self._backward.items() if c > 0])
        return tuple(names + [n for n in dict.fromkeys(self._forward) if n not in names])

    # ------------------------------------------------------------------ forward
    def _enter(self, module: nn.Module, args: tuple) -> None:
        if not self._on:
            return
        name = self._name(module)
        if name not in self.modules:
            self.modules[name] = ModuleInfo(name, type(module).__name__, _dtensor_parameters(module))
        self._forward.append(name)
        if current_phase() is Phase.FORWARD:  # not a recompute inside backward
            self._cross(name, Phase.FORWARD, args, entering=True)
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
        if name is not None:
            self._cross(name, Phase.FORWARD, output, entering=False)
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
        if self._backward[name] == 0:  # (re)started: the most recent, so the innermost
            del self._backward[name]
        self._backward[name] += 1
        self._cross(name, Phase.BACKWARD, grad, entering=True)

    def _backward_done(self, name: str, grads: Any) -> None:
        if self._on and self._backward[name] > 0 and self._backward_task == _graph_task_id():
            self._backward[name] -= 1
            self._cross(name, Phase.BACKWARD, grads, entering=False)

    # ------------------------------------------------------------------ boundaries
    def _cross(self, name: str, phase: Phase, values: Any, entering: bool) -> None:
        """Note what enters or leaves ``name`` in ``phase``, on its first call there only."""
        if self._describe is None:
            return
        key = (name, phase)
        if entering and key not in self.boundaries:
            order = self._clock() if self._clock is not None else -1
            self.boundaries[key] = Boundary(name, phase.value, self._describe(values), order=order)
        elif not entering and key in self.boundaries and self.boundaries[key].outputs is None:
            self.boundaries[key].outputs = self._describe(values)

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


def _backward_order(started: list[str]) -> list[str]:
    """Modules whose backward started (in that order), the innermost last: the subtree whose
    backward started last, and in it the deepest module. A module and its last child often start
    on the same gradient (they return the same tensor), the parent's hook last: nesting decides
    between them, start order between modules of different subtrees."""
    when = {n: i for i, n in enumerate(started)}

    def key(name: str) -> tuple[int, int]:
        return max(when[a] for a in started if a == name or name.startswith(a + ".")), name.count(".")

    return sorted(started, key=key)


def _dtensor_parameters(module: nn.Module) -> dict[str, Any]:
    """The module's own DTensor parameters and their specs (layouts shown in the table)."""
    return {name: p._spec for name, p in module.named_parameters(recurse=False) if hasattr(p, "_spec")}
