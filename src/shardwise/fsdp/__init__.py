"""Data parallelism as DTensor layouts: fully_shard (FSDP2-like) and replicate (DDP-like).

Both keep the model code single-device: parameters become DTensors (sharded or replicated
over the data-parallel mesh) that the optimizer and checkpoints see, and module hooks gather
them for compute and reduce their gradients with few, large collectives.
"""

from shardwise.fsdp.fully_shard import FSDPModule, fully_shard
from shardwise.fsdp.memory import UnshardedMemory
from shardwise.fsdp.policy import MixedPrecisionPolicy
from shardwise.fsdp.replicate import replicate

__all__ = ["fully_shard", "replicate", "FSDPModule", "MixedPrecisionPolicy", "UnshardedMemory"]
