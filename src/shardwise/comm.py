"""The only module that issues collectives.

Every function works on local tensors along ONE mesh axis, takes the per-rank lengths of the
dim it cuts (uneven ``torch.chunk`` pieces are normal), and reports what it sent to the active
recorders (``shardwise.debug.CommDebugMode``). Decisions such as "skip, nothing to move" depend
only on global information, so every rank of a group always enters the same collectives.

Bytes are those THIS rank sends under the optimal algorithm for the collective:
all_gather (n-1)*own, reduce_scatter input-own, all_to_all input-kept, all_reduce
reduce_scatter+all_gather over the flattened tensor, broadcast/scatter what the source sends.
Uneven all_gather and reduce_scatter travel as ``all_to_all_single`` with split sizes, which
moves exactly those bytes (padding would move more).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from shardwise.mesh import DeviceMesh

__all__ = [
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "scatter", "broadcast",
    "all_gather_object", "CommRecorder", "add_recorder", "remove_recorder",
]


class CommRecorder(Protocol):
    def record(self, kind: str, mesh: DeviceMesh, axis: int, bytes_sent: int) -> None: ...


_RECORDERS: list[CommRecorder] = []


def add_recorder(recorder: CommRecorder) -> None:
    """Start telling ``recorder`` about every collective issued from this process."""
    _RECORDERS.append(recorder)


def remove_recorder(recorder: CommRecorder) -> None:
    _RECORDERS.remove(recorder)


def _record(kind: str, mesh: DeviceMesh, axis: int, bytes_sent: int) -> None:
    for recorder in _RECORDERS:
        recorder.record(kind, mesh, axis, bytes_sent)


# torch 2.13 renamed these; older releases (>= 2.6) only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_LOCAL_REDUCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda t: t.sum(0), "avg": lambda t: t.sum(0),
    "max": lambda t: t.amax(0), "min": lambda t: t.amin(0),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """gloo has no AVG: sum, then divide (integer tensors floor-divide, as torch.mean refuses them)."""
    if op != "avg":
        return t
    return t.div_(n) if t.is_floating_point() or t.is_complex() else t.floor_divide_(n)


def _rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved first and made contiguous, so pieces along it are flat runs."""
    return t.movedim(dim, 0).contiguous()


