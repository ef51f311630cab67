"""DTensor: one logical tensor = this rank's block (``_local_tensor``) + its spec.

To PyTorch it is a tensor of the GLOBAL shape, dtype and device; its storage is empty. Every
ATen op on it goes through ``__torch_dispatch__`` to the op dispatcher, which computes on the
local blocks and inserts the communication the layouts require.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Any, Sequence

import torch

from shardwise.comm import run_ahead
from shardwise.tensor import agreement, torch_checkpoint
from shardwise.compile.opaque import Packed, never_compiled, opaque, pack, tracing, unpack
from shardwise.dispatch import bind_tensor_class, dispatch
from shardwise.core.mesh import DeviceMesh, check_mesh, default_mesh
from shardwise.core.meta_step import META_STEP
from shardwise.core.placement import Placement, Replicate, as_placements
from shardwise.redistribute.cross_mesh import check_same_ranks
from shardwise.redistribute import function as layout_functions
from shardwise.redistribute.function import FromLocal, Redistribute, ToLocal
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride, render_layout

__all__ = ["DTensor"]


class DTensor(torch.Tensor):
    """A tensor distributed over a DeviceMesh.

    Create one with ``distribute_tensor`` (from a whole tensor), ``DTensor.from_local`` (from
    blocks every rank already holds) or a factory (``shardwise.zeros`` ...).
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __slots__ = ("_local_tensor", "_spec")

    @staticmethod
    @never_compiled  # built by eager code that a compiled frame calls back (a with-block run eagerly)
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> "DTensor":
        meta = spec.tensor_meta
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        self._local_tensor = local_tensor
        self._spec = spec
        if requires_grad:  # only leaves are built with requires_grad (Function outputs are not)
            _keep_grad_layout(self)
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------------ gradients of leaves
    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """As ``Tensor.requires_grad_``; a leaf that starts requiring grad (``nn.Parameter(dt)``
        calls this) receives its gradients in its own layout (see ``_keep_grad_layout``)."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            _keep_grad_layout(self)
        return self

    requires_grad = property(
        torch._C.TensorBase.requires_grad.__get__,
        lambda self, value: self.requires_grad_(bool(value)),
        doc="As ``Tensor.requires_grad``; setting it to True on a leaf is ``requires_grad_()``.",
    )

    @classmethod
    @never_compiled
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    # ------------------------------------------------------------------ layout
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    def __repr__(self) -> str:
        return (
            f"DTensor({self._spec.render()} on {self._spec.mesh}, placements={list(self.placements)}, "
            f"local_shape={list(self._local_tensor.shape)}, local_tensor={self._local_tensor})"
        )

    # ------------------------------------------------------------------ conversions
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
    ) -> "DTensor":
        """Wrap the block this rank already holds, without copying it.

        Args:
            local_tensor: this rank's block.
            device_mesh: the mesh (default: a 1-D mesh over the world).
            placements: one per mesh axis (default: all Replicate).
            run_check: gather every rank's block metadata now (one all_gather_object per mesh
                axis) and verify that the blocks form one layout: same dtype, device and
                requires_grad, same size in every unsharded dim, sharded dims split as
                torch.chunk splits the global size, the same memory layout and global stride,
                equal values along Replicate axes. Any disagreement raises one ValueError on
                every rank naming the ranks and their values.
            shape, stride: the global shape and stride. Without ``shape`` the global shape is
                inferred: with ``run_check`` from every rank's block (uneven blocks allowed);
                without it from this rank's block alone, ASSUMING EVEN BLOCKS (a sharded dim's
                global size is this block's size times the ranks sharding it). Pass ``shape``
                for uneven blocks. Without ``stride`` the global stride follows the block's
                memory layout (a permuted block gives a permuted global tensor, as in torch);
                with ``shape`` alone it is contiguous.
            grad_placements: how to read the DTensor's gradient when it flows back into
                ``local_tensor`` (default: ``placements`` with Partial read as Replicate, so
                every rank receives the gradient of the whole value).

        Without ``run_check`` nothing is communicated here; the ranks' agreement (same global
        shape, each block the piece its rank should hold) is confirmed before the next
        redistribute on this mesh (one all_reduce of 24 bytes per mesh axis), and a mistake
        raises a ValueError there on every rank rather than reaching the communication backend
        as a size mismatch.

        Returns:
            A DTensor that is a view of ``local_tensor`` (differentiable).

        Example:
            >>> dt = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])  # 4 ranks: f32[8@tp,3]
        """
        if device_mesh is None:
            mesh = default_mesh(local_tensor.device.type)
        else:
            check_mesh(device_mesh, "from_local")
            mesh = device_mesh
        placements = (as_placements(placements, "from_local: placements") if placements is not None
                      else (Replicate(),) * mesh.ndim)
        if shape is None and stride is not None:
            raise ValueError("from_local: pass shape together with stride")
        if grad_placements is not None:
            grad_placements = as_placements(grad_placements, "from_local: grad_placements")
        shape = tuple(shape) if shape is not None else None
        stride = tuple(stride) if stride is not None else None
        return _from_local(local_tensor, mesh, pack(placements), run_check, pack(shape), pack(stride),
                           pack(grad_placements))

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's block (a view).

        ``grad_placements`` says how to read the block's gradient as a DTensor gradient. By
        default it is this tensor's placements with Partial read as Replicate: each rank's
        gradient is then taken as the gradient of the whole value. Pass ``[Partial()]`` when
        each rank computes its own term of the loss from its block.
        """
        if grad_placements is not None:
            grad_placements = as_placements(grad_placements, "to_local: grad_placements")
        return _to_local(self, pack(grad_placements or None))

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> "DTensor":
        """The same logical tensor laid out by ``placements``, with the cheapest communication.

        Partial may be a target (for gradients); going from one Partial op to another reduces
        first. ``device_mesh`` may be another mesh over the same ranks (reshaped, flattened,
        renamed axes, ranks in another order): the tensor is relabelled onto it, for free when
        every rank keeps its block, else through the cheapest layout on the source mesh whose
        blocks are the target's (at worst one gather). Meshes over other ranks raise a
        ValueError saying what to do instead.

        ``forward_dtype`` casts the block before communicating (the result has that dtype);
        ``backward_dtype`` is the dtype the gradient is communicated in (default: this
        tensor's dtype); the gradient reaching this tensor always has this tensor's dtype.
        A meta DTensor is redistributed without communication (only the block shape changes).
        ``async_op=True`` returns before the collectives finish: the result's block waits for
        its data when first used (as torch's ``AsyncCollectiveTensor``), so work issued in
        between overlaps the transfer; values and gradients are those of the blocking call.

        Example:
            >>> flat = mesh["dp", "tp"].flatten("world")          # the same 4 ranks, one axis
            >>> y = x.redistribute(flat, [Shard(0)])              # [Shard(0), Shard(0)]: no communication
        """
        if placements is None:
            raise ValueError("redistribute needs target placements")
        placements = as_placements(placements, "redistribute: placements")
        if device_mesh is not None:
            check_mesh(device_mesh, "redistribute")
        if async_op:  # collectives return at once; the block waits for its data at first use
            with run_ahead():
                return _redistribute(self, pack(device_mesh), pack(placements), pack(forward_dtype), pack(backward_dtype))
        return _redistribute(self, pack(device_mesh), pack(placements), pack(forward_dtype), pack(backward_dtype))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole logical tensor on every rank (an all_gather / all_reduce: not for hot paths).

        ``grad_placements`` as in ``to_local`` (default Replicate: each rank's gradient is the
        gradient of the whole value).
        """
        if grad_placements is not None:
            grad_placements = as_placements(grad_placements, "full_tensor: grad_placements")
        return _full_tensor(self, pack(grad_placements))

    # ------------------------------------------------------------------ copying and pickling
    def __deepcopy__(self, memo: dict) -> "DTensor":
        """An independent DTensor: a copy of this rank's block with the same layout (its mesh
        reconnects to the same process groups, see ``DeviceMesh.__reduce__``). As with torch
        tensors, only leaves can be copied; ``.grad`` and attributes (``nn.Parameter``-ness)
        are copied too, hooks are not."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                f"copy.deepcopy of a non-leaf DTensor ({self._spec.render()} on {self._spec.mesh}): only "
                "tensors created by the user can be deep-copied, as in torch; copy .detach() instead"
            )
        new = DTensor(
            self._local_tensor.detach().clone(), copy.deepcopy(self._spec, memo), requires_grad=self.requires_grad
        )
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle as this rank's block + the layout (+ requires_grad and attributes): each rank
        saves and loads its own block; ``torch.save`` stores the block's storage as usual."""
        return _rebuild_dtensor, (self._local_tensor.detach(), self._spec, self.requires_grad, dict(self.__dict__))

    # ------------------------------------------------------------------ torch's distributed checkpoint
    # torch.distributed.checkpoint.save/load ask these of the tensors they are given: a shardwise
    # DTensor answers with its block, so torch's checkpoint saves and loads it as its own DTensors
    # (shardwise/tensor/torch_checkpoint.py).
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        return torch_checkpoint.write_items(self, fqn)

    def __create_chunk_list__(self) -> list:
        return torch_checkpoint.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return torch_checkpoint.tensor_shard(self, index)

    # ------------------------------------------------------------------ torch.compile
    # A DTensor is traced as its block plus its spec: the spec (mesh by identity, placements,
    # global shape, stride and dtype) is the hashable context that guards compare, and the
    # dispatcher runs at trace time on fake blocks, so its collectives become graph nodes
    # (see comm/collectives.py). docs/parallelism.md, "Compiling: torch.compile", describes the path.
    def __tensor_flatten__(self) -> tuple[list[str], DTensorSpec]:
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict, spec: DTensorSpec, outer_size, outer_stride) -> "DTensor":
        # Called on every output of every compiled call: wrap without the constructor's frame and
        # keyword parsing (the compiled chain of benchmarks/compile.py pays a tenth less per call).
        meta = spec.tensor_meta
        if tuple(outer_size) != tuple(meta.shape) or tuple(outer_stride) != tuple(meta.stride):
            spec = replace(spec, tensor_meta=replace(meta, shape=torch.Size(outer_size), stride=tuple(outer_stride)))
        return wrap_block(inner_tensors["_local_tensor"], spec)

    def __coerce_tangent_metadata__(self) -> "DTensor":
        """The gradient flowing into a Partial output is Replicate on those axes (the gradient
        of a pending sum is the whole gradient), so compiled backward graphs are traced for it."""
        if not any(p.is_partial() for p in self._spec.placements):
            return self
        placements = [Replicate() if p.is_partial() else p for p in self._spec.placements]
        return self.redistribute(self._spec.mesh, placements)

    def __coerce_same_metadata_as_tangent__(self, expected: DTensorSpec, expected_type: type | None = None):
        """The runtime gradient laid out as the compiled backward was traced for (None if it
        cannot be: another tensor type or another mesh)."""
        if expected_type not in (None, DTensor) or expected.mesh != self._spec.mesh:
            return None
        if expected.placements == self._spec.placements:
            return self
        return self.redistribute(expected.mesh, expected.placements)


