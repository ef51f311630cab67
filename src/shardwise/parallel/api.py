"""``torch.distributed.tensor.parallel.api``'s path: the code is in ``parallel/tensor_parallel/parallelize.py``."""

from shardwise.parallel.tensor_parallel.parallelize import parallelize_module

__all__ = ["parallelize_module"]
