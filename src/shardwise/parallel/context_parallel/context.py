"""Context parallelism: shard sequences over a cp mesh and run attention as ring attention.

``context_parallel(mesh, buffers=[...], seq_dims=[...])`` is a context manager (the counterpart
of torch's experimental ``context_parallel``). On entry each buffer is cut along its sequence
dim and keeps only this rank's part, in place (the same tensor object, so a model's buffers
and the caller's input tensors change under their existing names); on exit the whole buffers
come back, except those listed in ``no_restore_buffers``. Inside, ``F.scaled_dot_product_attention``
on query/key/value that hold this rank's part of the sequence runs as ring attention:

* each rank keeps its query rows; the key/value blocks pass around the ring of the cp mesh
  (``comm.ring_shift``, point-to-point, the next transfer overlapping the current block's
  compute), and the partial softmax results merge by log-sum-exp (``ring_attention.py``);
* forward: every rank sends its k/v block ``cp - 1`` times, i.e. ``(cp - 1) / cp`` of the K and V
  bytes; backward: the k/v blocks travel again with their gradient accumulators, which come
  home after a full turn;
* causal attention uses the load-balanced layout by default: the sequence in ``2 * cp`` chunks,
  rank i holding chunks i and ``2*cp-1-i`` (each rank does the same causal work); buffers are
  sharded in that same layout. Positions (rotary tables) are buffers like the inputs, so each
  rank's rows keep their global positions.

SDPA is intercepted by swapping ``torch.nn.functional.scaled_dot_product_attention`` for the
duration of the block (as torch's default mode does): nothing outside the block, and no op
dispatch inside it, pays for the check. Code that imported the function by name before the
block (``from torch.nn.functional import scaled_dot_product_attention``) is not redirected.
DTensor query/key/value (e.g. heads sharded by tensor parallelism) run the ring on their local
blocks and keep their layout.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.core.mesh import DeviceMesh, check_mesh
from shardwise.parallel.context_parallel.ring_attention import (SequenceLayout, accumulation_dtype, block_backward, block_forward,
                                               chunk_pairs, merge)

__all__ = ["context_parallel", "context_parallel_unshard", "ring_attention"]


# ---------------------------------------------------------------------- the communicating ring
def _chunks(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return t.chunk(n, -2)


class _RingAttention(torch.autograd.Function):
    """Ring attention over one mesh axis; backward rings again (no attention matrix kept)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh, axis: int,
                layout: SequenceLayout, causal: bool, scale: float) -> torch.Tensor:
        me = mesh.get_local_rank(axis)
        n_q = len(layout.chunks_of(me))
        q_chunks = _chunks(q, n_q)
        acc: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * n_q
        kv = [k, v]
        for step in range(layout.cp):
            pending = comm.ring_shift(kv, mesh, axis) if step < layout.cp - 1 else None
            src = (me - step) % layout.cp
            n_kv = len(layout.chunks_of(src))
            k_chunks, v_chunks = _chunks(kv[0], n_kv), _chunks(kv[1], n_kv)
            for i, j, mask in chunk_pairs(layout, me, src, causal):
                acc[i] = merge(*acc[i], *block_forward(q_chunks[i], k_chunks[j], v_chunks[j], scale, mask))
            if pending is not None:
                kv = pending()
        out = torch.cat([o for o, _ in acc], -2)  # type: ignore[misc]
        lse = torch.cat([s for _, s in acc], -1)  # type: ignore[misc]
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)  # the output in q's dtype: bf16 runs keep no fp32 copy
        ctx.ring = (mesh, axis, layout, causal, scale)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        mesh, axis, layout, causal, scale = ctx.ring
        me = mesh.get_local_rank(axis)
        dtype = accumulation_dtype(q.dtype)
        n_q = len(layout.chunks_of(me))
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
        q_chunks, do_chunks, out_chunks = _chunks(q, n_q), _chunks(dout, n_q), _chunks(out, n_q)
        lse_chunks, delta_chunks = lse.chunk(n_q, -1), delta.chunk(n_q, -1)
        dq = [torch.zeros(c.shape, dtype=dtype, device=q.device) for c in q_chunks]
        kv = [k, v]
        travelling = None  # the dk/dv accumulators of the block arriving next (in flight)
        for step in range(layout.cp):
            pending = comm.ring_shift(kv, mesh, axis) if step < layout.cp - 1 else None
            src = (me - step) % layout.cp
            n_kv = len(layout.chunks_of(src))
            k_chunks, v_chunks = _chunks(kv[0], n_kv), _chunks(kv[1], n_kv)
            # This rank's share of block src's gradients, computed while its accumulators travel here.
            mine = [torch.zeros(k.shape, dtype=dtype, device=k.device), torch.zeros(v.shape, dtype=dtype, device=v.device)]
            dk_chunks, dv_chunks = _chunks(mine[0], n_kv), _chunks(mine[1], n_kv)
            for i, j, mask in chunk_pairs(layout, me, src, causal):
                dq_i, dk_j, dv_j = block_backward(do_chunks[i], q_chunks[i], k_chunks[j], v_chunks[j], out_chunks[i],
                                                  lse_chunks[i], delta_chunks[i], scale, mask)
                dq[i] += dq_i
                dk_chunks[j].add_(dk_j)
                dv_chunks[j].add_(dv_j)
            if travelling is not None:
                for acc, arrived in zip(mine, travelling()):
                    acc.add_(arrived)
            # on to the next rank; after the last step that is the block's owner
            travelling = comm.ring_shift(mine, mesh, axis, tag=1)
            if pending is not None:
                kv = pending()
        grads = travelling()
        dq_full = torch.cat(dq, -2).to(q.dtype)
        return dq_full, grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None


