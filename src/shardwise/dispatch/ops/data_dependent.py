"""Ops whose output shape depends on the input values: ``nonzero``, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` with a tensor of repeats, and ops without a
meta kernel (``linalg.lstsq``, ``geqrf``, ``histogram``, ``histogramdd``).

The layout propagation runs ops on meta tensors of the global shapes, which cannot tell how
many elements such an op returns. These ops therefore gather their inputs (every DTensor input
becomes Replicate: one all_gather, or an all_reduce for a Partial), run on the whole tensors,
and return Replicate results: every rank computes the same values, so the shapes agree without
any further communication. A sharded result would need the ranks to agree on sizes first (one
more collective) and would rarely pay off for these mostly small, index-like outputs.

A plain boolean mask given to ``masked_select`` / ``masked_scatter`` is taken as replicated, as
plain indices are (``registry.allow_plain_indices``).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.dispatch import walk
from shardwise.dispatch.ops._common import R, aten, local_block
from shardwise.dispatch.registry import allow_plain_indices, register_custom_handler
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.dispatch import tensor_class

__all__ = ["run_replicated"]

_DATA_DEPENDENT = [
    aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.unique_dim_consecutive.default,
    aten.bincount.default, aten.repeat_interleave.Tensor,
    # no meta kernel: the output shapes cannot be computed without running the op
    aten.linalg_lstsq.default, aten.geqrf.default, aten.histogram.bin_ct, aten.histogram.bins_tensor,
    aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
    aten._histogramdd_from_bin_tensors.default, aten._ctc_loss.Tensor, aten._ctc_loss_backward.Tensor,
]


def _dtensor_type() -> type:
    DTensor = tensor_class.DTensor
    return DTensor


def run_replicated(op: Any, args: tuple, kwargs: dict) -> Any:
    """Gather every DTensor argument, run ``op`` on the whole tensors, return Replicate DTensors."""
    DTensor = _dtensor_type()
    dtensors = walk.dtensors(args, kwargs, DTensor)
    mesh = dtensors[0].device_mesh
    whole = (R,) * mesh.ndim

    def local(value: Any) -> Any:
        return local_block(value, whole) if isinstance(value, DTensor) else value

    local_args, local_kwargs = walk.map_leaves(local, (args, kwargs))
    out = op(*local_args, **local_kwargs)

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return DTensor(value, DTensorSpec(mesh, whole, TensorMeta.of(value)), requires_grad=False)
        return value

    return walk.map_leaves(wrap, out)


register_custom_handler(*_DATA_DEPENDENT)(run_replicated)
allow_plain_indices(aten.masked_select.default, aten.masked_scatter.default, aten.masked_scatter_.default,
                    arguments=("mask",))
