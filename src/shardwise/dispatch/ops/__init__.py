"""Sharding strategies by op family; importing this package fills the registry."""

from shardwise.dispatch.ops import pointwise, reduction  # noqa: F401