def _check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float,
                          enable_gqa: bool, layout: SequenceLayout) -> None:
    """Refuse what ring attention does not do, before any communication."""
    if attn_mask is not None:
        raise NotImplementedError("scaled_dot_product_attention under context_parallel: attn_mask is not supported "
                                  "(use is_causal=True for causal attention)")
    if dropout_p:
        raise NotImplementedError(f"scaled_dot_product_attention under context_parallel: dropout_p={dropout_p} is "
                                  f"not supported (use 0.0)")
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"scaled_dot_product_attention under context_parallel: query/key/value must be "
                         f"[*batch, heads, seq, dim] alike, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention under context_parallel: query, key and value must hold the "
                         f"same local sequence length (this rank's part of one sequence), got {q.shape[-2]}, "
                         f"{k.shape[-2]}, {v.shape[-2]}")
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if v.shape[-3] != kv_heads or (heads != kv_heads and (not enable_gqa or heads % kv_heads)):
        raise ValueError(f"scaled_dot_product_attention under context_parallel: {heads} query heads and "
                         f"{kv_heads}/{v.shape[-3]} key/value heads need equal counts, or enable_gqa=True with "
                         f"the query heads a multiple of the key/value heads")
    per_rank = len(layout.chunks_of(0))
    if q.shape[-2] % per_rank:
        raise ValueError(f"scaled_dot_product_attention under context_parallel: local sequence length "
                         f"{q.shape[-2]} is not {per_rank} equal chunks (load-balanced layout)")


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mesh: DeviceMesh, *,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                   load_balance: bool = True, mesh_dim: int | str = 0) -> torch.Tensor:
    """Scaled dot-product attention over a sequence sharded on ``mesh``'s ``mesh_dim``.

    Each argument holds this rank's part of the sequence (dim -2) in the ``SequenceLayout`` of
    ``load_balance``: what ``context_parallel`` gives. The result holds this rank's query rows
    and equals the matching rows of ``F.scaled_dot_product_attention`` on the whole sequence,
    gradients included.

    Example:
        >>> out = ring_attention(q_local, k_local, v_local, cp_mesh, is_causal=True)
    """
    axis = mesh._axis_index(mesh_dim) if isinstance(mesh_dim, str) else mesh_dim
    layout = SequenceLayout(mesh.size(axis), load_balance)
    _check_attention_args(query, key, value, None, 0.0, enable_gqa, layout)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(query, key, value, mesh, axis, layout, bool(is_causal), scale)


# ---------------------------------------------------------------------- SDPA inside the block
_ACTIVE: list[tuple[DeviceMesh, SequenceLayout]] = []


