"""The collectives, on local tensors along ONE mesh axis (docs/architecture.md).

Every function takes the per-rank lengths of the dim it cuts (uneven ``torch.chunk`` pieces
are normal) and issues through ``shardwise.comm.issue``, which numbers, records and names each
collective. Decisions such as "skip, nothing to move" depend only on global information, so
every rank of a group always enters the same collectives.

Bytes are those THIS rank sends under the optimal algorithm for the collective:
all_gather (n-1)*own, reduce_scatter input-own, all_to_all input-kept, all_reduce
reduce_scatter+all_gather over the flattened tensor, broadcast/scatter what the source sends.
Uneven all_gather and reduce_scatter travel as ``all_to_all_single`` with split sizes, which
moves exactly those bytes (padding would move more).

Under ``torch.compile`` (or inside ``run_ahead``) a collective is issued as a functional
collective (``torch.ops._c10d_functional`` with its ``wait_tensor``), so it becomes a node of
the captured graph instead of running at trace time. Eager blocks keep the in-place c10d calls
(no wrapper tensors on the hot path). ``*_async`` collectives return a ``Pending`` whose
``wait()`` gives the result.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from shardwise.comm.bytes import all_reduce_sent
from shardwise.comm.issue import await_release, awaited_buffers, failure_for, issue_eager, issue_traced, sequence_number, traced
from shardwise.comm.recorders import sending_per_peer

if TYPE_CHECKING:
    from shardwise.core.mesh import DeviceMesh

__all__ = [
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_counts", "scatter", "broadcast",
    "all_gather_object", "barrier", "ring_shift", "reduce_stacked", "Pending", "all_gather_async",
    "reduce_scatter_async", "all_reduce_async", "all_gather_single", "reduce_scatter_single",
]


# torch 2.13 renamed these; older releases (>= 2.6) only have the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT}
# gloo has no AVG: "avg" is summed, then divided (``_finish_avg``), traced or not.
_FUNCTIONAL_OPS = {"sum": "sum", "avg": "sum", "max": "max", "min": "min", "product": "product"}
_LOCAL_REDUCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda t: t.sum(0), "avg": lambda t: t.sum(0),
    "max": lambda t: t.amax(0), "min": lambda t: t.amin(0), "product": lambda t: t.prod(0),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """gloo has no AVG: sum, then divide (integer tensors floor-divide, as torch.mean refuses them)."""
    if op != "avg":
        return t
    return t.div_(n) if t.is_floating_point() or t.is_complex() else t.floor_divide_(n)


def reduce_stacked(stacked: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """The ``op`` reduction of ``n`` contributions stacked on dim 0, as a collective with
    ``op`` computes it (for executors that gather contributions by all_to_all)."""
    return _finish_avg(_LOCAL_REDUCE[op](stacked), op, n)


def _rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved first and made contiguous, so pieces along it are flat runs."""
    return t.movedim(dim, 0).contiguous()


def _stacked_to_cat(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, *piece]`` -> the n pieces concatenated along ``dim``, contiguous (a view for dim 0).

    The copy moves runs of ``piece[dim:]`` elements, as ``torch.cat`` would; moving ``dim``
    first and back instead transposes element by element (1.2-1.9x torch's time for a gather
    along dim 1, ``benchmarks/redistribute.py``).
    """
    n, piece = stacked.shape[0], list(stacked.shape[1:])
    whole = list(piece)
    whole[dim] *= n
    return stacked.movedim(0, dim).reshape(whole)


def _cat_to_stacked(full: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``full``'s n equal pieces along ``dim``, stacked first: ``[n, *piece]``, contiguous
    (no copy for a contiguous ``full`` cut along dim 0)."""
    shape = list(full.shape)
    split = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]
    return full.reshape(split).movedim(dim, 0).contiguous()


def _piece_shape(shape: Sequence[int], dim: int, length: int) -> list[int]:
    """``shape`` with ``length`` along ``dim``."""
    piece = list(shape)
    piece[dim] = length
    return piece


def _cat_pieces(flat: torch.Tensor, shapes: Sequence[Sequence[int]], dim: int) -> torch.Tensor:
    """The pieces laid one after another in ``flat`` (their ``shapes``), concatenated along
    ``dim``: a view when ``dim`` is 0, one copy otherwise."""
    if dim == 0:
        rest = list(shapes[0][1:])
        return flat.view(sum(s[0] for s in shapes), *rest)
    chunks = torch.split(flat, [math.prod(s) for s in shapes])
    return torch.cat([c.view(s) for c, s in zip(chunks, shapes)], dim=dim)


