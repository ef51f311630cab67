"""Parallelism as configuration: parallel degrees, module plans and tensor-parallel styles."""

from shardwise.core.missing import missing_names
from shardwise.parallel.context_parallel.context import context_parallel, context_parallel_unshard, ring_attention
from shardwise.parallel.tensor_parallel.loss import loss_parallel
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.expert_parallel import ExpertParallel, ExpertTensorParallel, TopKExpertParallel
from shardwise.parallel.tensor_parallel.parallelize import parallelize_module
from shardwise.parallel.tensor_parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from shardwise.parallel.tensor_parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "ParallelDims", "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel",
    "context_parallel", "context_parallel_unshard", "ring_attention", "ExpertParallel",
    "ExpertTensorParallel", "TopKExpertParallel",
]

# torch names not provided yet (ddp, fsdp, input_reshard) raise an error saying so.
__getattr__ = missing_names(__name__)
