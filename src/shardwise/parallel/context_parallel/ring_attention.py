"""Ring attention math: one rank's query rows against key/value blocks that arrive one at a time.

Pure (no processes): ``context.py`` moves the blocks around the cp ring and calls these.

Attention over a sequence cut into blocks is exact when each block's partial result is kept
with the log-sum-exp of its scores: for query row i, a block b gives ``out_b = softmax(s_b) v_b``
and ``lse_b = logsumexp(s_b)``; two blocks merge into

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is the softmax over both blocks' scores. The backward needs no merge: with the final
``out`` and ``lse`` of each row, every block's probabilities are ``exp(s_b - lse)`` and its
gradient contributions are independent (``block_backward``).

Layout (``SequenceLayout``): the sequence is cut into chunks and each rank holds some of them,
in order. Plain: ``cp`` chunks, rank i holds chunk i. Balanced (for causal attention): ``2*cp``
chunks, rank i holds chunks i and ``2*cp-1-i``, so under the causal mask every rank does the
same work (an early chunk sees few keys, its partner late chunk many). The causal mask is
decided per pair of chunks: an earlier key chunk is attended whole, the same chunk with the
diagonal mask, a later one not at all.

Shapes follow ``F.scaled_dot_product_attention``: q ``[*batch, H, L, E]``, k ``[*batch, Hkv, S, E]``,
v ``[*batch, Hkv, S, Ev]``, with ``H`` a multiple of ``Hkv`` (grouped-query attention: query
head h uses kv head ``h // (H / Hkv)``).

Each block runs on torch's fused CPU attention kernel when it can (CPU tensors, 4-D, not
empty): about 2.5x faster than the plain matmul formulation, which stays for other devices
and as the reference (``kernel=False``). The kernel needs as many kv heads as query heads, so
grouped k/v blocks are expanded for it (one block at a time) and their gradients summed back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["SequenceLayout", "Mask", "chunk_pairs", "block_forward", "block_backward", "merge",
           "accumulation_dtype", "ring_reference"]


class Mask(Enum):
    """How a query chunk sees a key chunk."""

    FULL = "full"  # every key (non-causal, or an earlier key chunk)
    DIAGONAL = "diagonal"  # the same chunk under the causal mask: key j <= query i


@dataclass(frozen=True, slots=True)
class SequenceLayout:
    """How a sequence is dealt to the ``cp`` ranks of the ring (see the module docstring).

    Example:
        >>> SequenceLayout(2, balanced=True).chunks_of(0)
        (0, 3)
    """

    cp: int
    balanced: bool = True

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.balanced else self.cp

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices rank ``rank`` holds, in the order it stores them."""
        if self.balanced:
            return (rank, 2 * self.cp - 1 - rank)
        return (rank,)

    def check_length(self, length: int, what: str) -> None:
        """Refuse a sequence length the layout cannot cut evenly (``what`` names the tensor)."""
        if length % self.n_chunks:
            kind = f"2 * cp = {self.n_chunks} chunks (load-balanced layout)" if self.balanced else f"cp = {self.cp} chunks"
            raise ValueError(f"{what}: sequence length {length} does not divide into {kind}")

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the whole sequence ``x`` along ``dim`` (a new tensor)."""
        chunks = x.chunk(self.n_chunks, dim)
        return torch.cat([chunks[c] for c in self.chunks_of(rank)], dim)

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole sequence from every rank's part (rank order), inverse of ``shard``."""
        chunks: list[torch.Tensor | None] = [None] * self.n_chunks
        for rank, part in enumerate(parts):
            for piece, c in zip(part.chunk(len(self.chunks_of(rank)), dim), self.chunks_of(rank)):
                chunks[c] = piece
        return torch.cat(chunks, dim)  # type: ignore[arg-type]

    def positions(self, length: int, rank: int) -> torch.Tensor:
        """Global positions of rank ``rank``'s rows of a sequence of ``length``."""
        return self.shard(torch.arange(length), 0, rank)


