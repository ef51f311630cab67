"""loss_parallel: cross entropy on logits sharded over the vocabulary, as in torch's API.

shardwise computes softmax, log_softmax and nll_loss over a sharded class dim without
gathering the logits whenever they arrive sharded that way (``dispatch/ops/vocab_parallel.py``),
with or without this context manager; the results and gradients equal the single-device ones.
What the context adds is torch's calling convention: plain labels (and integer or bool tensors
computed from them) and the loss ops' class weights are taken as replicated, so

    with loss_parallel():
        loss = F.cross_entropy(logits, labels)   # logits: DTensor Shard(-1); labels: plain
        loss.backward()

works unchanged. Run the backward inside the context too: the loss's backward receives the
same plain labels.
"""

from __future__ import annotations

import torch

from shardwise.dispatch.dispatcher import ImplicitScope, implicit_replication

__all__ = ["loss_parallel"]

_aten = torch.ops.aten
_LOSS_SCOPE = ImplicitScope(
    ops=frozenset({
        _aten.nll_loss_forward.default, _aten.nll_loss_backward.default,
        _aten.nll_loss2d_forward.default, _aten.nll_loss2d_backward.default,
    }),
    integer_tensors=True,
)


def loss_parallel() -> implicit_replication:
    """Context manager: plain labels (and integer/bool tensors computed from them, such as the
    ignore mask of label smoothing) and the loss ops' class weights count as replicated."""
    return implicit_replication(_LOSS_SCOPE)
