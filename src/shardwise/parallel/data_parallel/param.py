"""FSDPParam: one parameter under fully_shard, sharded at rest and gathered for compute.

Two tensors stand for the parameter:

* ``sharded``: an ``nn.Parameter`` holding a DTensor with this rank's dim-0 shard (what the
  optimizer, ``state_dict`` and ``model.parameters()`` see outside forward);
* ``unsharded``: an ``nn.Parameter`` of the whole block (a plain tensor, or a DTensor on the
  parameter's TP mesh when it came as one) that forward computes with. Its storage is
  allocated only while gathered (``untyped_storage().resize_``) and refilled in place before
  backward, so the tensors autograd saved in forward see the gathered values again.

Writes into the unsharded storage go through ``.data``, which has its own version counter:
refilling it is not an in-place change of a tensor autograd saved.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardwise.tensor.dtensor import DTensor
from shardwise.parallel.data_parallel import memory
from shardwise.parallel.data_parallel.dp_mesh import DataParallelMesh
from shardwise.parallel.data_parallel.owners import ParamOwners
from shardwise.core.placement import Shard
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["FSDPParam"]

# Attribute set on sharded parameters so a later fully_shard / replicate can recognize them.
MANAGED_ATTR = "_shardwise_fsdp_managed"


class FSDPParam:
    """The sharded and unsharded forms of one parameter, and the moves between them."""

    def __init__(self, owners: ParamOwners, dp: DataParallelMesh, compute_dtype: torch.dtype) -> None:
        param = owners.param
        self.owners = owners
        self.fqn = owners.fqn
        self.requires_grad = param.requires_grad
        self.inner_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        block = (param._local_tensor if self.inner_spec else param).detach()
        self.block_shape = tuple(block.shape)
        padded_rows = -(-self.block_shape[0] // dp.world)
        self.padded_shape = (dp.world * padded_rows, *self.block_shape[1:])
        self.sharded = self._make_sharded(param, block, dp)
        self.is_allocated = False
        self._set_unsharded(block, compute_dtype)
        owners.param = self.sharded  # drop the whole original tensor: only the shard stays alive

    def _set_unsharded(self, like: torch.Tensor, dtype: torch.dtype) -> None:
        """(Re)create the unsharded parameter on ``like``'s device, its storage released."""
        self.unsharded = self._make_unsharded(like, dtype)
        self._local = self.unsharded._local_tensor if self.inner_spec else self.unsharded
        self._nbytes = self._local.untyped_storage().nbytes()
        self._local.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ construction
    def _make_sharded(self, param: nn.Parameter, block: torch.Tensor, dp: DataParallelMesh) -> nn.Parameter:
        """This rank's dim-0 chunk of the block as a DTensor on the (composed) mesh; no communication."""
        length, offset = Shard.chunk(self.block_shape[0], dp.world, dp.rank)
        local = block.narrow(0, offset, length).clone()
        mesh, placements = dp.composed(self.inner_spec)
        meta = self.inner_spec.tensor_meta if self.inner_spec else TensorMeta.of(block)
        spec = DTensorSpec(mesh, placements, TensorMeta(meta.shape, contiguous_stride(meta.shape), meta.dtype))
        if spec.local_shape() != tuple(local.shape):  # the layout algebra and the cut must agree
            raise AssertionError(f"{self.fqn}: {spec.render()} gives {spec.local_shape()}, cut {tuple(local.shape)}")
        sharded = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=param.requires_grad)
        setattr(sharded, MANAGED_ATTR, True)
        return sharded

    def _make_unsharded(self, block: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
        """A leaf over padded storage on ``block``'s device (its first ``rows`` rows); a DTensor on the TP mesh if inner."""
        padded = torch.empty(self.padded_shape, dtype=dtype, device=block.device)
        view = padded.narrow(0, 0, self.block_shape[0])
        if self.inner_spec is None:
            return nn.Parameter(view, requires_grad=self.requires_grad)
        meta = self.inner_spec.tensor_meta
        spec = DTensorSpec(self.inner_spec.mesh, self.inner_spec.placements, TensorMeta(meta.shape, meta.stride, dtype))
        return nn.Parameter(DTensor(view, spec, requires_grad=False), requires_grad=self.requires_grad)

    def __deepcopy__(self, memo: dict) -> "FSDPParam":
        """A copy for ``copy.deepcopy(model)``: the sharded parameter copied (an independent
        DTensor), the unsharded one made anew over fresh storage (it cannot be cloned while
        freed), holding a copy of the gathered values if they are gathered now."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.owners = copy.deepcopy(self.owners, memo)
        new.inner_spec = copy.deepcopy(self.inner_spec, memo)
        new.sharded = copy.deepcopy(self.sharded, memo)
        new.unsharded = new._make_unsharded(self.sharded._local_tensor, self.unsharded.dtype)
        memo[id(self.unsharded)] = new.unsharded
        new._local = new.unsharded._local_tensor if new.inner_spec else new.unsharded
        new._local.untyped_storage().resize_(0)
        new.is_allocated = False
        if self._kept_grad is not None:  # an unsynced backward's sum: the copy's own
            new._kept_grad = self._kept_grad.clone()
        if self.is_allocated:
            new.allocate()
            new.padded_writer().copy_(self.padded_writer())
        return new

    # ------------------------------------------------------------------ moves
    def follow_module(self) -> bool:
        """Catch up after ``module.to_empty`` / ``.to(device)`` replaced or moved the sharded parameter.

        The module's attribute is the truth: its (moved) DTensor becomes ``sharded``, and the
        unsharded parameter is rebuilt on the new device when it changed (its storage stays
        released). Returns True when the unsharded parameter is a new tensor (hooks on the old
        one must be registered again).
        """
        module, attr = self.owners.slots[0]
        current = module._parameters[attr]
        if current is not self.sharded and isinstance(current, DTensor):
            self.sharded = current
            self.owners.param = current
            self.owners.register(current)  # every tied name, too
        setattr(self.sharded, MANAGED_ATTR, True)  # swap_tensors may have moved the attribute away
        shard = self.sharded._local_tensor
        if self._local.device == shard.device:
            return False
        self.free()
        self._set_unsharded(shard, self.unsharded.dtype)
        return True

    @property
    def is_meta(self) -> bool:
        """Whether the sharded parameter has no data yet (built on the meta device)."""
        return self.sharded._local_tensor.is_meta

    # ------------------------------------------------------------------ storage
    def local_shard(self) -> torch.Tensor:
        """This rank's shard as a plain tensor (read fresh: the optimizer may have replaced it)."""
        return self.sharded._local_tensor.detach()

    def allocate(self) -> None:
        """Give the unsharded parameter its storage back (contents undefined until written)."""
        if not self.is_allocated:
            self._local.untyped_storage().resize_(self._nbytes)
            memory.note_alloc("unsharded", self._nbytes)
            self.is_allocated = True

    def free(self) -> None:
        """Release the unsharded storage; the tensor keeps its shape for autograd."""
        if self.is_allocated:
            self._local.untyped_storage().resize_(0)
            memory.note_free("unsharded", self._nbytes)
            self.is_allocated = False

    def padded_writer(self) -> torch.Tensor:
        """The whole padded storage as a tensor with its own version counter (for copies in)."""
        shape = self.padded_shape
        return self._local.data.as_strided(shape, contiguous_stride(shape), self._local.storage_offset())

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of the padded unsharded storage."""
        return self._nbytes

    # ------------------------------------------------------------------ registration
    def use_unsharded(self) -> None:
        """Module attributes return the gathered parameter (for forward)."""
        self.owners.register(self.unsharded)

    def use_sharded(self) -> None:
        """Module attributes return the sharded parameter (for the optimizer and state_dict)."""
        self.owners.register(self.sharded)

    # ------------------------------------------------------------------ gradients
    def unsharded_grad(self) -> torch.Tensor | None:
        """The gradient of the whole block as a plain tensor, in the inner layout if any (with
        the sum kept by unsynced backward passes)."""
        grad, kept = self._new_grad(), self._kept_grad
        if kept is None:
            return grad
        return kept if grad is None else kept + grad.to(kept.dtype)

    def _new_grad(self) -> torch.Tensor | None:
        """The gradient of the backward passes since the last reduce or keep, as a plain tensor."""
        grad = self.unsharded.grad
        if grad is None or self.inner_spec is None:
            return grad
        if grad.placements != self.inner_spec.placements:
            grad = grad.redistribute(grad.device_mesh, self.inner_spec.placements)
        return grad._local_tensor

    def clear_unsharded_grad(self) -> None:
        self.unsharded.grad = None
        self._kept_grad = None

    _kept_grad: torch.Tensor | None = None  # unsynced backwards' gradient sum (plain, reduce dtype)

    @property
    def has_kept_grad(self) -> bool:
        return self._kept_grad is not None or self.unsharded.grad is not None

    def keep_unsharded_grad(self, dtype: torch.dtype) -> None:
        """Gradient sync off: move the unsharded gradient into the local sum (in ``dtype``, so
        low-precision compute gradients accumulate in the reduce precision)."""
        grad = self._new_grad()
        self.unsharded.grad = None
        if grad is None:
            return
        if self._kept_grad is None:
            self._kept_grad = grad.to(dtype)
        else:
            self._kept_grad.add_(grad.to(dtype))

    def accumulate_sharded_grad(self, shard: torch.Tensor) -> None:
        """Add a reduced shard gradient into ``sharded.grad`` (a DTensor laid out like the parameter)."""
        grad = self.sharded.grad
        if grad is None:
            own = shard.to(self.sharded.dtype, copy=True)  # its own storage, not a view of the flat buffer
            self.sharded.grad = DTensor(own, self.sharded._spec, requires_grad=False)
            return
        shard = shard.to(self.sharded.dtype)
        if isinstance(grad, DTensor) and grad._spec == self.sharded._spec:
            grad._local_tensor.add_(shard)
        else:
            with torch.no_grad():
                grad.add_(DTensor(shard, self.sharded._spec, requires_grad=False))
