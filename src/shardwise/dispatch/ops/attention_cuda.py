"""Scaled dot-product attention's CUDA kernels: flash, memory-efficient and cuDNN, and their backwards.

On a GPU, ``F.scaled_dot_product_attention`` picks one of three fused kernels instead of the
CPU flash kernel of ``attention.py``; they take the same q/k/v ``[B, H, L, E]`` and differ in
their extra inputs and outputs:

* flash: ``(out, logsumexp [B, H, L], cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
  debug_attn_mask)``; its backward takes the random state back as ``philox_seed/offset``.
* memory-efficient: ``(out, logsumexp [B, H, L rounded up to 32], philox_seed, philox_offset)``
  with an optional ``attn_bias`` (broadcast like the scores, as the CPU mask); its backward
  also returns the bias gradient when asked (``grad_input_mask[3]``).
* cuDNN: like flash with an ``attn_bias``; logsumexp ``[B, H, L, 1]``.

Layouts are the CPU ones: batch or heads sharded on q, k, v alike (every output sharded the
same way, no communication, forward or backward), everything replicated, and for the backward
a pending sum/avg of the upstream gradient passing through. Only the flash kernel also takes
query rows sharded (k/v replicated, no causal mask; dK/dV come out Partial): the others pad
their logsumexp per call, which does not cut into row blocks. The random-state tensors are
replicated scalars; the sequence lengths come back as this rank's ints (the backward gets them
from the same rank's forward). With dropout on, each rank draws its own mask for its heads.

A bias whose dim is broadcast over a sharded one (one ``[L, S]`` bias for all heads) gets a
Partial(sum) gradient: each rank sums the bias gradient over its own heads only.
"""

from __future__ import annotations

from typing import Callable

from shardwise.dispatch.ops._common import R, aten, broadcast_dim
from shardwise.dispatch.ops.attention import _finish, _layout, _scores_shape, attention_handler
from shardwise.dispatch.ops.norm import linear_partial_ops, spec_arguments
from shardwise.dispatch.registry import register_custom_handler
from shardwise.dispatch.strategy import Candidate, OpSchema
from shardwise.core.placement import Partial, Placement, Shard

__all__ = ["cuda_attention_ops"]

_GRAD_OUT = ("grad_out", "grad_out_")
Outputs = Callable[[Placement, int | None], tuple]  # (placement of q's sharded dim, that dim) -> outputs


def _candidates(schema: OpSchema, outs: Outputs, n_out: int, rows: bool, backward: bool) -> list[Candidate]:
    """Batch/heads sharded, query rows sharded (``rows``), replicated, and (``backward``) the
    upstream gradient's pending sum/avg passing through."""
    names = spec_arguments(schema)
    specs = schema.specs
    q = specs[names.index("query")]
    scores = _scores_shape(schema, names)
    axis = [outs(Shard(d), d) + _layout(names, specs, scores, Shard(d), Shard(d), d) for d in range(q.ndim - 2)]
    if rows:
        dim = q.ndim - 2
        axis.append(outs(Shard(dim), dim) + _layout(names, specs, scores, R, Shard(dim), dim))
    axis.append(outs(R, None) + _layout(names, specs, scores, R, R, None))
    if backward:
        grad_out = next(n for n in names if n in _GRAD_OUT)
        for op in linear_partial_ops(specs[names.index(grad_out)]):
            ins = tuple(Partial(op) if n == grad_out else R for n in names)
            axis.insert(0, outs(Partial(op), None) + ins)
    return _finish(schema, names, axis, n_out)


def _causal(schema: OpSchema, index: int) -> bool:
    return bool(schema.arg(index, "is_causal", False))


def _rows_dim(schema: OpSchema) -> int:
    names = spec_arguments(schema)
    return schema.specs[names.index("query")].ndim - 2


def _grad_kv(p: Placement, dim: int | None, rows_dim: int) -> Placement:
    """dK/dV: sharded like q on batch/heads; partial sums when q's rows are cut."""
    return Partial() if dim == rows_dim else p


def _bias_grad(schema: OpSchema, p: Placement, dim: int | None) -> Placement | None:
    """The bias gradient's placement: like the bias input, or Partial where it broadcasts."""
    names = spec_arguments(schema)
    if "attn_bias" not in names:
        return None
    if dim is None or isinstance(p, Partial):
        return p
    bias = schema.specs[names.index("attn_bias")]
    placed = broadcast_dim(bias, _scores_shape(schema, names), dim)
    return Partial() if placed == R else placed


# ---------------------------------------------------------------------- flash
def flash_cuda_forward(schema: OpSchema) -> list[Candidate]:
    debug = bool(schema.arg(5, "return_debug_mask", False))
    outs = lambda p, d: (p, p, None, None, None, None, R, R, p if debug else R)  # noqa: E731
    return _candidates(schema, outs, 9, rows=not _causal(schema, 4), backward=False)


def flash_cuda_backward(schema: OpSchema) -> list[Candidate]:
    rows = _rows_dim(schema)
    outs = lambda p, d: (p, _grad_kv(p, d, rows), _grad_kv(p, d, rows))  # noqa: E731
    return _candidates(schema, outs, 3, rows=not _causal(schema, 11), backward=True)


# ---------------------------------------------------------------------- memory-efficient
def efficient_forward(schema: OpSchema) -> list[Candidate]:
    return _candidates(schema, lambda p, d: (p, p, R, R), 4, rows=False, backward=False)


def efficient_backward(schema: OpSchema) -> list[Candidate]:
    outs = lambda p, d: (p, p, p, _bias_grad(schema, p, d))  # noqa: E731
    return _candidates(schema, outs, 4, rows=False, backward=True)


# ---------------------------------------------------------------------- cuDNN
def cudnn_forward(schema: OpSchema) -> list[Candidate]:
    debug = bool(schema.arg(7, "return_debug_mask", False))
    outs = lambda p, d: (p, p, None, None, None, None, R, R, p if debug else None)  # noqa: E731
    return _candidates(schema, outs, 9, rows=False, backward=False)


def cudnn_backward(schema: OpSchema) -> list[Candidate]:
    return _candidates(schema, lambda p, d: (p, p, p), 3, rows=False, backward=True)


_GRADS = ("query", "key", "value")
_RULES = {
    aten._scaled_dot_product_flash_attention.default: (flash_cuda_forward, ()),
    aten._scaled_dot_product_flash_attention_backward.default: (flash_cuda_backward, _GRADS),
    aten._scaled_dot_product_efficient_attention.default: (efficient_forward, ()),
    aten._scaled_dot_product_efficient_attention_backward.default: (efficient_backward, _GRADS),
    aten._scaled_dot_product_cudnn_attention.default: (cudnn_forward, ()),
    aten._scaled_dot_product_cudnn_attention_backward.default: (cudnn_backward, _GRADS),
}


def cuda_attention_ops() -> list:
    """The CUDA attention kernels this module gives sharding rules for."""
    return list(_RULES)


for _op, (_make, _like) in _RULES.items():
    register_custom_handler(_op)(attention_handler(_make, like=_like))
