"""Tools to see what shardwise does: which collectives ran, and how many bytes they moved."""

from shardwise.debug.comm_mode import CommDebugMode, CommRecord

__all__ = ["CommDebugMode", "CommRecord"]