def _ring_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` while a ``context_parallel`` block is active."""
    from shardwise.tensor.dtensor import DTensor

    mesh, layout = _ACTIVE[-1]
    _check_attention_args(query, key, value, attn_mask, dropout_p, enable_gqa, layout)
    scale_ = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if isinstance(query, DTensor):
        return _ring_on_dtensors(query, key, value, mesh, layout, is_causal, scale_)
    return _RingAttention.apply(query, key, value, mesh, 0, layout, bool(is_causal), scale_)


def _ring_on_dtensors(q: Any, k: Any, v: Any, mesh: DeviceMesh, layout: SequenceLayout, causal: bool,
                      scale: float) -> Any:
    """DTensor q/k/v (another mesh, e.g. tp): ring over their local blocks, result in q's layout.

    Their own layout may split batch or heads (every block is then an independent attention)
    but not the sequence or head dims, nor hold pending sums."""
    from shardwise.tensor.dtensor import DTensor
    from shardwise.core.placement import Replicate, Shard

    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, DTensor):
            raise ValueError(f"scaled_dot_product_attention under context_parallel: query is a DTensor but {name} "
                             f"is not; pass all three as DTensors or all as plain tensors")
        for p in t.placements:
            ok = isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % t.ndim < t.ndim - 2)
            if not ok:
                raise ValueError(f"scaled_dot_product_attention under context_parallel: {name} has placements "
                                 f"{tuple(t.placements)}; ring attention needs the sequence and head dims whole on "
                                 f"the DTensor's own mesh (Shard of batch or heads, or Replicate)")
    out = _RingAttention.apply(q.to_local(), k.to_local(), v.to_local(), mesh, 0, layout, causal, scale)
    return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


@contextlib.contextmanager
def _sdpa_as_ring(mesh: DeviceMesh, layout: SequenceLayout) -> Iterator[None]:
    previous = F.scaled_dot_product_attention  # torch's, or an enclosing block's
    _ACTIVE.append((mesh, layout))
    F.scaled_dot_product_attention = _ring_sdpa
    try:
        yield
    finally:
        _ACTIVE.pop()
        F.scaled_dot_product_attention = previous


# ---------------------------------------------------------------------- buffers
def _check_mesh(mesh: Any, where: str) -> None:
    check_mesh(mesh, where)
    if mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"{where}: the mesh must be 1-D (the cp axis, e.g. world_mesh['cp']); got a {mesh.ndim}-D "
                         f"mesh {names}")


def _checked_buffers(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], layout: SequenceLayout,
                     where: str) -> list[int]:
    """Normalized sequence dims; one error naming the buffer before anything changes."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{where}: {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one sequence dim per buffer")
    dims = []
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(buf, torch.Tensor) or type(buf).__name__ == "DTensor":
            raise TypeError(f"{where}: buffers[{i}] must be a plain torch.Tensor, got {type(buf).__name__}")
        if not -buf.ndim <= dim < buf.ndim:
            raise ValueError(f"{where}: buffers[{i}] of shape {tuple(buf.shape)} has no dim {dim}")
        dim %= buf.ndim
        layout.check_length(buf.shape[dim], f"{where}: buffers[{i}] of shape {tuple(buf.shape)}, seq dim {dim}")
        dims.append(dim)
    return dims


def _replace_data(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``buf`` (same object: a module's buffer, a caller's tensor) new contents and shape."""
    with torch.no_grad():
        buf.data = value


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: Sequence[torch.Tensor] = (), seq_dims: Sequence[int] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None, no_restore_buffers: Any = None,
                     load_balance: bool = True) -> Iterator[None]:
    """Inside: ``buffers`` hold this rank's part of their sequence, SDPA runs as ring attention.

    Args:
        mesh: the 1-D cp mesh (``world_mesh["cp"]``); every rank of it runs the block together.
        buffers: plain tensors holding the WHOLE sequence on every rank (inputs, labels, rotary
            tables). Each is cut along its sequence dim and keeps this rank's part, in place.
        seq_dims: the sequence dim of each buffer (``buffer_seq_dims``: torch's name).
        no_restore_buffers: buffers (a set or list, by identity) that keep their part on exit
            (e.g. the labels, consumed by a loss after the block).
        load_balance: deal ``2 * cp`` chunks head-and-tail (even causal work); False: ``cp``
            contiguous chunks. Each buffer's sequence must divide into that many chunks.

    Example:
        >>> with context_parallel(world_mesh["cp"], buffers=[tokens, labels, model.rotary],
        ...                       seq_dims=[1, 1, 0], no_restore_buffers={tokens, labels}):
        ...     loss = loss_fn(model(tokens), labels)
        ...     loss.backward()
    """
    where = "context_parallel"
    _check_mesh(mesh, where)
    if seq_dims is not None and buffer_seq_dims is not None:
        raise TypeError(f"{where}: give seq_dims or buffer_seq_dims (torch's name), not both")
    dims_given = list(seq_dims if seq_dims is not None else buffer_seq_dims if buffer_seq_dims is not None else [])
    buffers = list(buffers)
    layout = SequenceLayout(mesh.size(0), load_balance)
    dims = _checked_buffers(buffers, dims_given, layout, where)
    keep = {id(b) for b in (no_restore_buffers or ())}
    me = mesh.get_local_rank(0)
    originals = [buf.data for buf in buffers]
    for buf, dim in zip(buffers, dims):
        _replace_data(buf, layout.shard(buf.data, dim, me))
    try:
        with _sdpa_as_ring(mesh, layout):
            yield
    finally:
        for buf, whole in zip(buffers, originals):
            if id(buf) not in keep:
                _replace_data(buf, whole)


def context_parallel_unshard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *,
                             load_balance: bool = True) -> list[torch.Tensor]:
    """The whole sequences of buffers that hold this rank's part (as ``context_parallel`` left them).

    One all_gather per buffer over the cp mesh; returns new tensors in sequence order.
    """
    where = "context_parallel_unshard"
    _check_mesh(mesh, where)
    cp = mesh.size(0)
    layout = SequenceLayout(cp, load_balance)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{where}: {len(buffers)} buffers but {len(seq_dims)} seq_dims")
    out = []
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims)):
        dim %= buf.ndim
        per_rank = len(layout.chunks_of(0))
        if buf.shape[dim] % per_rank:
            raise ValueError(f"{where}: buffers[{i}] of shape {tuple(buf.shape)} does not hold {per_rank} equal "
                             f"chunks along dim {dim}")
        gathered = comm.all_gather(buf, mesh, 0, dim, [buf.shape[dim]] * cp)
        out.append(layout.unshard(list(gathered.chunk(cp, dim)), dim))
    return out