def _flat_pieces(t: torch.Tensor, dim: int, lengths: Sequence[int]) -> torch.Tensor:
    """``t``'s consecutive pieces along ``dim`` (``lengths``), each flattened, one after another."""
    if dim == 0:
        return t.contiguous().reshape(-1)
    if len(set(lengths)) == 1:
        return _cat_to_stacked(t, dim, len(lengths)).reshape(-1)
    return torch.cat([p.reshape(-1) for p in torch.split(t, list(lengths), dim=dim)])


def _a2a_flat(kind: str, mesh: DeviceMesh, axis: int, nbytes: int,
              send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """all_to_all_single over flat buffers with element counts per peer (issued as ``kind``)."""
    if traced(send):
        return issue_traced(kind, mesh, axis, nbytes, funcol.all_to_all_single, send, list(recv_counts),
                             list(send_counts))
    recv = send.new_empty(sum(recv_counts))
    issue_eager(kind, mesh, axis, nbytes, dist.all_to_all_single, recv, send, recv_counts, send_counts)
    return recv


def all_gather(
    shard: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int, lengths: Sequence[int]
) -> torch.Tensor:
    """Concatenate every rank's ``shard`` along ``dim``; ``lengths`` are their sizes there."""
    n = mesh.size(axis)
    rest = _rest(shard, dim)
    if sum(lengths) * rest == 0:
        return _empty_cat(shard, dim, sum(lengths))
    nbytes = (n - 1) * _nbytes(shard)
    block = shard.contiguous()
    if len(set(lengths)) > 1:
        recv = _a2a_flat("all_gather", mesh, axis, nbytes, block.reshape(-1).repeat(n), [block.numel()] * n,
                         [l * rest for l in lengths])
        return _cat_pieces(recv, [_piece_shape(block.shape, dim, l) for l in lengths], dim)
    if traced(block):
        out = issue_traced("all_gather", mesh, axis, nbytes, funcol.all_gather_tensor, block, 0)
    else:
        out = block.new_empty((n * block.shape[0], *block.shape[1:]))
        issue_eager("all_gather", mesh, axis, nbytes, all_gather_single, out, block)
    if dim == 0:  # the gathered buffer itself: a view would hold a second reference to it
        return out
    return _stacked_to_cat(out.view(n, *block.shape), dim)


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
    nbytes = (full.shape[dim] - lengths[me]) * rest * full.element_size()
    piece = _piece_shape(full.shape, dim, lengths[me])
    if len(set(lengths)) > 1:
        recv = _a2a_flat("reduce_scatter", mesh, axis, nbytes, _flat_pieces(full, dim, lengths),
                         [l * rest for l in lengths], [lengths[me] * rest] * n)
        return _finish_avg(_LOCAL_REDUCE[op](recv.view(n, *piece)), op, n)
    stacked = _cat_to_stacked(full, dim, n)  # [n, *piece]: piece s is the s-th flat run
    rows = stacked.view(n * piece[0], *piece[1:])
    if traced(rows):
        out = issue_traced("reduce_scatter", mesh, axis, nbytes, funcol.reduce_scatter_tensor, rows,
                            _FUNCTIONAL_OPS[op], 0)
    else:
        out = rows.new_empty(piece)
        issue_eager("reduce_scatter", mesh, axis, nbytes, reduce_scatter_single, out, rows, op=_REDUCE_OPS[op])
    return _finish_avg(out, op, n)


def all_reduce(tensor: torch.Tensor, mesh: DeviceMesh, axis: int, op: str) -> torch.Tensor:
    """Reduce ``tensor`` over the axis with ``op``; every rank gets the result (a new tensor)."""
    n = mesh.size(axis)
    if tensor.numel() == 0:
        return tensor.contiguous().clone()
    nbytes = all_reduce_sent(tensor.numel(), n, 0) * tensor.element_size()  # the busiest rank's figure
    if traced(tensor):
        out = issue_traced("all_reduce", mesh, axis, nbytes, funcol.all_reduce, tensor.contiguous(),
                            _FUNCTIONAL_OPS[op])
        return _finish_avg(out, op, n)
    out = tensor.contiguous().clone()
    issue_eager("all_reduce", mesh, axis, nbytes, dist.all_reduce, out, op=_REDUCE_OPS[op])
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
    me = mesh.get_local_rank(axis)
    full_shape = list(tensor.shape)
    full_shape[cat_dim] = sum(cat_lengths)
    if math.prod(full_shape) == 0:
        full_shape[split_dim] = split_lengths[me]
        return tensor.new_zeros(full_shape)
    send = _flat_pieces(tensor, split_dim, split_lengths)
    piece_shape = _piece_shape(tensor.shape, split_dim, split_lengths[me])
    kept = math.prod(piece_shape)
    nbytes = (send.numel() - kept) * tensor.element_size()
    rest = _rest(tensor, split_dim)
    per_peer = [_piece_shape(piece_shape, cat_dim, length) for length in cat_lengths]
    recv = _a2a_flat("all_to_all", mesh, axis, nbytes, send, [length * rest for length in split_lengths],
                     [math.prod(s) for s in per_peer])
    return _cat_pieces(recv, per_peer, cat_dim)


def all_to_all_counts(
    send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], mesh: DeviceMesh, axis: int
) -> torch.Tensor:
    """Give axis rank s the next ``send_counts[s]`` elements of the flat ``send`` (peers in rank
    order); return what every peer sent here, concatenated in rank order (``recv_counts``).

    Counts may differ per peer and be zero (a redistribute exchange sends each rank only what
    it lacks). This rank's own count should be 0: keeping data needs no collective. The caller
    makes sure every rank of the group enters (skip only when all counts are 0 on every rank).
    """
    me = mesh.get_local_rank(axis)
    nbytes = (sum(send_counts) - send_counts[me]) * send.element_size()
    per_peer = [0 if s == me else n * send.element_size() for s, n in enumerate(send_counts)]
    with sending_per_peer(per_peer):  # what recorders show (``per_peer_bytes``)
        return _a2a_flat("all_to_all", mesh, axis, nbytes, send.reshape(-1).contiguous(),
                         list(send_counts), list(recv_counts))


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
    if traced(full):  # no functional scatter: the source's whole tensor, then this rank's piece
        whole = broadcast(full, mesh, axis, src)
        return whole.narrow(dim, sum(lengths[:me]), lengths[me]).clone()
    rows = _rows_first(full, dim)
    out = rows.new_empty((width, *rows.shape[1:]))
    pieces, nbytes = None, 0
    if me == src:
        nbytes = (n - 1) * width * rest * full.element_size()
        pieces = [_padded(p, width) for p in torch.split(rows, list(lengths))]
    issue_eager("scatter", mesh, axis, nbytes, dist.scatter, out, pieces, group_src=src)
    return out[: lengths[me]].movedim(0, dim)


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    if rows.shape[0] == width:
        return rows.contiguous()
    pad = rows.new_zeros((width - rows.shape[0], *rows.shape[1:]))
    return torch.cat([rows, pad])


