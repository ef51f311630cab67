"""DTensor: one logical tensor = this rank's block (``_local_tensor``) + its spec.

To PyTorch it is a tensor of the GLOBAL shape, dtype and device; its storage is empty. Every
ATen op on it goes through ``__torch_dispatch__`` to the op dispatcher, which computes on the
local blocks and inserts the communication the layouts require.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from shardwise import comm
from shardwise.dispatch import dispatch
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Replicate, Shard, as_placements
from shardwise.redistribute.function import FromLocal, Redistribute, ToLocal
from shardwise.spec import DTensorSpec, TensorMeta, contiguous_stride

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
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
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
    ) -> "DTensor":
        """Wrap the block this rank already holds, without copying it.

        Args:
            local_tensor: this rank's block.
            device_mesh: the mesh (default: a 1-D mesh over the world).
            placements: one per mesh axis (default: all Replicate).
            run_check: verify with communication that ranks agree (replicas equal, block
                shapes consistent with ``shape``); raises on every rank otherwise.
            shape, stride: the global shape and stride. Without them the global shape is
                inferred: from the local shape when blocks are even, by gathering every
                rank's block size when they may not be.

        Returns:
            A DTensor that is a view of ``local_tensor`` (differentiable).
        """
        from shardwise.api import default_mesh

        mesh = device_mesh or default_mesh(local_tensor.device.type)
        placements = (as_placements(placements, "from_local: placements") if placements is not None
                      else (Replicate(),) * mesh.ndim)
        if mesh.device_type != local_tensor.device.type and local_tensor.device.type == "cpu":
            local_tensor = local_tensor.to(mesh.device_type)
        meta = _global_meta(local_tensor, mesh, placements, shape, stride, run_check)
        spec = DTensorSpec(mesh, placements, meta)
        if run_check:
            _check_blocks(local_tensor, spec)
        return FromLocal.apply(local_tensor, spec)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's block (a view). ``grad_placements`` says how to read its gradient."""
        if grad_placements is not None:
            grad_placements = as_placements(grad_placements, "to_local: grad_placements")
        if not torch.is_grad_enabled():
            return self._local_tensor
        return ToLocal.apply(self, grad_placements or None)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> "DTensor":
        """The same logical tensor laid out by ``placements``, with the cheapest communication.

        Partial may be a target (for gradients); going from one Partial op to another reduces
        first. Changing the mesh is not supported.
        """
        mesh = device_mesh or self._spec.mesh
        if mesh != self._spec.mesh:
            raise ValueError(
                f"redistribute cannot move {self._spec.render()} from {self._spec.mesh} to {mesh}; "
                "only the placements may change"
            )
        if placements is None:
            raise ValueError("redistribute needs target placements")
        dst = self._spec.with_placements(as_placements(placements, "redistribute: placements"))
        if dst.placements == self._spec.placements:
            return self
        return Redistribute.apply(self, dst)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole logical tensor on every rank (an all_gather / all_reduce: not for hot paths)."""
        replicated = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def __tensor_flatten__(self):
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=False)


def _global_meta(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    run_check: bool,
) -> TensorMeta:
    """Global metadata of blocks laid out by ``placements``: given, or inferred."""
    if shape is not None:
        shape = torch.Size(shape)
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
        return TensorMeta(shape, stride, local.dtype)
    if stride is not None:
        raise ValueError("from_local: pass shape together with stride")
    probe = DTensorSpec(mesh, placements, TensorMeta(local.shape, tuple(local.stride()), local.dtype))
    global_shape = list(local.shape)
    for axis, p in enumerate(probe.placements):
        if isinstance(p, Shard):
            sizes = comm.all_gather_object(local.shape[p.dim], mesh, axis) if run_check else None
            global_shape[p.dim] = sum(sizes) if sizes else global_shape[p.dim] * mesh.size(axis)
    shape = torch.Size(global_shape)
    return TensorMeta(shape, contiguous_stride(shape), local.dtype)


def _check_blocks(local: torch.Tensor, spec: DTensorSpec) -> None:
    """Raise on every rank unless every rank's block fits ``spec`` and replicas agree.

    Problems found in one slice of the mesh are then swept along every axis in turn, so each
    rank of the mesh ends up with the same list and raises the same error (none hangs later).
    """
    mesh = spec.mesh
    mine = (tuple(local.shape), spec.local_shape(), _digest(local))
    problems: set[str] = set()
    for axis in range(mesh.ndim):
        seen = comm.all_gather_object(mine, mesh, axis)
        problems |= {
            f"rank {i} along axis {mesh.axis_name(axis)} holds a {list(got)} block where the layout needs {list(want)}"
            for i, (got, want, _) in enumerate(seen) if got != want
        }
        if spec.placements[axis].is_replicate() and len({d for _, _, d in seen}) > 1:
            problems.add(f"replicas differ along axis {mesh.axis_name(axis)}")
    for axis in range(mesh.ndim):
        problems = set().union(*comm.all_gather_object(problems, mesh, axis))
    if problems:
        raise ValueError(
            f"from_local(run_check=True): blocks do not form {spec.render()} on {mesh}: "
            + "; ".join(sorted(problems))
        )


def _digest(t: torch.Tensor) -> bytes:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha1(raw.numpy().tobytes()).digest()
