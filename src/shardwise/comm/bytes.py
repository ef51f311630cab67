"""What an all_reduce sends, per rank (pure): the one formula ``comm`` records and the
redistribute planner prices, so the two always agree.

The other collectives send what their inputs and outputs say (an all_gather its block to every
peer, a reduce_scatter all but its own piece); an all_reduce is counted as a reduce_scatter
followed by an all_gather, whose pieces differ by rank when the group size does not divide the
tensor. ``comm`` records every rank at the busiest rank's figure (position 0), one number per
collective whatever the rank, which keeps ranks of the same layout alike (the simulator relies
on it); the planner also sums the exact figures, which ``redistribute/bound.py``'s total
bound is compared with.
"""

from __future__ import annotations

from shardwise.core.placement import Shard

__all__ = ["all_reduce_sent"]


def all_reduce_sent(numel: int, n: int, me: int) -> int:
    """Elements the rank at position ``me`` of an ``n``-rank group sends in an all_reduce of
    ``numel`` elements: its whole tensor once, and its own reduce_scatter piece ``n - 2`` times
    more.

    Summed over the group this is ``2 (n - 1) numel``, the least any reduction that leaves the
    value on every rank sends. Pieces follow ``Shard.chunk``, so rank 0's is the largest and
    rank 0 the busiest: ``numel + (n - 2) ceil(numel / n)``.

        >>> [all_reduce_sent(35, 4, me) for me in range(4)]
        [53, 53, 53, 51]
    """
    if n < 2 or numel == 0:
        return 0
    return numel + (n - 2) * Shard.chunk(numel, n, me)[0]
