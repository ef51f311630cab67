"""``torch.distributed.tensor.parallel.style``'s path: the styles live in ``parallel/tensor_parallel/``."""

from shardwise.parallel.tensor_parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from shardwise.parallel.tensor_parallel.style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput"]
