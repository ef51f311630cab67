"""Scaled dot-product attention: ``F.scaled_dot_product_attention`` on CPU.

On CPU, SDPA reaches ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward)
unless the mask needs a gradient or dropout is on; then it takes the "math" path, plain
matmuls, views and ``_safe_softmax`` (covered by their own families).

Layouts of q/k/v ``[*batch, H, L, E]`` (k/v ``[*batch, Hkv, S, E]``), out ``[..., L, Ev]``,
logsumexp ``[*batch, H, L]``:

* batch or heads sharded (Shard(0) / Shard(1) on q, k, v alike): every (batch, head) pair is
  an independent attention, so each rank attends its own heads with no communication, forward
  or backward. Grouped-query attention (Hkv < H) shards heads only when the chunks line up:
  Hkv divisible by the number of head shards, so each query head's chunk holds its kv head.
* query rows sharded (q Shard on L, k and v replicated, no causal mask): each query row
  attends the whole sequence on its own; in the backward, dK and dV sum over query rows, so
  they come out Partial(sum). The causal mask depends on global row positions, so not then.
* the key/value sequence and head_dim are never sharded (softmax and the dot products span
  them); the mask broadcasts like an elementwise operand of the ``[*batch, H, L, S]`` scores.
* the backward is linear in the upstream gradient: a pending sum/avg passes through to all
  three gradients when everything else is replicated.

The ops run through a custom handler (choosing among these candidates by cost as the
propagator would) for two reasons: the CPU kernel dies with SIGFPE on zero heads, which an
uneven heads split gives some ranks (their outputs are made directly: empty, or zero partial
gradients); and the gradients are given the strides of q/k/v, so autograd's layout contract
for leaf gradients does not copy them into a freshly allocated (replicated) tensor.
"""

from __future__ import annotations

import math

from typing import Any, Callable

import torch

from shardwise.dispatch import walk
from shardwise.dispatch.cache import PLANS
from shardwise.dispatch.ops._common import R, aten, broadcast_dim, cached_choice, localize, make_spec, meta_of
from shardwise.dispatch.ops.norm import linear_partial_ops, spec_arguments
from shardwise.dispatch.registry import register_custom_handler
from shardwise.dispatch.strategy import Candidate, OpSchema, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.dispatch import tensor_class

__all__ = ["flash_forward", "flash_backward", "attention_handler"]

# Arguments laid out like the query rows; key/value and the mask have their own roles; every
# other tensor argument (the CUDA kernels' random-state scalars, sequence offsets) is replicated.
_ROW_ARGUMENTS = frozenset({"query", "grad_out", "grad_out_", "out", "logsumexp"})
_MASK_ARGUMENTS = frozenset({"attn_mask", "attn_bias"})


def _layout(names: list[str], specs: tuple[DTensorSpec, ...], scores: tuple[int, ...], kv: Placement,
            rows: Placement, dim: int | None) -> tuple:
    """Input placements by argument name: q (and row-shaped tensors) ``rows``, k/v ``kv``,
    the mask broadcast like the scores sharded on ``dim`` (None: replicated)."""
    out = []
    for name, spec in zip(names, specs):
        if name in _MASK_ARGUMENTS:
            out.append(R if dim is None else broadcast_dim(spec, scores, dim))
        elif name in ("key", "value"):
            out.append(kv)
        elif name in _ROW_ARGUMENTS:
            out.append(rows)
        else:
            out.append(R)
    return tuple(out)


def _scores_shape(schema: OpSchema, names: list[str]) -> tuple[int, ...]:
    q, k = (schema.specs[names.index(n)] for n in ("query", "key"))
    return tuple(q.shape[:-1]) + (k.shape[-2],)


def _heads_line_up(schema: OpSchema, names: list[str], candidate: Candidate) -> bool:
    """GQA: the kv heads must split into as many equal chunks as the query heads."""
    q, k = (schema.specs[names.index(n)] for n in ("query", "key"))
    if q.ndim < 3 or q.shape[-3] == k.shape[-3]:
        return True
    heads = q.ndim - 3
    target = candidate.inputs[names.index("key")]
    shards = math.prod(q.mesh.shape[a] for a, p in enumerate(target or ()) if p == Shard(heads))
    return k.shape[-3] % shards == 0


def _finish(schema: OpSchema, names: list[str], axis_candidates: list[tuple], n_out: int) -> list[Candidate]:
    candidates = expand(axis_candidates, n_out, schema.mesh.ndim)
    return [c for c in candidates if _heads_line_up(schema, names, c)]


def _flash_axis(schema: OpSchema, names: list[str], causal: bool, outs: Callable[[Placement], tuple],
                query_rows: tuple) -> list[tuple]:
    """Per-axis layouts shared by the flash kernels: batch dims or heads sharded (every output
    alike, ``outs(Shard(d))``), query rows sharded unless causal (outputs ``query_rows``), or
    everything replicated."""
    specs = schema.specs
    q = specs[names.index("query")]
    scores = _scores_shape(schema, names)
    axis = [outs(Shard(d)) + _layout(names, specs, scores, Shard(d), Shard(d), d) for d in range(q.ndim - 2)]
    if not causal:
        rows = q.ndim - 2
        axis.append(query_rows + _layout(names, specs, scores, R, Shard(rows), rows))
    axis.append(outs(R) + _layout(names, specs, scores, R, R, None))
    return axis


