"""Data parallelism as DTensor layouts: fully_shard (FSDP2-like) and replicate (DDP-like).

Both keep the model code single-device: parameters become DTensors (sharded or replicated
over the data-parallel mesh) that the optimizer and checkpoints see, and module hooks gather
them for compute and reduce their gradients with few, large collectives.
"""

from shardwise.parallel.data_parallel.fully_shard import FSDPModule, fully_shard
from shardwise.parallel.data_parallel.memory import UnshardedMemory
from shardwise.parallel.data_parallel.policy import MixedPrecisionPolicy
from shardwise.parallel.data_parallel.replicate import replicate

__all__ = ["fully_shard", "replicate", "FSDPModule", "MixedPrecisionPolicy", "UnshardedMemory"]
