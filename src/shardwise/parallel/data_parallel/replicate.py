"""replicate: data parallelism with whole replicas (DDP), expressed with DTensor.

Parameters become ``nn.Parameter``s holding ``Replicate()`` DTensors on a 1-D data-parallel
mesh, so the optimizer, ``state_dict`` and checkpoints see DTensors exactly as with
fully_shard. Forward computes with plain views of the same storage (each rank's replica; no
copy, no collective). Gradients are averaged in BUCKETS: flat buffers of several parameters'
gradients, each one all_reduce, launched during backward as soon as every gradient of the
bucket has arrived, in a fixed order so every rank issues the same collectives.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

from shardwise.compile.opaque import eager_only
from shardwise import comm
from shardwise.tensor.factories import distribute_tensor, world_mesh
from shardwise.tensor.dtensor import DTensor
from shardwise.parallel.data_parallel.backward import queue_end_of_backward
from shardwise.parallel.data_parallel.buckets import plan_buckets
from shardwise.parallel.data_parallel.owners import ParamOwners, find_owners
from shardwise.parallel.data_parallel.param import MANAGED_ATTR
from shardwise.parallel.data_parallel.state import state_of
from shardwise.core.meta_step import META_STEP
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Replicate

__all__ = ["replicate"]

STATE_ATTR = "_shardwise_replicate_state"


class ReplicatedParam:
    """A Replicate DTensor parameter and the plain view of its storage that forward uses."""

    def __init__(self, owners: ParamOwners, mesh: DeviceMesh) -> None:
        self.owners = owners
        param = owners.param
        dt = distribute_tensor(param.detach(), mesh, [Replicate()])  # rank 0's values everywhere
        self.replicated = nn.Parameter(dt, requires_grad=param.requires_grad)
        setattr(self.replicated, MANAGED_ATTR, True)
        self.local = nn.Parameter(self.replicated._local_tensor, requires_grad=param.requires_grad)
        owners.param = self.replicated  # drop the original tensor

    def __deepcopy__(self, memo: dict) -> "ReplicatedParam":
        """A copy whose plain view shares the copied DTensor's storage, as the original's does."""
        new = object.__new__(ReplicatedParam)
        memo[id(self)] = new
        new.owners = copy.deepcopy(self.owners, memo)
        new.replicated = copy.deepcopy(self.replicated, memo)
        new.local = nn.Parameter(new.replicated._local_tensor, requires_grad=self.local.requires_grad)
        memo[id(self.local)] = new.local
        return new

    def follow_module(self) -> bool:
        """Catch up after ``to_empty`` / ``.to``: adopt the module's (moved) DTensor; a new ``local``
        leaf when the block changed device (True: its gradient hook must be registered again)."""
        module, attr = self.owners.slots[0]
        current = module._parameters[attr]
        if current is not self.replicated and current is not self.local and isinstance(current, DTensor):
            self.replicated = current
            self.owners.param = current
        setattr(self.replicated, MANAGED_ATTR, True)
        block = self.replicated._local_tensor
        if self.local.device == block.device:
            return False
        self.local = nn.Parameter(block, requires_grad=self.local.requires_grad)
        return True

    def use_local(self) -> None:
        if self.local.data_ptr() != self.replicated._local_tensor.data_ptr():
            self.local.data = self.replicated._local_tensor  # the optimizer replaced the block
        self.owners.register(self.local)

    def use_replicated(self) -> None:
        self.owners.register(self.replicated)

    def accumulate_grad(self, grad: torch.Tensor) -> None:
        """Add an averaged gradient into ``replicated.grad`` (a Replicate DTensor)."""
        if self.replicated.grad is None:
            self.replicated.grad = DTensor(grad.clone(), self.replicated._spec, requires_grad=False)
        else:
            with torch.no_grad():
                self.replicated.grad.add_(DTensor(grad, self.replicated._spec, requires_grad=False))
        self.local.grad = None


class ReplicateState:
    """Forward hooks, gradient buckets and their all_reduces for one replicate'd module."""

    def __init__(self, module: nn.Module, params: list[ReplicatedParam], mesh: DeviceMesh, cap_bytes: int) -> None:
        self.module = module
        self.params = params
        self.mesh = mesh
        sizes = [p.local.numel() * p.local.element_size() for p in params]
        trainable = [i for i, p in enumerate(params) if p.local.requires_grad]
        plan = plan_buckets([sizes[i] for i in trainable], [params[i].local.dtype for i in trainable], cap_bytes)
        self.buckets = [tuple(trainable[j] for j in bucket) for bucket in plan]
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._arrived = [0] * len(self.buckets)
        self._next = 0  # first bucket not yet reduced in this backward
        self._pending = False
        self._callback_queued = False
        # False: backward leaves the gradients in the replicas' ``.grad`` (they add up over
        # backward passes) and reduces nothing; the next synced backward reduces the sum.
        self.requires_gradient_sync = True
        self._inflight: list[tuple] = []  # (Pending all_reduce, bucket index, sizes) not yet waited

    def install(self) -> None:
        self.module.register_forward_pre_hook(self._pre_forward, prepend=True)
        self.module.register_forward_hook(self._post_forward, always_call=True)
        self._install_recompute_hooks()
        self._install_grad_hooks()

    def _install_recompute_hooks(self) -> None:
        """Activation checkpointing re-runs a block's forward during backward, after the root's
        post-forward hook put the DTensor parameters back: each module owning parameters
        switches its own to the plain views for a forward run inside backward."""
        owned: dict[int, tuple[nn.Module, list[ReplicatedParam]]] = {}
        for p in self.params:
            for module, _ in p.owners.slots:
                owned.setdefault(id(module), (module, []))[1].append(p)
        for module, params in owned.values():
            module.register_forward_pre_hook(functools.partial(_recompute_with_local, params))
            module.register_forward_hook(functools.partial(_recompute_done, params), always_call=True)

    def __deepcopy__(self, memo: dict) -> "ReplicateState":
        """The state of a ``copy.deepcopy``'d module: module hooks come with the module's copy;
        the gradient hooks of the copied plain parameters are registered again."""
        new = object.__new__(ReplicateState)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        new._install_grad_hooks()
        return new

    def _install_grad_hooks(self) -> None:
        for i, p in enumerate(self.params):
            self._hook_grad(i, p)

    def _hook_grad(self, i: int, p: ReplicatedParam) -> None:
        if p.local.requires_grad:
            p.local.register_post_accumulate_grad_hook(lambda _, i=i: self._on_grad(i))

    # Eager under torch.compile (see FSDPState._pre_forward).
    @eager_only
    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        for i, p in enumerate(self.params):
            if p.local.device != p.replicated._local_tensor.device and p.follow_module():
                self._hook_grad(i, p)  # moved by to_empty / .to since the last forward
            if p.local.is_meta and not META_STEP.get():
                raise RuntimeError(
                    f"replicate({type(module).__name__}): parameter {p.owners.fqn!r} is on the meta device "
                    "(no data); call module.to_empty(device=...) and initialize it before forward"
                )
            p.use_local()

    @eager_only
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        for p in self.params:
            p.use_replicated()
        self._pending = self._pending or (torch.is_grad_enabled() and bool(self.buckets))

    def _on_grad(self, index: int) -> None:
        if not self.requires_gradient_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)
        self._arrived[self._bucket_of[index]] += 1
        while self._next < len(self.buckets) and self._arrived[self._next] == len(self.buckets[self._next]):
            self._reduce_next()

    def _reduce_next(self) -> None:
        """Start the all_reduce (average) of the next bucket's gradients as one flat buffer; the
        backward of the layers before it runs meanwhile (``_finish`` waits at the end)."""
        bucket = [self.params[i] for i in self.buckets[self._next]]
        grads = [p.local.grad if p.local.grad is not None else torch.zeros_like(p.local) for p in bucket]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numels]
            for p in bucket:
                p.local.grad = None
            self._inflight.append((comm.all_reduce_async(flat, self.mesh, 0, "avg"), self._next,
                                   [g.numel() for g in grads]))
        self._next += 1

    def _finish(self) -> None:
        """Wait for the buckets' all_reduces, in issue order, and add them into ``.grad``."""
        with torch.no_grad():
            for pending, index, sizes in self._inflight:
                bucket = [self.params[i] for i in self.buckets[index]]
                for p, g in zip(bucket, pending.wait().split(sizes)):
                    p.accumulate_grad(g.view_as(p.local))
        self._inflight = []

    def _end_of_backward(self) -> None:
        """Reduce buckets whose gradients did not all arrive (unused parameters count as zero)."""
        self._callback_queued = False
        if self._pending:
            while self._next < len(self.buckets):
                self._reduce_next()
        self._finish()
        self._arrived = [0] * len(self.buckets)
        self._next = 0
        self._pending = False


