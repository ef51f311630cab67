"""loss_parallel: cross entropy on logits sharded over the vocabulary, as in torch's API.

shardwise computes softmax, log_softmax and nll_loss over a sharded class dim without
gathering the logits whenever they arrive sharded that way (``dispatch/ops/vocab_parallel.py``),
with or without this context manager; the results and gradients equal the single-device ones.
What the context adds is torch's calling convention: plain tensors given to the loss ops
(labels, class weights) are taken as replicated, so

    with loss_parallel():
        loss = F.cross_entropy(logits, labels)   # logits: DTensor Shard(-1); labels: plain
        loss.backward()

works unchanged. Run the backward inside the context too: the loss's backward receives the
same plain labels.
"""

from __future__ import annotations

import torch

from shardwise.dispatch.dispatcher import implicit_replication

__all__ = ["loss_parallel"]

_aten = torch.ops.aten
_LOSS_OPS = frozenset({
    _aten.nll_loss_forward.default, _aten.nll_loss_backward.default,
    _aten.nll_loss2d_forward.default, _aten.nll_loss2d_backward.default,
})


def loss_parallel() -> implicit_replication:
    """Context manager: plain labels and class weights of the loss ops count as replicated."""
    return implicit_replication(_LOSS_OPS)
