"""Convolutions: ``aten.convolution`` and ``aten.convolution_backward``.

Forward, per mesh axis (output; input, weight, bias):

    batch        S(0)     ; S(0), R, R        each rank convolves its samples
    out-channel  S(1)     ; R, W_out, S(0)    (groups == 1) each rank owns some filters
    in-channel   Partial  ; S(1), W_in, P     (groups == 1) each rank sums over its channels
    linear       P        ; P, R, P  or  R, P, P   (sum, avg; convolution is bilinear)
    replicated   R        ; R, R, R

``W_out`` / ``W_in`` are the weight's output / input channel dims: 0 / 1, swapped for
transposed convolutions. Spatial dims are never sharded (a halo exchange would be needed).
The in-channel layout is dropped on an axis where input and weight would both have to move
(see ``matmul``: gathering one is cheaper than reshuffling both and reducing the output).
Channel layouts are also dropped when some rank's block of channels would be empty (few
channels over many ranks): torch's convolution rejects zero filters and returns the wrong
shape for zero input channels, so those shapes gather instead.

Backward, per mesh axis (grad input, grad weight, grad bias; grad output, input, weight):

    batch        S(0), P, P          ; S(0), S(0), R   the weight gradient sums over samples
    out-channel  P, W_out, S(0)      ; S(1), R, W_out
    in-channel   S(1), W_in, R       ; R, S(1), W_in
    linear       P, P, P             ; P, R, R
    replicated   R, R, R             ; R, R, R

The Partial weight gradient of a batch-sharded convolution is reduced later, where the
parameter's layout asks for it (reduce_scatter for a sharded one, all_reduce for a replicated).
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.ops.matmul import AxisRow, axis_product, linear_partial_ops, moves_data, tensor_roles
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import Candidate, OpSchema
from shardwise.core.placement import Partial, Shard
from shardwise.core.spec import DTensorSpec, local_shape_and_offset

__all__ = ["convolution_rows", "convolution_backward_rows"]


def _channel_dims(transposed: bool) -> tuple[Shard, Shard]:
    """(output-channel, input-channel) dims of the weight."""
    return (Shard(1), Shard(0)) if transposed else (Shard(0), Shard(1))


def convolution_rows(specs: dict, axis: int, transposed: bool, groups: int) -> list[AxisRow]:
    """Per-axis layouts of the forward (roles: input, weight, bias)."""
    x, w = specs["input"], specs["weight"]
    rows: list[AxisRow] = [((Shard(0),), {"input": Shard(0), "weight": R, "bias": R})]
    if groups == 1:
        w_out, w_in = _channel_dims(transposed)
        rows.append(((Shard(1),), {"input": R, "weight": w_out, "bias": Shard(0)}))
        if not (moves_data(x, axis, Shard(1)) and moves_data(w, axis, w_in)):
            rows.append(((Partial(),), {"input": Shard(1), "weight": w_in, "bias": Partial()}))
    for op in linear_partial_ops(tuple(specs.values()), axis):
        p = Partial(op)
        rows.append(((p,), {"input": p, "weight": R, "bias": p}))
        rows.append(((p,), {"input": R, "weight": p, "bias": p}))
    rows.append(((R,), {"input": R, "weight": R, "bias": R}))
    return rows


def convolution_backward_rows(specs: dict, axis: int, transposed: bool, groups: int) -> list[AxisRow]:
    """Per-axis layouts of the backward (roles: grad, input, weight)."""
    g, x, w = specs["grad"], specs["input"], specs["weight"]
    rows: list[AxisRow] = []
    if not (moves_data(g, axis, Shard(0)) and moves_data(x, axis, Shard(0))):
        rows.append(((Shard(0), Partial(), Partial()), {"grad": Shard(0), "input": Shard(0), "weight": R}))
    if groups == 1:
        w_out, w_in = _channel_dims(transposed)
        if not (moves_data(g, axis, Shard(1)) and moves_data(w, axis, w_out)):
            rows.append(((Partial(), w_out, Shard(0)), {"grad": Shard(1), "input": R, "weight": w_out}))
        rows.append(((Shard(1), w_in, R), {"grad": R, "input": Shard(1), "weight": w_in}))
    for op in linear_partial_ops((g,), axis):
        p = Partial(op)
        rows.append(((p, p, p), {"grad": p, "input": R, "weight": R}))
    rows.append(((R, R, R), {"grad": R, "input": R, "weight": R}))
    return rows


@register_strategy(aten.convolution.default, per_axis=False)
def convolution_candidates(schema: OpSchema) -> list[Candidate]:
    """``convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``."""
    roles = tensor_roles(schema, ("input", "weight", "bias"))
    specs = dict(roles)
    specs.setdefault("input", None)
    specs.setdefault("weight", None)
    transposed, groups = bool(schema.arg(6, "transposed")), schema.arg(8, "groups")
    candidates = axis_product(roles, lambda axis: convolution_rows(specs, axis, transposed, groups), schema.mesh.ndim)
    return _without_empty_channel_blocks(candidates, roles)


@register_strategy(aten.convolution_backward.default, per_axis=False)
def convolution_backward_candidates(schema: OpSchema) -> list[Candidate]:
    """``convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask)``."""
    roles = tensor_roles(schema, ("grad", "input", "weight"))
    specs = {"grad": None, "input": None, "weight": None, **dict(roles)}
    transposed, groups = bool(schema.arg(7, "transposed")), schema.arg(9, "groups")
    candidates = axis_product(
        roles,
        lambda axis: convolution_backward_rows(specs, axis, transposed, groups),
        schema.mesh.ndim,
        rewrite=_local_bias_sizes,
    )
    return _without_empty_channel_blocks(candidates, roles)


def _without_empty_channel_blocks(candidates: list[Candidate], roles: list) -> list[Candidate]:
    """Candidates under which every rank holds at least one filter and one input channel."""
    names = [name for name, _ in roles]
    if "weight" not in names:
        return candidates
    index = names.index("weight")
    weight = roles[index][1]
    return [c for c in candidates if c.inputs[index] is None or _channels_everywhere(weight, c.inputs[index])]


def _channels_everywhere(weight: DTensorSpec, placements: tuple) -> bool:
    """No rank's block of ``weight`` laid out as ``placements`` is empty on a channel dim."""
    if not any(p.is_shard(0) or p.is_shard(1) for p in placements):
        return True
    return _no_empty_block(tuple(weight.shape), tuple(weight.mesh.shape), tuple(placements))


@lru_cache(maxsize=4096)
def _no_empty_block(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> bool:
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        block, _ = local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        if block[0] == 0 or block[1] == 0:
            return False
    return True


def _local_bias_sizes(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
    """``bias_sizes`` is the bias's shape: with filters sharded, the local one is smaller."""
    args = list(args)
    if len(args) > 9 and args[3] is not None:
        weight, transposed, groups = args[2], args[7], args[9]
        args[3] = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return args, kwargs