def chunk_pairs(layout: SequenceLayout, q_rank: int, kv_rank: int, causal: bool) -> list[tuple[int, int, Mask]]:
    """(local query chunk, local key chunk, mask) for the chunks ``q_rank`` holds against those of
    ``kv_rank``; pairs the causal mask hides entirely are left out."""
    pairs = []
    for i, qc in enumerate(layout.chunks_of(q_rank)):
        for j, kc in enumerate(layout.chunks_of(kv_rank)):
            if not causal or kc < qc:
                pairs.append((i, j, Mask.FULL))
            elif kc == qc:
                pairs.append((i, j, Mask.DIAGONAL))
    return pairs


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, log-sum-exps and gradients accumulate in at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[*b, H, L, E] -> [*b, Hkv, H/Hkv, L, E]``: query heads grouped by the kv head they use."""
    return q.unflatten(-3, (kv_heads, q.shape[-3] // kv_heads))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: Mask) -> torch.Tensor:
    """Scaled scores ``[*b, Hkv, rep, L, S]`` (accumulation dtype), -inf where masked."""
    dtype = accumulation_dtype(q.dtype)
    s = torch.matmul(_grouped(q, k.shape[-3]).to(dtype), k.to(dtype).unsqueeze(-3).transpose(-1, -2)) * scale
    if mask is Mask.DIAGONAL:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


_CPU_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_KERNEL_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU kernel can run this block: 4-D CPU (or meta: a simulated step) tensors, not empty (it fails on
    empty heads), value head size equal to the query's."""
    return (_CPU_KERNEL is not None and q.device.type in ("cpu", "meta") and q.ndim == 4 and q.numel() > 0
            and k.numel() > 0 and v.shape[-1] == q.shape[-1])


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _folded(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients of expanded k/v heads summed back onto the kv heads."""
    return grad if grad.shape[-3] == kv_heads else grad.unflatten(-3, (kv_heads, -1)).sum(-3)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: Mask, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[*b, H, L, Ev]``, lse ``[*b, H, L]``) of ``q`` against one key/value block, in the
    accumulation dtype; the diagonal mask needs L == S. ``kernel``: None picks (``kernel_applies``)."""
    dtype = accumulation_dtype(q.dtype)
    if kernel_applies(q, k, v) if kernel is None else kernel:
        heads = q.shape[-3]
        out, lse = _CPU_KERNEL(q, _expanded(k, heads), _expanded(v, heads), 0.0, mask is Mask.DIAGONAL, scale=scale)
        return out.to(dtype), lse.to(dtype)
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.to(s.dtype).unsqueeze(-3))
    return out.flatten(-4, -3), lse.flatten(-3, -2)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine a running (out, lse) with one block's; ``None`` means nothing attended yet."""
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return new_out, new_lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, mask: Mask,
                   kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) contributed by one key/value block, in the accumulation dtype.

    ``out`` and ``lse`` are the FINAL output (in q's dtype) and log-sum-exp of each query row
    (over every block), ``delta`` the row sums of ``dout * out``: then this block's
    probabilities are ``exp(s - lse)`` and ``ds = p * (dp - delta)`` is its part of the softmax
    gradient (the kernel computes ``delta`` itself from ``out``).
    """
    kv_heads = k.shape[-3]
    dtype = accumulation_dtype(q.dtype)
    if kernel_applies(q, k, v) if kernel is None else kernel:
        heads = q.shape[-3]
        dq, dk, dv = _CPU_KERNEL_BACKWARD(dout.to(q.dtype), q, _expanded(k, heads), _expanded(v, heads), out.to(q.dtype),
                                          lse.to(dtype), 0.0, mask is Mask.DIAGONAL, scale=scale)
        return dq.to(dtype), _folded(dk, kv_heads).to(dtype), _folded(dv, kv_heads).to(dtype)
    s = _scores(q, k, scale, mask)
    rows = (kv_heads, lse.shape[-2] // kv_heads)  # lse and delta: [*b, H, L] -> [*b, Hkv, rep, L, 1]
    p = torch.exp(s - lse.unflatten(-2, rows).unsqueeze(-1))  # [*b, Hkv, rep, L, S]
    dtype = s.dtype
    do = _grouped(dout.to(dtype), kv_heads)  # [*b, Hkv, rep, L, Ev]
    vg = v.to(dtype).unsqueeze(-3)
    kg = k.to(dtype).unsqueeze(-3)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(-3)
    dp = torch.matmul(do, vg.transpose(-1, -2))
    ds = p * (dp - delta.unflatten(-2, rows).unsqueeze(-1))
    dq = (torch.matmul(ds, kg) * scale).flatten(-4, -3)
    dk = (torch.matmul(ds.transpose(-1, -2), _grouped(q.to(dtype), kv_heads)) * scale).sum(-3)
    return dq, dk, dv


def ring_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, causal: bool,
                   scale: float, kernel: bool | None = None) -> torch.Tensor:
    """The whole ring in one process: shard the sequence, let every rank attend every block in
    ring order with ``chunk_pairs`` / ``block_forward`` / ``merge``, and put the rows back.

    For testing the math without processes; equals ``F.scaled_dot_product_attention``.
    """
    outs = []
    for rank in range(layout.cp):
        q_local = layout.shard(q, -2, rank)
        q_chunks = q_local.chunk(len(layout.chunks_of(rank)), -2)
        acc: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * len(q_chunks)
        for step in range(layout.cp):
            src = (rank - step) % layout.cp
            k_chunks = layout.shard(k, -2, src).chunk(len(layout.chunks_of(src)), -2)
            v_chunks = layout.shard(v, -2, src).chunk(len(layout.chunks_of(src)), -2)
            for i, j, mask in chunk_pairs(layout, rank, src, causal):
                acc[i] = merge(*acc[i], *block_forward(q_chunks[i], k_chunks[j], v_chunks[j], scale, mask, kernel))
        outs.append(torch.cat([o for o, _ in acc], -2).to(q.dtype))  # type: ignore[misc]
    return layout.unshard(outs, -2)
