"""Parallelism as configuration: parallel degrees, module plans and tensor-parallel styles."""

from shardwise.missing import missing_names
from shardwise.parallel.context import context_parallel, context_parallel_unshard, ring_attention
from shardwise.parallel.loss import loss_parallel
from shardwise.parallel.parallel_dims import ParallelDims
from shardwise.parallel.parallelize import parallelize_module
from shardwise.parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from shardwise.parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "ParallelDims", "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel",
    "context_parallel", "context_parallel_unshard", "ring_attention",
]

# torch names not provided yet (ddp, fsdp, input_reshard) raise an error saying so.
__getattr__ = missing_names(__name__)
