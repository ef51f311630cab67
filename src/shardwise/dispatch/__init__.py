"""Running ATen ops on DTensors: unpack, propagate layouts, communicate, compute, repack."""

from shardwise.dispatch.dispatcher import cache_info, clear_cache, dispatch, implicit_replication, render_call
from shardwise.dispatch.propagation import UnsupportedOp, allow_replicate_fallback
from shardwise.dispatch.registry import register_custom_handler, register_sharding, register_strategy
from shardwise.dispatch.strategy import Candidate, OpSchema
from shardwise.dispatch.tensor_class import bind_tensor_class
from shardwise.dispatch import ops  # noqa: F401  (fills the registry)

__all__ = [
    "dispatch", "render_call", "clear_cache", "cache_info", "implicit_replication",
    "UnsupportedOp", "allow_replicate_fallback",
    "register_custom_handler", "register_sharding", "register_strategy",
    "Candidate", "OpSchema", "bind_tensor_class",
]
