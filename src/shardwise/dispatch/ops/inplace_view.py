"""In-place view ops: ``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``.

They change a tensor's shape without touching its values, and return the same tensor object
(``matmul`` of a 1-D operand ends with ``squeeze_``). On a DTensor three things change
together: the local block (the same in-place view of it), the spec (dims move, so a Shard(d)
may become Shard(d - 1)), and the wrapper's own global sizes and strides, which PyTorch reads
without asking the DTensor. The layout comes from the out-of-place twin of the op (so a
squeezed dim is one of size 1 GLOBALLY, whatever the local block's size); the wrapper's
metadata is changed by running the op on the wrapper itself with Python dispatch off (the
wrapper owns no data, only sizes and strides).
"""

from __future__ import annotations

from typing import Any

from torch.utils._mode_utils import no_dispatch

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.registry import register_custom_handler

_OUT_OF_PLACE = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


@register_custom_handler(*_OUT_OF_PLACE)
def inplace_view(op: Any, args: tuple, kwargs: dict) -> Any:
    """Apply the view to the block and the spec, then to the wrapper; return the same object."""
    x = args[0]
    out = _OUT_OF_PLACE[op](*args, **kwargs)
    x._local_tensor, x._spec = out._local_tensor, out._spec
    with no_dispatch():
        op(x, *args[1:], **kwargs)
    return x
