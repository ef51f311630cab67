"""Ops that reach shardwise as torch decompositions building their own plain tensors (masks,
padding buffers, index ranges): values and gradients against single-device."""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate, Shard
from tests.op_check import assert_no_failures, check_op

_CASES = [
    ("tril", lambda x: torch.tril(x, diagonal=1), (7, 6)),
    ("triu", lambda x: torch.triu(x), (7, 6)),
    ("pad.constant", lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), (5, 3)),
    ("diag_embed", lambda x: torch.diag_embed(x), (5, 3)),
    ("renorm", lambda x: torch.renorm(x, p=2, dim=0, maxnorm=1.0), (5, 4)),
    ("narrow", lambda x: torch.narrow(x, 1, 1, 2), (5, 3)),
    ("movedim", lambda x: torch.movedim(x, 0, -1), (5, 3, 2)),
]


def _decomposed_ops():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    failures = []
    for name, fn, shape in _CASES:
        x = torch.randn(shape)
        for layout in ([Replicate()], [Shard(0)], [Shard(1)]):
            failures += check_op(fn, [x], [layout], mesh)
    return failures


def test_decomposed_ops_match_single_device(dist):
    assert_no_failures(dist.run(4, _decomposed_ops))


def _implicit_mode_after_nested_decompositions():
    from shardwise.dispatch import flags

    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    torch.diag_embed(x)  # decompositions inside a decomposition
    F.pad(x, (1, 1), value=0.5)
    return flags.implicit()


def test_decompositions_leave_plain_tensors_refused_afterwards(dist):
    """Plain tensors are taken as replicated only inside a decomposition, nested ones included."""
    assert dist.run(4, _implicit_mode_after_nested_decompositions) == [False] * 4