def flash_forward(schema: OpSchema) -> list[Candidate]:
    """(out, logsumexp) from (query, key, value, attn_mask?)."""
    names = spec_arguments(schema)
    rows = Shard(schema.specs[names.index("query")].ndim - 2)
    axis = _flash_axis(schema, names, bool(schema.arg(4, "is_causal", False)), lambda p: (p, p), (rows, rows))
    return _finish(schema, names, axis, 2)


def flash_backward(schema: OpSchema) -> list[Candidate]:
    """(grad_query, grad_key, grad_value) from (grad_out, query, key, value, out, logsumexp, attn_mask?).

    With the query rows sharded, each rank's rows touch every key: grad_key / grad_value are
    partial sums over the row blocks."""
    names = spec_arguments(schema)
    specs = schema.specs
    rows = Shard(specs[names.index("query")].ndim - 2)
    axis = _flash_axis(schema, names, bool(schema.arg(7, "is_causal", False)), lambda p: (p,) * 3,
                       (rows, Partial(), Partial()))
    for op in linear_partial_ops(specs[names.index("grad_out")]):
        ins = tuple(Partial(op) if n == "grad_out" else R for n in names)
        axis.insert(0, (Partial(op),) * 3 + ins)
    return _finish(schema, names, axis, 3)


# ---------------------------------------------------------------------- running the kernels
def _schema_of(op: Any, args: tuple, kwargs: dict) -> tuple[OpSchema, list[Any]]:
    """The call as the propagator sees it (specs in place of DTensors), and its DTensors."""
    DTensor = tensor_class.DTensor
    found = walk.labelled(args, kwargs)
    plain = [where for where, v in found if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]
    if plain:
        raise ValueError(f"{op}: argument {plain[0]} is a plain tensor mixed with DTensors; make it a DTensor")
    dtensors = [v for _, v in found if isinstance(v, DTensor)]
    # Lists (a flag list, grad_input_mask) become tuples: hashable, for the plan cache.
    return OpSchema(op, *walk.spec_tree(args, kwargs, DTensor), tuple(d._spec for d in dtensors)), dtensors


def _output_specs(schema: OpSchema, plan: Candidate, like: tuple[str, ...]) -> list[DTensorSpec]:
    """Output specs from the op's meta outputs; ``like`` names inputs whose strides they take."""
    metas = schema.op(*map(meta_of, schema.args), **{k: meta_of(v) for k, v in schema.kwargs})
    specs = [make_spec(schema.mesh, p, m) if isinstance(m, torch.Tensor) else m for p, m in zip(plan.outputs, metas)]
    names = spec_arguments(schema)
    for i, name in enumerate(like):
        source = schema.specs[names.index(name)].tensor_meta
        meta = specs[i].tensor_meta
        if tuple(source.shape) == tuple(meta.shape):
            specs[i] = DTensorSpec(schema.mesh, specs[i].placements, TensorMeta(meta.shape, source.stride, meta.dtype))
    return specs


def attention_handler(make: Callable[[OpSchema], list[Candidate]], like: tuple[str, ...] = ()) -> Callable:
    """A custom handler running an attention kernel on the local blocks of the cheapest
    candidate of ``make``. Outputs that are not tensors (None, the CUDA kernels' sequence
    lengths) are passed through from the local kernel; tensor outputs become DTensors."""

    def handler(op: Any, args: tuple, kwargs: dict) -> tuple:
        DTensor = tensor_class.DTensor
        schema, dtensors = _schema_of(op, args, kwargs)
        key = (op, schema.args, schema.kwargs)
        plan = cached_choice(key, schema, lambda: make(schema))
        specs = PLANS.memo(("attention specs", key), lambda: _output_specs(schema, plan, like))
        blocks = localize(dtensors, plan)
        if any(b.numel() == 0 for b in blocks):  # the kernel cannot take empty heads
            outs = [torch.zeros(s.local_shape(), dtype=s.dtype, device=blocks[0].device)
                    if isinstance(s, DTensorSpec) else s for s in specs]
        else:
            it = iter(blocks)
            local_args, local_kwargs = walk.map_leaves(lambda v: next(it) if isinstance(v, DTensor) else v,
                                                       (args, kwargs))
            outs = op(*local_args, **local_kwargs)
        return tuple(DTensor(o, s, requires_grad=False) if isinstance(s, DTensorSpec) and o is not None else o
                     for o, s in zip(outs, specs))

    return handler


register_custom_handler(aten._scaled_dot_product_flash_attention_for_cpu.default)(attention_handler(flash_forward))
register_custom_handler(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(
    attention_handler(flash_backward, like=("query", "key", "value")))
