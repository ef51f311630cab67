"""Normalizations: softmax / log_softmax, layer_norm, rms_norm, group_norm, and their backward ops.

They all normalize each "row" over some dims using statistics of the whole row, so:

* the normalized dims must be whole (replicated on every mesh axis) — a block of a row would
  be normalized with the block's statistics (softmax over a sharded dim is the exception,
  handled before these strategies by ``vocab_parallel.py``: the row statistics are
  all-reduced);
* every other dim (batch, sequence, the non-softmax dims) may stay sharded: rows are
  independent, so each rank normalizes its own rows without communication;
* parameters (weight, bias) are replicated; their gradients sum over the rows, so with the
  rows sharded on an axis each rank holds a part of the sum: ``Partial(sum)``, which is exact
  and costs nothing until the gradient is read;
* Partial inputs are reduced first (normalization is not linear), except the upstream
  gradient of a backward op: the backward formulas are linear in it, so a pending sum/avg
  passes through to every gradient when the saved activations are replicated.

``F.rms_norm`` on CPU decomposes above dispatch into pow/mean/rsqrt/mul (pointwise and
reduction ops); the fused ``_fused_rms_norm`` kernels are covered here too for backends that
reach them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, count_specs, expand
from shardwise.core.placement import Partial, Shard
from shardwise.core.spec import DTensorSpec

__all__ = ["spec_arguments", "linear_partial_ops", "softmax_candidates", "norm_candidates"]


def spec_arguments(schema: OpSchema) -> list[str]:
    """The schema argument name of every DTensor input, in ``schema.specs`` order.

    The dispatcher flattens positional arguments first, then keyword arguments in call order;
    this follows the same order so roles ("grad_out", "weight", ...) can be given by name.
    """
    arguments = schema.op._schema.arguments
    names: list[str] = []
    for index, value in enumerate(schema.args):
        names += [arguments[index].name] * count_specs(value)
    for name, value in schema.kwargs:
        names += [name] * count_specs(value)
    return names


def linear_partial_ops(spec: DTensorSpec) -> list[str]:
    """Pending reductions of ``spec`` that a function linear in it commutes with (sum, avg)."""
    ops = [p.reduce_op for p in spec.placements if isinstance(p, Partial) and p.reduce_op in ("sum", "avg")]
    return list(dict.fromkeys(ops))


# ---------------------------------------------------------------------- softmax
def softmax_candidates(ndim: int, dim: int, n_inputs: int) -> list[AxisCandidate]:
    """Output and inputs sharded alike on any dim but ``dim``, or all replicated."""
    dim = dim % max(ndim, 1)
    candidates: list[AxisCandidate] = [(Shard(d),) * (1 + n_inputs) for d in range(ndim) if d != dim]
    candidates.append((R,) * (1 + n_inputs))
    return candidates


@register_strategy(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_forward(schema: OpSchema) -> list[AxisCandidate]:
    spec = schema.specs[0]
    return softmax_candidates(spec.ndim, schema.arg(1, "dim"), len(schema.specs))


@register_strategy(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(schema: OpSchema) -> list[AxisCandidate]:
    """(grad_output, output): sharded alike off ``dim``; a Partial grad_output passes through."""
    grad, out = schema.specs
    candidates = softmax_candidates(out.ndim, schema.arg(2, "dim"), 2)
    for op in linear_partial_ops(grad):
        candidates.insert(0, (Partial(op), Partial(op), R))
    return candidates


# ---------------------------------------------------------------------- layer_norm / rms_norm
_BATCH_ARGS = {"input", "grad_out", "mean", "rstd"}


def norm_candidates(
    schema: OpSchema, n_batch_dims: int, outputs: Sequence[str], grad_arg: str | None = None
) -> list[AxisCandidate]:
    """Per-axis layouts of a norm op over its trailing dims.

    ``outputs`` names each output's role: "batch" (shaped like the input's rows: sharded with
    them) or "param" (a parameter gradient: a sum over rows, so Partial when rows are sharded).
    Inputs take their role from the argument name (``_BATCH_ARGS`` are row-shaped, the rest are
    parameters). ``grad_arg``: the upstream gradient of a backward op, allowed to be Partial.
    """
    names = spec_arguments(schema)
    batch = [n in _BATCH_ARGS for n in names]
    candidates: list[AxisCandidate] = []
    for d in range(n_batch_dims):
        outs = tuple(Shard(d) if role == "batch" else Partial() for role in outputs)
        candidates.append(outs + tuple(Shard(d) if b else R for b in batch))
    candidates.append((R,) * (len(outputs) + len(names)))
    if grad_arg is not None and grad_arg in names:
        grad = schema.specs[names.index(grad_arg)]
        for op in linear_partial_ops(grad):
            ins = tuple(Partial(op) if n == grad_arg else R for n in names)
            candidates.insert(0, (Partial(op),) * len(outputs) + ins)
    return candidates


def _batch_ndim(schema: OpSchema, normalized_shape: Sequence[int]) -> int:
    names = spec_arguments(schema)
    spec = schema.specs[names.index("input")]
    return spec.ndim - len(normalized_shape)


@register_strategy(aten.native_layer_norm.default)
def layer_norm_forward(schema: OpSchema) -> list[AxisCandidate]:
    """(out, mean, rstd) from (input, weight?, bias?)."""
    n = _batch_ndim(schema, schema.arg(1, "normalized_shape"))
    return norm_candidates(schema, n, ("batch", "batch", "batch"))


@register_strategy(aten.native_layer_norm_backward.default)
def layer_norm_backward(schema: OpSchema) -> list[AxisCandidate]:
    """(grad_input, grad_weight, grad_bias) from (grad_out, input, mean, rstd, weight?, bias?)."""
    n = _batch_ndim(schema, schema.arg(2, "normalized_shape"))
    return norm_candidates(schema, n, ("batch", "param", "param"), grad_arg="grad_out")


@register_strategy(aten._fused_rms_norm.default)
def rms_norm_forward(schema: OpSchema) -> list[AxisCandidate]:
    """(out, rstd) from (input, weight?)."""
    n = _batch_ndim(schema, schema.arg(1, "normalized_shape"))
    return norm_candidates(schema, n, ("batch", "batch"))


@register_strategy(aten._fused_rms_norm_backward.default)
def rms_norm_backward(schema: OpSchema) -> list[AxisCandidate]:
    """(grad_input, grad_weight) from (grad_out, input, rstd, weight?)."""
    n = _batch_ndim(schema, schema.arg(2, "normalized_shape"))
    return norm_candidates(schema, n, ("batch", "param"), grad_arg="grad_out")


# ---------------------------------------------------------------------- group_norm
# native_group_norm(input (N, C, *), weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)
# with mean / rstd of shape (N, group). Groups span channels and every spatial position, so
# only the samples (dim 0) may stay sharded; ``N`` is an argument and becomes the local count.
def _local_samples(position: int, input_position: int) -> Callable:
    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        args = list(args)
        args[position] = args[input_position].shape[0]
        return args, kwargs

    return rewrite


def _group_norm_candidates(schema: OpSchema, outputs: Sequence[str], grad_arg: str | None,
                           position: int) -> list[Candidate]:
    axis = norm_candidates(schema, 1, outputs, grad_arg=grad_arg)
    rewrite = _local_samples(position, 0 if grad_arg is None else 1)
    return [replace(c, rewrite=rewrite) for c in expand(axis, len(outputs), schema.mesh.ndim)]


@register_strategy(aten.native_group_norm.default, per_axis=False)
def group_norm_forward(schema: OpSchema) -> list[Candidate]:
    """(out, mean, rstd) from (input, weight?, bias?): samples sharded, or everything whole."""
    return _group_norm_candidates(schema, ("batch", "batch", "batch"), None, 3)


@register_strategy(aten.native_group_norm_backward.default, per_axis=False)
def group_norm_backward(schema: OpSchema) -> list[Candidate]:
    """(grad_input, grad_weight, grad_bias) from (grad_out, input, mean, rstd, weight?)."""
    return _group_norm_candidates(schema, ("batch", "param", "param"), "grad_out", 5)
