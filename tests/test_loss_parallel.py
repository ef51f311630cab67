"""Cross entropy on vocabulary-sharded logits: equal to single-device, and the logits never gathered."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

VOCAB, DIM, TOKENS = 11, 8, 6  # 11 classes on 4 ranks: blocks of 3, 3, 3, 2


def _logits_and_labels():
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB)
    labels = torch.tensor([0, 10, 4, -100, 7, 10])  # one ignored, two in the last (short) block
    return logits, labels


def _reference(kind: str, **loss_kwargs):
    logits, labels = _logits_and_labels()
    logits.requires_grad_()
    loss = _loss(kind, logits, labels, **loss_kwargs)
    loss.backward()
    return loss.detach(), logits.grad


def _loss(kind: str, logits, labels, **loss_kwargs):
    if kind == "cross_entropy":
        return F.cross_entropy(logits, labels, **loss_kwargs)
    logp = F.log_softmax(logits, dim=-1)
    # log_softmax feeding something besides the loss: its gradient must still be the true one
    entropy = -(logp.exp() * logp).sum() / TOKENS
    return F.nll_loss(logp, labels, **loss_kwargs) + 0.5 * entropy


def _sharded(kind: str, mesh_shape, placements, loss_kwargs):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    logits, labels = _logits_and_labels()
    dlogits = sw.distribute_tensor(logits, mesh, placements).requires_grad_()
    with CommDebugMode() as comm, loss_parallel():
        loss = _loss(kind, dlogits, labels, **loss_kwargs)
        loss.backward()
    # A scalar: replicated, or (label smoothing adds a class-dim sum) still a pending sum.
    assert all(p.is_replicate() or p.is_partial("sum") for p in loss.placements)
    return loss.full_tensor(), dlogits.grad.full_tensor(), dlogits.grad.placements, comm.get_comm_counts()


CASES = [
    ("cross_entropy", {}),
    ("cross_entropy", {"reduction": "sum"}),
    ("cross_entropy", {"weight": torch.linspace(0.5, 1.5, VOCAB)}),
    ("cross_entropy", {"label_smoothing": 0.1}),
    ("log_softmax_elsewhere", {}),
]


@pytest.mark.parametrize("kind,loss_kwargs", CASES, ids=lambda c: str(c) if isinstance(c, str) else ",".join(c) or "mean")
def test_vocab_sharded_cross_entropy_matches_single_device(dist, kind, loss_kwargs):
    loss, grad = _reference(kind, **loss_kwargs)
    for got_loss, got_grad, placements, comms in dist.run(4, _sharded, kind, (4,), [Shard(1)], loss_kwargs):
        torch.testing.assert_close(got_loss, loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got_grad, grad, atol=1e-6, rtol=1e-5)
        assert placements == (Shard(1),)
        assert "all_gather" not in comms and "all_to_all" not in comms, comms  # logits never gathered


def test_vocab_and_batch_sharded_on_a_2d_mesh(dist):
    """Tokens sharded on one axis, vocabulary on the other: the mean divides by the global count."""
    loss, grad = _reference("cross_entropy")
    for got_loss, got_grad, placements, comms in dist.run(4, _sharded, "cross_entropy", (2, 2), [Shard(0), Shard(1)], {}):
        torch.testing.assert_close(got_loss, loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got_grad, grad, atol=1e-6, rtol=1e-5)
        assert "all_gather" not in comms, comms


def _tiny_lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB + 1, DIM), nn.Linear(DIM, VOCAB + 1, bias=False))


def _lm_tokens():
    torch.manual_seed(2)
    return torch.randint(0, VOCAB + 1, (2, 5)), torch.randint(0, VOCAB + 1, (2, 5))


def _tp_lm():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = parallelize_module(_tiny_lm(), mesh, {
        "0": RowwiseParallel(input_layouts=Replicate()),
        "1": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    ids, labels = _lm_tokens()
    with loss_parallel():
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    return logits.placements, loss.full_tensor(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_loss_parallel_on_a_colwise_output_layer(dist):
    model = _tiny_lm()
    ids, labels = _lm_tokens()
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    for placements, got_loss, grads in dist.run(4, _tp_lm):
        assert placements == (Shard(2),)
        torch.testing.assert_close(got_loss, loss.detach(), atol=1e-6, rtol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5)


def _plain_labels_outside():
    mesh = sw.init_device_mesh("cpu", (4,))
    logits, labels = _logits_and_labels()
    F.cross_entropy(sw.distribute_tensor(logits, mesh, [Shard(1)]), labels)


def test_plain_labels_need_loss_parallel(dist):
    dist.run_expect_error(4, _plain_labels_outside, match=r"plain tensor i64\[6\].*implicit_replication")
