"""Pooling, unpooling, upsampling and patch extraction over the trailing spatial dims.

Input ``(N, C, *spatial)`` (or ``(C, *spatial)`` unbatched): a window never crosses samples or
channels, so N and C may stay sharded and each rank pools its own planes; the spatial dims must
be whole (a window across a block boundary would need a halo exchange). Average pooling and
every backward here are linear in their first input, so a pending sum / average passes.

Kernels accept an empty batch but not an empty channel dim: a layout giving some rank no
channels (few channels over many ranks, uneven shards) is not offered; that rank would raise
alone. The backward of an upsampling takes the input's GLOBAL size as an argument: it is
rewritten to the local block's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.ops.core_dims import batch_axis_candidates, without_empty_blocks
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand

__all__ = ["spatial_candidates"]


def spatial_candidates(schema: OpSchema, spatial: int, *, linear: bool, n_out: int, channels: int = 1) -> list[Candidate]:
    """Every layout keeping the trailing ``spatial`` dims whole and no rank without channels.

    ``channels``: dims between the batch dim and the whole ones (a batched input has
    ``spatial + channels + 1`` dims; its batch dim alone may be empty on a rank).
    """
    spec = schema.specs[0]
    axis: list[AxisCandidate] = batch_axis_candidates(schema, [spatial] * len(schema.specs), linear_in=0 if linear else None)
    allowed = {0} if spec.ndim == spatial + channels + 1 else set()
    return without_empty_blocks(schema, expand(axis, n_out, spec.mesh.ndim), allowed)


def _outputs(op: Any) -> int:
    return sum("Tensor" in str(r.type) for r in op._schema.returns)


def _register(spatial: int, linear: bool, *ops: Any, channels: int = 1) -> None:
    def strategy(schema: OpSchema) -> list[Candidate]:
        return spatial_candidates(schema, spatial, linear=linear, n_out=_outputs(schema.op), channels=channels)

    strategy.__name__ = strategy.__qualname__ = f"pool{spatial}d_{'linear' if linear else 'strategy'}"
    register_strategy(*ops, per_axis=False)(strategy)


# Forward ops that pick values (max) are not linear; averages and every backward are.
_register(2, False, aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default,
          aten.max_unpool2d.default)
_register(3, False, aten.max_pool3d_with_indices.default, aten.adaptive_max_pool3d.default,
          aten.max_unpool3d.default)
_register(2, True, aten.avg_pool2d.default, aten.avg_pool2d_backward.default,
          aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
          aten.max_pool2d_with_indices_backward.default, aten.adaptive_max_pool2d_backward.default,
          aten.max_pool2d_backward.default)
_register(3, True, aten.avg_pool3d.default, aten.avg_pool3d_backward.default,
          aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default,
          aten.max_pool3d_with_indices_backward.default, aten.adaptive_max_pool3d_backward.default)
# unfold / fold: (N, C, H, W) <-> (N, C * kernel, L): only N is free.
_register(3, False, aten.im2col.default, channels=0)
_register(2, True, aten.col2im.default, channels=0)
_register(1, True, aten.upsample_nearest1d.default, aten._upsample_nearest_exact1d.default, aten.upsample_linear1d.default)
_register(2, True, aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default,
          aten.upsample_bilinear2d.default, aten.upsample_bicubic2d.default,
          aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default)
_register(3, True, aten.upsample_nearest3d.default, aten._upsample_nearest_exact3d.default,
          aten.upsample_trilinear3d.default)


# ---------------------------------------------------------------------- upsampling backward
def _local_input_size(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
    """``input_size`` (argument 2) is the gradient's global shape: use this rank's block."""
    args = list(args)
    args[2] = list(output_specs[0].local_shape())
    return args, kwargs


def _upsample_backward(spatial: int) -> Any:
    def strategy(schema: OpSchema) -> list[Candidate]:
        candidates = spatial_candidates(schema, spatial, linear=True, n_out=1)
        return [replace(c, rewrite=_local_input_size) for c in candidates]

    return strategy


register_strategy(aten.upsample_nearest1d_backward.default, aten._upsample_nearest_exact1d_backward.default,
                  aten.upsample_linear1d_backward.default, per_axis=False)(_upsample_backward(1))
register_strategy(aten.upsample_nearest2d_backward.default, aten._upsample_nearest_exact2d_backward.default,
                  aten.upsample_bilinear2d_backward.default, aten.upsample_bicubic2d_backward.default,
                  aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa_backward.default,
                  per_axis=False)(_upsample_backward(2))
register_strategy(aten.upsample_nearest3d_backward.default, aten._upsample_nearest_exact3d_backward.default,
                  aten.upsample_trilinear3d_backward.default, per_axis=False)(_upsample_backward(3))
