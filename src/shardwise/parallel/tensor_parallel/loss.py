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

from shardwise.compile.opaque import eager_only
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


class _LossParallel(implicit_replication):
    """``implicit_replication`` for the loss ops, entered and left eagerly under torch.compile.

    The setting is read by the dispatcher when AOTAutograd traces the ops; Dynamo would only
    simulate it while capturing (and the ops in the block would be traced without it), so the
    context is a graph break: the code inside is compiled with the setting in force."""

    __enter__ = eager_only(implicit_replication.__enter__)
    __exit__ = eager_only(implicit_replication.__exit__)


def loss_parallel() -> implicit_replication:
    """Context manager: plain labels (and integer/bool tensors computed from them, such as the
    ignore mask of label smoothing) and the loss ops' class weights count as replicated."""
    return _LossParallel(_LOSS_SCOPE)
