"""Tools to see what shardwise does: which collectives ran, where, and which rank holds what.

Mirrors ``torch.distributed.tensor.debug``: ``CommDebugMode`` (counts by shardwise's names or
torch's collective ops, per module, with bytes) and ``visualize_sharding``; and shardwise's own:
``explain`` (per module and phase: collectives, bytes and boundary layouts; or every op's
layouts, strategy and collectives) and
``check_collectives`` (ranks compare each collective before issuing it).
"""

from shardwise.debug.check import CollectiveMismatch, check_collectives
from shardwise.debug.comm_mode import CommDebugMode, CommRecord
from shardwise.debug.counts import CommCounts
from shardwise.debug.explain import Detail, Explanation, explain
from shardwise.debug.visualize import visualize_sharding

__all__ = ["CommDebugMode", "CommRecord", "CommCounts", "visualize_sharding", "explain", "Detail", "Explanation",
           "check_collectives", "CollectiveMismatch"]
