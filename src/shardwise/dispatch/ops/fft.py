"""FFTs: ``torch.fft.*`` reach shardwise as ``_fft_r2c``, ``_fft_c2r`` and ``_fft_c2c``.

A transform mixes every element along the dims it transforms, and none across the others. So
the transformed dims must be whole, and every other dim keeps its sharding: each rank
transforms its own rows, with no communication (``fft(x, dim=-1)`` of a tensor sharded on
dim 0). A transform over a sharded dim gathers that dim first (a distributed FFT, with its
all-to-all transposes, would pay off only for very large transforms).

Complex results are usually read through ``view_as_real`` (see ``ops/complex.py``).

``fftshift`` / ``ifftshift`` are ``roll`` (see ``ops/rearrange.py``), the frequency helpers
(``fftfreq``) are factories, and the backward of each transform is another transform.
"""

from __future__ import annotations

from typing import Any

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.ops.core_dims import aligned_axis_candidates, without_empty_blocks
from shardwise.dispatch.registry import register_custom_handler, register_strategy
from shardwise.dispatch.strategy import Candidate, OpSchema, expand


@register_strategy(aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default, per_axis=False)
def fft_strategy(schema: OpSchema) -> list[Candidate]:
    """Transformed dims whole; the others sharded alike on input and output, as long as no
    rank's block is empty (the FFT backend rejects empty inputs: that rank would raise alone)."""
    axis = aligned_axis_candidates(schema, list(schema.arg(1, "dim")))
    return without_empty_blocks(schema, expand(axis, 1, schema.mesh.ndim), allowed=set())


@register_custom_handler(aten._conj.default)
def conj(op: Any, args: tuple, kwargs: dict) -> Any:
    """The conjugate (inverse FFTs of real signals take it), computed rather than a view with
    the conjugate bit: a block that carries the bit would lose it when a collective copies its
    raw storage, and the wrapper cannot carry it. Every layout is kept (``conj_physical`` is
    pointwise); the result does not alias ``self``."""
    return aten.conj_physical.default(args[0])