def broadcast(tensor: torch.Tensor, mesh: DeviceMesh, axis: int, src: int) -> torch.Tensor:
    """Axis rank ``src``'s values, on every rank of the axis (a new tensor)."""
    me = mesh.get_local_rank(axis)
    if traced(tensor) and tensor.numel():
        nbytes = _nbytes(tensor) if me == src else 0
        return issue_traced("broadcast", mesh, axis, nbytes, funcol.broadcast, tensor.contiguous(), src)
    out = tensor.contiguous().clone()
    if out.numel() == 0:
        return out
    issue_eager("broadcast", mesh, axis, _nbytes(out) if me == src else 0, dist.broadcast, out, group_src=src)
    return out


def all_gather_object(obj: object, mesh: DeviceMesh, axis: int) -> list:
    """Every rank's ``obj`` along the axis (metadata exchange: shapes, checksums)."""
    out: list = [None] * mesh.size(axis)
    issue_eager("all_gather_object", mesh, axis, 0, dist.all_gather_object, out, obj)
    return out


def barrier() -> None:
    """Wait until every rank of the default group arrives (before tearing the group down, so
    no rank destroys its connections while a peer is still finishing a collective)."""
    issue_eager("barrier", None, 0, 0, dist.barrier)


def ring_shift(tensors: Sequence[torch.Tensor], mesh: DeviceMesh, axis: int,
               tag: int = 0) -> Callable[[], list[torch.Tensor]]:
    """Pass ``tensors`` one step around the ring of the mesh axis; returns ``wait``.

    Starts at once (point-to-point, ``batch_isend_irecv``): this rank sends its tensors to the
    next rank of the axis and receives same-shaped ones from the previous rank. ``wait()``
    returns the received tensors; compute issued in between overlaps the transfer (ring
    attention). Shifts in flight at the same time on one axis need distinct ``tag``s. Recorded
    as one ``send_recv`` of the bytes sent; on a one-rank axis ``wait`` returns the tensors
    themselves.
    """
    n = mesh.size(axis)
    if n == 1:
        return lambda: list(tensors)
    me = mesh.get_local_rank(axis)
    sends = [t.contiguous() for t in tensors]
    recvs = [torch.empty_like(t) for t in sends]
    nbytes = sum(_nbytes(t) for t in sends)
    group = mesh.get_group(axis)
    ranks = dist.get_process_group_ranks(group)
    nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def start(*, group):
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, prev, group, tag) for t in recvs]
        return dist.batch_isend_irecv(ops)

    works = issue_eager("send_recv", mesh, axis, nbytes, start)
    seq = sequence_number(group)

    def wait() -> list[torch.Tensor]:
        try:
            for work in works:
                work.wait()
        except RuntimeError as err:
            failure = failure_for(err, "send_recv", seq, group, mesh, axis, nbytes)
            if failure is None:
                raise
            raise failure from err
        return recvs

    return wait


