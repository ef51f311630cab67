"""``torch.distributed.fsdp``'s names: fully_shard (FSDP2) and replicate (DDP), as DTensor layouts.

The code is in ``shardwise.parallel.data_parallel``; this module is the path a user of
``torch.distributed.fsdp`` switches to.
"""

from shardwise.parallel.data_parallel import FSDPModule, MixedPrecisionPolicy, UnshardedMemory, fully_shard, replicate

__all__ = ["fully_shard", "replicate", "FSDPModule", "MixedPrecisionPolicy", "UnshardedMemory"]