def _a2a_flat(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all_single over flat buffers with element counts per peer."""
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


def all_gather(
    shard: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int, lengths: Sequence[int]
) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along ``dim``; ``lengths`` are their sizes there."""
    n = mesh.size(axis)
    rest = _rest(shard, dim)
    if sum(lengths) * rest == 0:
        return _empty_cat(shard, dim, sum(lengths))
    group = mesh.get_group(axis)
    _record("all_gather", mesh, axis, (n - 1) * _nbytes(shard))
    rows = _rows_first(shard, dim)  # [len_me, *rest]
    if len(set(lengths)) == 1:
        out = rows.new_empty((lengths[0] * n, *rows.shape[1:]))
        _all_gather_single(out, rows, group=group)
    else:
        flat = rows.reshape(-1).repeat(n)
        recv = _a2a_flat(flat, [rows.numel()] * n, [l * rest for l in lengths], group)
        out = recv.view(sum(lengths), *rows.shape[1:])
    return out.movedim(0, dim)


def _rest(t: torch.Tensor, dim: int) -> int:
    return math.prod(s for i, s in enumerate(t.shape) if i != dim)


def _empty_cat(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = length
    return t.new_zeros(shape)


def reduce_scatter(
    full: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int, op: str, lengths: Sequence[int]
) -> torch.Tensor:
    """Reduce ``full`` over the axis with ``op`` and keep this rank's piece along ``dim``."""
    n, me = mesh.size(axis), mesh.get_local_rank(axis)
    rest = _rest(full, dim)
    if full.numel() == 0:
        return full.narrow(dim, sum(lengths[:me]), lengths[me]).clone()
    group = mesh.get_group(axis)
    _record("reduce_scatter", mesh, axis, (full.shape[dim] - lengths[me]) * rest * full.element_size())
    rows = _rows_first(full, dim)
    if len(set(lengths)) == 1:
        out = rows.new_empty((lengths[0], *rows.shape[1:]))
        _reduce_scatter_single(out, rows, op=_REDUCE_OPS[op], group=group)
    else:
        recv = _a2a_flat(rows.reshape(-1), [l * rest for l in lengths], [lengths[me] * rest] * n, group)
        out = _LOCAL_REDUCE[op](recv.view(n, lengths[me], *rows.shape[1:]))
    return _finish_avg(out, op, n).movedim(0, dim)


def all_reduce(tensor: torch.Tensor, mesh: DeviceMesh, axis: int, op: str) -> torch.Tensor:
    """Reduce ``tensor`` over the axis with ``op``; every rank gets the result (a new tensor)."""
    n = mesh.size(axis)
    out = tensor.contiguous().clone()
    if tensor.numel() == 0:
        return out
    own = -(-tensor.numel() // n)
    _record("all_reduce", mesh, axis, (tensor.numel() + (n - 2) * own) * tensor.element_size())
    dist.all_reduce(out, op=_REDUCE_OPS[op], group=mesh.get_group(axis))
    return _finish_avg(out, op, n)


def all_to_all(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    axis: int,
    split_dim: int,
    split_lengths: Sequence[int],
    cat_dim: int,
    cat_lengths: Sequence[int],
) -> torch.Tensor:
    """Re-cut along another dim: give rank s piece s of ``split_dim``, concatenate along ``cat_dim``.

    Before: this rank holds piece ``me`` of ``cat_dim`` (``cat_lengths[me]`` long), whole along
    ``split_dim``. After: whole along ``cat_dim``, piece ``me`` of ``split_dim``.
    """
    n, me = mesh.size(axis), mesh.get_local_rank(axis)
    full_shape = list(tensor.shape)
    full_shape[cat_dim] = sum(cat_lengths)
    if math.prod(full_shape) == 0:
        full_shape[split_dim] = split_lengths[me]
        return tensor.new_zeros(full_shape)
    offsets = [sum(split_lengths[:s]) for s in range(n)]
    pieces = [tensor.narrow(split_dim, offsets[s], split_lengths[s]) for s in range(n)]
    send = torch.cat([p.reshape(-1) for p in pieces])
    kept = pieces[me].numel()
    _record("all_to_all", mesh, axis, (send.numel() - kept) * tensor.element_size())
    piece_shape = list(tensor.shape)
    piece_shape[split_dim] = split_lengths[me]
    per_peer = []
    for s in range(n):
        shape = list(piece_shape)
        shape[cat_dim] = cat_lengths[s]
        per_peer.append(shape)
    recv = _a2a_flat(send, [p.numel() for p in pieces], [math.prod(s) for s in per_peer], mesh.get_group(axis))
    chunks = torch.split(recv, [math.prod(s) for s in per_peer])
    return torch.cat([c.view(s) for c, s in zip(chunks, per_peer)], dim=cat_dim)


def scatter(
    full: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int, lengths: Sequence[int], src: int
) -> torch.Tensor:
    """Axis rank ``src`` sends piece s of ``full`` along ``dim`` to axis rank s.

    Every rank passes a tensor of the full shape; only the source's values are read.
    """
    n, me = mesh.size(axis), mesh.get_local_rank(axis)
    rest = _rest(full, dim)
    width = max(lengths)
    if width * rest == 0:
        return full.narrow(dim, sum(lengths[:me]), lengths[me]).clone()
    group = mesh.get_group(axis)
    rows = _rows_first(full, dim)
    out = rows.new_empty((width, *rows.shape[1:]))
    pieces = None
    if me == src:
        _record("scatter", mesh, axis, (n - 1) * width * rest * full.element_size())
        pieces = [_padded(p, width) for p in torch.split(rows, list(lengths))]
    else:
        _record("scatter", mesh, axis, 0)
    dist.scatter(out, pieces, group_src=src, group=group)
    return out[: lengths[me]].movedim(0, dim)


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    if rows.shape[0] == width:
        return rows.contiguous()
    pad = rows.new_zeros((width - rows.shape[0], *rows.shape[1:]))
    return torch.cat([rows, pad])


def broadcast(tensor: torch.Tensor, mesh: DeviceMesh, axis: int, src: int) -> torch.Tensor:
    """Axis rank ``src``'s values, on every rank of the axis (a new tensor)."""
    out = tensor.contiguous().clone()
    if out.numel() == 0:
        return out
    me = mesh.get_local_rank(axis)
    _record("broadcast", mesh, axis, _nbytes(out) if me == src else 0)
    dist.broadcast(out, group_src=src, group=mesh.get_group(axis))
    return out


def all_gather_object(obj: object, mesh: DeviceMesh, axis: int) -> list:
    """Every rank's ``obj`` along the axis (metadata exchange: shapes, checksums)."""
    out: list = [None] * mesh.size(axis)
    _record("all_gather_object", mesh, axis, 0)
    dist.all_gather_object(out, obj, group=mesh.get_group(axis))
    return out


def barrier() -> None:
    """Wait until every rank of the default group arrives (before tearing the group down, so
    no rank destroys its connections while a peer is still finishing a collective)."""
    dist.barrier()
