"""Embedding (column-, batch-, vocab-parallel) and conv2d (batch-, channel-parallel) on DTensors.

Values and gradients against single-device results on meshes (4,) and (2, 2), uneven splits
(vocab 10 and 5 over 4 ranks: a rank with an empty block; batch 7 and 3 over 4 ranks), and the
layouts / collectives each parallel form is meant to have.
"""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()


def _meshes():
    return [sw.init_device_mesh("cpu", (4,)), sw.init_device_mesh("cpu", (2, 2))]


# ---------------------------------------------------------------------- embedding
def _lookup(weight, indices):
    return F.embedding(indices, weight)


def _lookup_padded(weight, indices):
    return F.embedding(indices, weight, padding_idx=3)


def _lookup_freq(weight, indices):
    return F.embedding(indices, weight, scale_grad_by_freq=True)


def _lookup_then_scale(weight, indices, scale):
    return F.embedding(indices, weight) * scale


def _embedding_values():
    torch.manual_seed(0)
    failures = []
    for mesh in _meshes():
        if mesh.ndim == 1:
            weight_layouts = [[S0], [S1], [R], [P]]
            index_layouts = [[R], [S0], [S1]]
        else:
            weight_layouts = [[S0, S0], [S0, S1], [S1, S0], [R, S0], [S0, R], [R, R]]
            index_layouts = [[R, R], [S0, R], [R, S1], [S0, S1]]
        for vocab in (10, 5):  # 10 over 4: 3,3,3,1 rows; 5 over 4: 2,2,1,0 (an empty block)
            weight, indices = torch.randn(vocab, 6), torch.randint(0, vocab, (3, 5))
            indices[0, :3] = 3  # repeated rows (accumulated gradients, frequency counts)
            for lw in weight_layouts:
                for li in index_layouts:
                    failures += check_op(_lookup, [weight, indices], [lw, li], mesh)
                failures += check_op(_lookup_padded, [weight, indices], [lw, index_layouts[0]], mesh)
                failures += check_op(_lookup_freq, [weight, indices], [lw, index_layouts[0]], mesh)
                failures += check_op(_lookup_freq, [weight, indices], [lw, index_layouts[1]], mesh)
                # a consumer that needs the Partial output reduced (and a non-trivial grad_output)
                failures += check_op(_lookup_then_scale, [weight, indices, torch.randn(6)],
                                     [lw, index_layouts[0], [S0] + [R] * (mesh.ndim - 1)], mesh)
        flat = torch.randint(0, 10, (7,))
        failures += check_op(_lookup, [torch.randn(10, 6), flat], [[S0] * mesh.ndim, [R] * mesh.ndim], mesh)
        failures += check_op(_lookup, [torch.randn(10, 6), flat], [[R] * mesh.ndim, [S0] * mesh.ndim], mesh)
    return failures


def test_embedding_values_and_gradients(dist):
    assert_no_failures(dist.run(4, _embedding_values))


def _embedding_layouts():
    """(forward output placements, forward collectives, weight-gradient placements) per form."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    weight, indices = torch.randn(10, 6), torch.randint(0, 10, (3, 5))
    out = {}
    for name, lw, li in [("vocab", S0, R), ("column", S1, R), ("batch", R, S0)]:
        w = sw.distribute_tensor(weight.clone().requires_grad_(), mesh, [lw])
        i = sw.distribute_tensor(indices, mesh, [li])
        with CommDebugMode() as comms:
            y = F.embedding(i, w)
        y.full_tensor().sum().backward()
        out[name] = (y.placements, comms.get_comm_counts(), w.grad.placements)
    return out


def test_embedding_parallel_forms_keep_their_layouts(dist):
    for got in dist.run(4, _embedding_layouts):
        assert got["vocab"] == ((P,), {}, (S0,)), got["vocab"]
        assert got["column"] == ((S2,), {}, (S1,)), got["column"]
        assert got["batch"] == ((S0,), {}, (P,)), got["batch"]


# ---------------------------------------------------------------------- convolution
def _conv(x, w, b):
    return F.conv2d(x, w, b, stride=1, padding=1)


def _conv_strided(x, w, b):
    return F.conv2d(x, w, b, stride=2, padding=0, dilation=1)


def _conv_grouped(x, w, b):
    return F.conv2d(x, w, b, padding=1, groups=3)


def _conv_transposed(x, w, b):
    return F.conv_transpose2d(x, w, b, stride=2, padding=1)


def _conv_values():
    torch.manual_seed(0)
    failures = []
    for mesh in _meshes():
        rep = [R] * mesh.ndim
        rest = [R] * (mesh.ndim - 1)
        batch = [[S0] * mesh.ndim, [S0] + rest, rest + [S0]]
        for n in (7, 3):  # 7 over 4: 2,2,2,1 samples; 3 over 4: an empty block
            x, w, b = torch.randn(n, 3, 5, 5), torch.randn(6, 3, 3, 3), torch.randn(6)
            for lx in batch:
                failures += check_op(_conv, [x, w, b], [lx, rep, rep], mesh)
                failures += check_op(_conv, [x, w, None], [lx, rep, None], mesh)
                failures += check_op(_conv_strided, [x, w, b], [lx, rep, rep], mesh)
                failures += check_op(_conv_grouped, [x, torch.randn(6, 1, 3, 3), b], [lx, rep, rep], mesh)
                failures += check_op(_conv_transposed, [x, torch.randn(3, 4, 3, 3), torch.randn(4)], [lx, rep, rep], mesh)
            failures += check_op(_conv, [x, w, b], [rep, rep, rep], mesh)
        x, w, b = torch.randn(4, 5, 6, 6), torch.randn(7, 5, 3, 3), torch.randn(7)
        # output-channel parallel (7 filters over the ranks), input-channel parallel (5 channels)
        failures += check_op(_conv, [x, w, b], [rep, [S0] + rest, [S0] + rest], mesh)
        failures += check_op(_conv, [x, w, b], [[S1] + rest, [S1] + rest, rep], mesh)
        failures += check_op(_conv, [x, w, b], [[S0] + rest, rest + [S0], rest + [S0]], mesh)
        failures += check_op(_conv_transposed, [x, torch.randn(5, 4, 3, 3), torch.randn(4)], [rep, [S1] + rest, [S0] + rest], mesh)
    return failures


def test_conv2d_values_and_gradients(dist):
    assert_no_failures(dist.run(4, _conv_values))


def _conv_layouts():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    out = {}
    cases = [("batch", S0, R, R), ("out_channel", R, S0, S0), ("in_channel", S1, S1, R)]
    for name, lx, lw, lb in cases:
        x = sw.distribute_tensor(torch.randn(8, 4, 5, 5).requires_grad_(), mesh, [lx])
        w = sw.distribute_tensor(torch.randn(8, 4, 3, 3).requires_grad_(), mesh, [lw])
        b = sw.distribute_tensor(torch.randn(8).requires_grad_(), mesh, [lb])
        with CommDebugMode() as comms:
            y = F.conv2d(x, w, b, padding=1)
        y.full_tensor().sum().backward()
        out[name] = (y.placements, comms.get_comm_counts(), w.grad.placements, b.grad.placements)
    return out


def test_conv2d_parallel_forms_keep_their_layouts(dist):
    for got in dist.run(4, _conv_layouts):
        assert got["batch"] == ((S0,), {}, (P,), (P,)), got["batch"]
        assert got["out_channel"] == ((S1,), {}, (S0,), (S0,)), got["out_channel"]
        assert got["in_channel"] == ((P,), {}, (S1,), (R,)), got["in_channel"]