_make_wrapper = torch.Tensor._make_wrapper_subclass


@never_compiled  # as DTensor.__new__: eager code a compiled frame calls back builds DTensors here
def wrap_block(local_tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local_tensor, spec, requires_grad=False)`` without the constructor's Python
    frame and keyword parsing: how the dispatcher wraps every op's outputs (its hot path).
    Keep in step with ``DTensor.__new__``."""
    meta = spec.tensor_meta
    self = _make_wrapper(DTensor, meta.shape, strides=meta.stride, dtype=meta.dtype,
                         device=local_tensor.device, layout=local_tensor.layout, requires_grad=False)
    self._local_tensor = local_tensor
    self._spec = spec
    return self


# The layers below build DTensors without importing this module (docs/architecture.md).
bind_tensor_class(DTensor, wrap_block)
layout_functions.bind_tensor_class(DTensor)


# ---------------------------------------------------------------------- the conversions
# One opaque call each under torch.compile; arguments travel packed (see shardwise/compile/opaque.py).
@opaque
def _from_local(local: torch.Tensor, mesh: DeviceMesh, placements: Packed, run_check: bool,
                shape: Packed, stride: Packed, grad_placements: Packed) -> DTensor:
    placements, shape, stride, grad_placements = unpack(placements), unpack(shape), unpack(stride), unpack(grad_placements)
    if mesh.device_type != local.device.type and local.device.type == "cpu":
        local = local.to(mesh.device_type)
    traced = tracing()
    if run_check and mesh.get_coordinate() is not None and not traced:
        spec = _checked_spec(local, mesh, placements, shape, stride)
    else:
        spec = _unchecked_spec(local, mesh, placements, shape, stride, note=not traced)
    if mesh.get_coordinate() is None:  # outside the mesh: an empty block (a view), as torch holds
        local = local.as_strided((0,) * local.ndim, (1,) * local.ndim)
    return FromLocal.apply(local, spec, grad_placements)


@opaque
def _to_local(dtensor: DTensor, grad_placements: Packed) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return dtensor._local_tensor
    return ToLocal.apply(dtensor, unpack(grad_placements))


@opaque
def _redistribute(dtensor: DTensor, device_mesh: Packed, placements: Packed,
                  forward_dtype: Packed, backward_dtype: Packed) -> DTensor:
    device_mesh, placements = unpack(device_mesh), unpack(placements)
    forward_dtype, backward_dtype = unpack(forward_dtype), unpack(backward_dtype)
    spec = dtensor._spec
    mesh = device_mesh or spec.mesh
    meta = spec.tensor_meta
    if forward_dtype is not None and forward_dtype != meta.dtype:
        meta = replace(meta, dtype=forward_dtype)
    if mesh != spec.mesh:
        check_same_ranks(spec, mesh)
        return Redistribute.apply(dtensor, DTensorSpec(mesh, placements, meta), backward_dtype)
    dst = DTensorSpec(mesh, placements, meta)
    if dst == spec and (backward_dtype is None or backward_dtype == meta.dtype):
        return dtensor
    return Redistribute.apply(dtensor, dst, backward_dtype)


@opaque
def _full_tensor(dtensor: DTensor, grad_placements: Packed) -> torch.Tensor:
    spec = dtensor._spec
    if dtensor._local_tensor.is_meta and not META_STEP.get():
        raise ValueError(
            f"full_tensor() of the meta DTensor {spec.render()} on {spec.mesh}: a meta tensor "
            "has no data to gather. Materialize it first (module.to_empty(device=...) and initialize the "
            "parameters, or build the tensor on a real device)"
        )
    replicated = _redistribute(dtensor, pack(spec.mesh), pack((Replicate(),) * spec.mesh.ndim), (), ())
    return _to_local(replicated, grad_placements)


def _keep_grad_layout(leaf: DTensor) -> None:
    """Make gradients reach ``leaf`` cut into ``leaf``'s own blocks.

    The dispatcher picks each backward op's layout by cost, so a gradient may arrive Partial or
    sharded differently from its leaf: a weight gradient computed from Partial activations is
    itself Partial. Its value is right, but a sharded parameter would then hold a whole-size
    gradient on every rank, and code that reads ``p.grad.to_local()`` next to ``p.to_local()``
    (an optimizer, a norm over local blocks) needs the blocks to line up. So on every mesh axis
    the gradient is brought to the leaf's placement once, before it is accumulated, with one
    exception: where the leaf is Replicate, a Partial gradient stays pending (every rank's block
    has the leaf's shape; the reduction is deferred to whoever needs the value, as in torch, so
    data parallelism and gradient accumulation reduce it once). A Partial leaf's gradient is
    Replicate there (the gradient of a pending sum is the whole gradient). The table of names
    in docs/concepts.md states this contract.

    Registered once per leaf. The hook holds the layout, not the leaf (a weak reference would
    forbid ``torch.utils.swap_tensors``, which ``module.to_empty`` uses).
    """
    hooks = leaf._backward_hooks
    if hooks and any(isinstance(h, functools.partial) and h.func is _to_leaf_blocks for h in hooks.values()):
        return
    spec = leaf._spec
    leaf.register_hook(functools.partial(_to_leaf_blocks, spec.mesh, spec.placements))


def _to_leaf_blocks(mesh: DeviceMesh, leaf: tuple[Placement, ...], grad: torch.Tensor) -> torch.Tensor | None:
    if not isinstance(grad, DTensor) or grad._spec.mesh != mesh:
        return None
    have = grad._spec.placements
    want = tuple(
        g if (p.is_replicate() and g.is_partial()) else (Replicate() if p.is_partial() else p)
        for p, g in zip(leaf, have)
    )
    return None if want == have else grad.redistribute(mesh, want)


def _rebuild_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool, attrs: dict[str, Any]) -> DTensor:
    """Unpickle a DTensor (see ``DTensor.__reduce_ex__``)."""
    dtensor = DTensor(local, spec, requires_grad=requires_grad)
    for name, value in attrs.items():
        setattr(dtensor, name, value)
    return dtensor


def _unchecked_spec(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
    shape: Sequence[int] | None, stride: Sequence[int] | None, note: bool = True,
) -> DTensorSpec:
    """The spec this rank infers on its own (noted, to be confirmed before the next collective;
    not while tracing, where blocks have no data)."""
    if shape is not None:
        spec, how = DTensorSpec(mesh, placements, agreement.global_meta(local, shape, stride)), "shape= given"
    else:
        probe = DTensorSpec(mesh, placements, TensorMeta(local.shape, contiguous_stride(local.shape), local.dtype))
        even = agreement.even_shape(local.shape, mesh, probe.placements)
        meta = TensorMeta(even, agreement.even_stride(local.stride(), mesh, probe.placements), local.dtype)
        spec, how = DTensorSpec(mesh, probe.placements, meta), "shape inferred assuming even blocks"
    if note:
        agreement.note(spec, tuple(local.shape), how)
    return spec


def _checked_spec(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
    shape: Sequence[int] | None, stride: Sequence[int] | None,
) -> DTensorSpec:
    """The spec every rank's block agrees on, or one ValueError raised on every rank."""
    error, normalized = "", placements
    try:  # a bad placement for this block is reported with the others, not raised alone
        meta = TensorMeta(local.shape, contiguous_stride(local.shape), local.dtype)
        normalized = DTensorSpec(mesh, placements, meta).placements
    except (ValueError, IndexError) as err:
        error = str(err)
    info = agreement.describe_block(local, placements, shape, error, stride)
    global_shape, implied, problems = agreement.check_blocks(agreement.gather_grid(info, mesh), mesh, normalized)
    if problems:
        raise ValueError(
            f"from_local(run_check=True): the blocks do not form one {render_layout(mesh, normalized, None)} "
            f"layout on {mesh}: " + "; ".join(problems)
        )
    if shape is None and stride is None:
        stride = implied
    return DTensorSpec(mesh, normalized, agreement.global_meta(local, global_shape, stride))
