"""Sharding strategies by op family; importing this package fills the registry."""

from shardwise.dispatch.ops import pointwise, reduction, foreach  # noqa: F401
from shardwise.dispatch.ops import matmul, embedding, conv  # noqa: F401
from shardwise.dispatch.ops import norm, loss, attention, attention_cuda, vocab_parallel  # noqa: F401
from shardwise.dispatch.ops import view, tensor  # noqa: F401
from shardwise.dispatch.ops import random  # noqa: F401
from shardwise.dispatch.ops import complex  # noqa: F401
from shardwise.dispatch.ops import core_dims, linalg, fft, pooling, pad, rearrange, glu  # noqa: F401
from shardwise.dispatch.ops import binning, data_dependent, inplace_view, whole  # noqa: F401