# ---------------------------------------------------------------------- running ahead
PENDING_RELEASE_LIMIT_S = 0.05  # see issue.await_release


class Pending:
    """A collective issued without waiting: ``wait()`` blocks until it is done and returns its
    result. Compute issued before ``wait()`` overlaps the transfer (gloo runs it on its own
    threads, NCCL on its stream). A failure surfaces at ``wait()``, named like a blocking one's."""

    __slots__ = ("_work", "_result", "_finish", "_call", "_held")

    def __init__(self, work, result: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor], call: tuple,
                 held: list | None = None) -> None:
        self._work, self._result, self._finish, self._call = work, result, finish, call
        self._held = held  # buffers to see released after the wait (issue.awaiting_release)

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait()
            except RuntimeError as err:
                failure = failure_for(err, *self._call)
                if failure is None:
                    raise
                raise failure from err
            if self._held:
                await_release(self._held, PENDING_RELEASE_LIMIT_S)
                self._held = None
            self._result = self._finish(self._result)
        return self._result


def _issue_async(kind: str, mesh: DeviceMesh, axis: int, nbytes: int, collective: Callable, result: torch.Tensor,
                 *args, finish: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, **kwargs) -> Pending:
    held = awaited_buffers(args)
    work = issue_eager(kind, mesh, axis, nbytes, collective, *args, async_op=True, **kwargs)
    group = mesh.get_group(axis)
    return Pending(work, result, finish, (kind, sequence_number(group), group, mesh, axis, nbytes), held)


def all_gather_async(shard: torch.Tensor, mesh: DeviceMesh, axis: int) -> Pending:
    """Start concatenating every rank's equal-sized ``shard`` along dim 0; ``wait()`` gives the result."""
    n = mesh.size(axis)
    rows = shard.contiguous()
    out = rows.new_empty((rows.shape[0] * n, *rows.shape[1:]))
    if out.numel() == 0:
        return Pending(None, out, lambda t: t, ())
    return _issue_async("all_gather", mesh, axis, (n - 1) * _nbytes(rows), all_gather_single, out, out, rows)


def reduce_scatter_async(full: torch.Tensor, mesh: DeviceMesh, axis: int, op: str) -> Pending:
    """Start reducing ``full`` (dim 0 a multiple of the axis size) and keeping this rank's
    equal piece of dim 0; ``wait()`` gives the piece."""
    n = mesh.size(axis)
    rows = full.contiguous()
    out = rows.new_empty((rows.shape[0] // n, *rows.shape[1:]))
    if rows.numel() == 0:
        return Pending(None, out, lambda t: t, ())
    nbytes = (rows.shape[0] - out.shape[0]) * _rest(rows, 0) * rows.element_size()
    return _issue_async("reduce_scatter", mesh, axis, nbytes, reduce_scatter_single, out, out, rows,
                        op=_REDUCE_OPS[op], finish=lambda t: _finish_avg(t, op, n))


def all_reduce_async(tensor: torch.Tensor, mesh: DeviceMesh, axis: int, op: str) -> Pending:
    """Start reducing ``tensor`` over the axis, in place (the caller hands over a buffer it no
    longer reads); ``wait()`` gives the result."""
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_async reduces in place: it needs a contiguous tensor")
    n = mesh.size(axis)
    out = tensor
    if out.numel() == 0:
        return Pending(None, out, lambda t: t, ())
    nbytes = all_reduce_sent(out.numel(), n, 0) * out.element_size()  # the busiest rank's figure
    return _issue_async("all_reduce", mesh, axis, nbytes, dist.all_reduce, out, out, op=_REDUCE_OPS[op],
                        finish=lambda t: _finish_avg(t, op, n))
