"""FSDPState: the hooks fully_shard installs on a module, and the root's end of backward.

Timeline of one group (a fully_shard'ed module) in a training step::

    pre-forward   all_gather (unshard; waits for it if a prefetch started it), register
                  gathered params on the module, start the next module's all_gather (prefetch)
    post-forward  register sharded params again; free the gathered storage
                  (reshard_after_forward); hook the outputs for backward
    pre-backward  (first gradient of an output) all_gather again into the same storage,
                  register gathered params (activation checkpointing recomputes forward),
                  start the all_gather of the module whose backward comes next
    post-backward (every gradient accumulated) issue the reduce_scatter, register sharded
                  params, free storage (unless reshard_after_backward is off); the reduction
                  lands in param.grad when the next group issues its own (one in flight) or
                  at the end of backward

Prefetch targets are explicit (``set_modules_to_forward/backward_prefetch``) or learned: the
root records the order modules enter and leave forward, and the next step prefetches by it.

The outermost fully_shard'ed module that runs forward becomes the root: the first hook of a
backward pass queues the root's end-of-backward callback, which reduces any group whose
gradients did not all arrive (unused parameters) and frees whatever is still gathered, so
nothing is left gathered or unreduced when ``backward()`` returns (gathered parameters stay
where ``set_reshard_after_backward(False)`` asks: a pipeline stage's microbatches before its
last, see ``parallel/pipeline_parallel/pipeline.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from shardwise.compile.opaque import eager_only
from shardwise.parallel.data_parallel.backward import on_output_grad, queue_end_of_backward
from shardwise.parallel.data_parallel.group import ParamGroup
from shardwise.parallel.data_parallel.policy import MixedPrecisionPolicy
from shardwise.core.meta_step import META_STEP

__all__ = ["FSDPState", "STATE_ATTR", "state_of"]

STATE_ATTR = "_shardwise_fsdp_state"


def state_of(module: nn.Module) -> "FSDPState | None":
    """The fully_shard state of ``module``, if it has one."""
    return module.__dict__.get(STATE_ATTR)


class FSDPState:
    """Hooks and flags of one fully_shard'ed module."""

    def __init__(
        self, module: nn.Module, label: str, group: ParamGroup, reshard_after_forward: bool | None, policy: MixedPrecisionPolicy
    ) -> None:
        self.module = module
        self.label = label
        self.group = group
        self.reshard_after_forward = reshard_after_forward  # None: True except for the root
        self.policy = policy
        # False: backward keeps the unsharded gradients locally instead of reducing them
        # (``FSDPModule.set_requires_gradient_sync``); the next synced backward reduces the sum.
        self.requires_gradient_sync = True
        # False: backward leaves the gathered parameters in place (``FSDPModule.set_reshard_after_backward``),
        # so the next microbatch's forward and backward gather nothing; a backward with it True frees them.
        self.reshard_after_backward = True
        self.root: FSDPState | None = None
        self.subtree: list[FSDPState] = []
        self._callback_queued = False
        self._pending_reduce = False
        self._grads_ready = 0
        self._handles: list[Any] = []
        # Prefetch targets set by set_modules_to_forward/backward_prefetch; None: the default
        # (the next module in the order the root's last forward ran them, reversed in backward).
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # Root only: the order the last forward entered / left the modules (the running
        # forward's so far in the ``_now`` lists); backward runs the second one reversed.
        self._order: list[FSDPState] = []
        self._post_order: list[FSDPState] = []
        self._order_now: list[FSDPState] = []
        self._post_order_now: list[FSDPState] = []
        self._reducing: FSDPState | None = None  # root only: the group whose reduce_scatter is in flight

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Register the forward hooks and one post-accumulate-grad hook per trainable parameter."""
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True))
        self._install_grad_hooks()

    def __deepcopy__(self, memo: dict) -> "FSDPState":
        """The state of a ``copy.deepcopy``'d module: its module hooks come with the module's
        copy (bound to this copy); gradient hooks live on the unsharded parameters, which are
        made anew (see ``FSDPParam.__deepcopy__``), so they are registered again here."""
        new = object.__new__(FSDPState)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "_handles":
                setattr(new, name, copy.deepcopy(value, memo))
        new._handles = []
        new._install_grad_hooks()
        return new

    def _install_grad_hooks(self) -> None:
        for p in self.group.params:
            self._hook_grad(p)

    def _hook_grad(self, p: Any) -> None:
        if p.requires_grad:
            self._handles.append(p.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def follow_parameters(self) -> None:
        """After ``module._apply`` (``to_empty``, ``.to``): adopt the moved shards, rebuild gathered storage."""
        self.group.reshard()
        for p in self.group.params:
            if p.follow_module():
                self._hook_grad(p)

    def _check_materialized(self) -> None:
        """Forward needs data: a parameter still on the meta device is named, on every rank alike
        (unless a simulation runs forward on meta parameters on purpose: ``shardwise.core.meta_step``)."""
        if META_STEP.get():
            return
        for p in self.group.params:
            if p.is_meta:
                raise RuntimeError(
                    f"fully_shard({self.label}): parameter {p.fqn!r} is on the meta device (no data); "
                    "call module.to_empty(device=...) and initialize it (init_weights() / reset_parameters()) "
                    "before forward"
                )

    def _lazy_init(self) -> None:
        """The first module to run forward without a root is the root of every state below it."""
        if self.root is not None:
            return
        self.subtree = [s for m in self.module.modules() if (s := state_of(m)) is not None]
        for state in self.subtree:
            state.root = self

    # ------------------------------------------------------------------ forward
    # Eager under torch.compile (a compiled block calls it between graphs, shardwise/compile/opaque.py);
    # decorated here rather than wrapped at registration, so copy.deepcopy(model) rebinds it.
    @eager_only
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._check_materialized()
        self._lazy_init()
        in_backward = torch._C._current_graph_task_id() != -1  # activation checkpointing recomputes
        if not in_backward:
            self._note_forward()
        self.group.unshard()
        if not in_backward:
            for target in self._prefetch_targets(forward=True):
                target.group.start_unshard()
        self.group.use_unsharded()
        if self.policy.param_dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.policy.param_dtype)
        return args, kwargs

    @eager_only
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:
            self._root()._post_order_now.append(self)
        if self.root is self and torch._C._current_graph_task_id() == -1:
            self._order, self._post_order = self._order_now, self._post_order_now
            for state in self.subtree:  # a prefetch that no module consumed this time
                if state.group.gather_in_flight:
                    state.group.reshard()
        self.group.use_sharded()
        backward_follows = torch.is_grad_enabled() and self.group.num_requires_grad > 0
        if backward_follows:
            self._pending_reduce = True
            on_output_grad(output, self._pre_backward)
        reshard = self.reshard_after_forward if self.reshard_after_forward is not None else self.root is not self
        if not backward_follows or reshard:
            self.group.reshard()
        if self.policy.output_dtype is not None:
            output = _cast_floats(output, self.policy.output_dtype)
        return output

    # ------------------------------------------------------------------ backward
    def _pre_backward(self) -> None:
        # Registered too: activation checkpointing re-runs forward code during backward.
        self._root()._queue_callback()
        self.group.unshard()
        for target in self._prefetch_targets(forward=False):
            if target._pending_reduce:  # its backward is still to come
                target.group.start_unshard()
        self.group.use_unsharded()

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        self._root()._queue_callback()
        self._grads_ready += 1
        if self._grads_ready == self.group.num_requires_grad:
            self._reduce()

    def _reduce(self) -> None:
        """Issue this group's gradient reduce_scatter and free its gathered parameters; the
        reduction lands in ``.grad`` when the next group issues its own or at the end of
        backward (one in flight at a time: its buffer is one block's gradients). With gradient
        sync off, the gradients are kept locally instead (no collective)."""
        if self.requires_gradient_sync:
            root = self._root()
            if root._reducing is not None:
                root._reducing.group.finish_reduce()
            self.group.start_reduce()
            root._reducing = self
        else:
            self.group.keep_grads()
        self.group.use_sharded()
        if self.reshard_after_backward:
            self.group.reshard()
        self._grads_ready = 0
        self._pending_reduce = False

    def _root(self) -> "FSDPState":
        return self.root if self.root is not None else self

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Root only: reduce what is still pending (in a fixed order on every rank), free the rest."""
        self._callback_queued = False
        for state in self.subtree or [self]:
            # also a group that kept gradients in an unsynced backward but did not run in this one
            if state._pending_reduce or (state.requires_gradient_sync and state.group.has_kept_grads):
                state._reduce()
            state.group.use_sharded()
            if state.reshard_after_backward:
                state.group.reshard()
            state._grads_ready = 0
        if self._reducing is not None:
            self._reducing.group.finish_reduce()
            self._reducing = None

    # ------------------------------------------------------------------ prefetch
    def _note_forward(self) -> None:
        """Record this module's place in the running forward (the root starts a new order)."""
        root = self._root()
        if root is self:
            self._order_now, self._post_order_now = [], []
        root._order_now.append(self)

    def _prefetch_targets(self, forward: bool) -> list["FSDPState"]:
        """The groups to start gathering once this one is gathered: the explicit list, else the
        module entered after this one in the last forward (in backward: the module that left
        forward before this one, whose backward comes next)."""
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return explicit
        root = self._root()
        order = root._order if forward else root._post_order
        if self not in order:
            return []
        i = order.index(self) + (1 if forward else -1)
        return [order[i]] if 0 <= i < len(order) else []


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)