@eager_only
def _recompute_with_local(params: list[ReplicatedParam], module: nn.Module, args: tuple) -> None:
    if torch._C._current_graph_task_id() != -1:  # a forward re-run by backward (recomputation)
        for p in params:
            p.use_local()


@eager_only
def _recompute_done(params: list[ReplicatedParam], module: nn.Module, args: tuple, output: Any) -> None:
    if torch._C._current_graph_task_id() != -1:
        for p in params:
            p.use_replicated()


def replicate(module: nn.Module, *, mesh: DeviceMesh | None = None, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Replicate ``module`` over a 1-D data-parallel mesh; average gradients in buckets.

    Every parameter becomes an ``nn.Parameter`` holding a ``Replicate()`` DTensor (rank 0's
    values are broadcast, so replicas start equal). Forward runs on each rank's replica as
    plain tensors; backward all_reduces gradient buckets of up to ``bucket_cap_mb`` megabytes
    (walking the parameters from last to first), averaged over the mesh, into ``param.grad``
    (Replicate DTensors). Gradients accumulate over several backward passes. A parameter no
    rank used gets a zero gradient (it shares a bucket with others). Meta parameters stay meta
    (nothing is broadcast) until ``module.to_empty(device=...)`` and an initialization.

    Args:
        module: the module (changed in place and returned).
        mesh: 1-D data-parallel mesh (default: the world).
        bucket_cap_mb: bucket size limit in MiB (2**20 bytes).

    Returns:
        ``module``.

    Example:
        >>> replicate(model, mesh=mesh)
        >>> model(local_batch).mean().backward()   # one all_reduce per bucket
    """
    label = type(module).__name__
    where = f"replicate({label})"
    if module.__dict__.get(STATE_ATTR) is not None or state_of(module) is not None:
        raise ValueError(f"{where}: the module is already managed by replicate or fully_shard")
    mesh = mesh if mesh is not None else world_mesh()
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"{where}: replicate needs a 1-D data-parallel mesh, got {mesh}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"{where}: rank {mesh.get_rank()} is not in {mesh.describe()}")
    if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise ValueError(f"{where}: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    entries = find_owners(module, set())
    for entry in entries:
        if isinstance(entry.param, DTensor) or getattr(entry.param, MANAGED_ATTR, False):
            raise ValueError(f"{where}: parameter {entry.fqn!r} is already a DTensor; replicate takes plain parameters")
    params = [ReplicatedParam(entry, mesh) for entry in entries]
    for p in params:
        p.use_replicated()
    state = ReplicateState(module, params, mesh, int(bucket_cap_mb * 2**20))
    module.__dict__[STATE_ATTR] = state
    state.install()
    return module


def _replicate_state(module: nn.Module) -> Any:
    """``replicate.state(module)``: the module's replicate state, or None (as torch's)."""
    return module.__dict__.get(STATE_ATTR)


setattr(replicate, "state", _replicate_state)
