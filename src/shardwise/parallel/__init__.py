"""Parallelism as configuration: parallel degrees, module plans and styles."""

from shardwise.parallel.parallel_dims import ParallelDims

__all__ = ["ParallelDims"]
