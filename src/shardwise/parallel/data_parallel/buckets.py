"""Gradient buckets of replicate: which parameters share one all_reduce.

Gradients become ready roughly in reverse registration order (the last layer's first), so
buckets are filled walking the parameters backwards; a bucket closes once adding the next
gradient would pass the byte cap (a single larger gradient gets a bucket of its own) or when
the dtype changes (one flat buffer has one dtype). Pure: no tensors, no process group.
"""

from __future__ import annotations

from typing import Hashable, Sequence

__all__ = ["plan_buckets"]


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], cap_bytes: int) -> list[tuple[int, ...]]:
    """Parameter indices per bucket, in the order the buckets will be reduced.

    Example:
        >>> plan_buckets([40, 4, 40, 4], ["f32"] * 4, cap_bytes=50)
        [(3, 2, 1), (0,)]
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    if len(nbytes) != len(dtypes):
        raise ValueError(f"{len(nbytes)} sizes but {len(dtypes)} dtypes")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if current and (size + nbytes[i] > cap_bytes or dtypes[i] != dtypes[current[0]]):
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
    if current:
        buckets.append(tuple(current))
    return buckets
