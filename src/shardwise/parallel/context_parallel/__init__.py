"""Context parallelism: buffers sharded along the sequence, attention as ring attention.

``context`` (context_parallel: the user-facing context manager, SDPA over the cp axis) and
``ring_attention`` (pure: log-sum-exp merge, per-block forward/backward, the load-balanced layout).
"""
