"""``torch.distributed.tensor.parallel.loss``'s path: the code is in ``parallel/tensor_parallel/loss.py``."""

from shardwise.parallel.tensor_parallel.loss import loss_parallel

__all__ = ["loss_parallel"]
