"""Linear algebra, FFT, pooling, padding, order statistics, data-dependent shapes and the other
ops that need some dims whole (ops/core_dims.py and the modules built on it).

Every case compares values and gradients with the single-device computation (tests/op_check),
at world 4 with uneven shapes (5 over 4 ranks: one rank holds an empty block), and checks that
a dim the op does not need whole keeps its sharding without communication.
"""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.dispatch.ops.pad import padded_dims
from tests.op_check import assert_no_failures, check_op

S0, S1, R = [Shard(0)], [Shard(1)], [Replicate()]


def _spd(batch: int, n: int) -> torch.Tensor:
    a = torch.randn(batch, n, n)
    return a @ a.transpose(-1, -2) + n * torch.eye(n)


# ---------------------------------------------------------------------- linalg and FFT
def _linalg_fft():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    spd, rect = _spd(5, 3), torch.randn(6, 4, 3)
    cases = [
        (torch.linalg.cholesky, [spd], [S0]),
        (torch.linalg.det, [spd], [S0]),
        (torch.linalg.inv, [spd], [S1]),  # a matrix dim sharded: gathered, then right
        (torch.linalg.solve, [spd, torch.randn(5, 3, 2)], [S0, S0]),
        (torch.linalg.solve, [spd, torch.randn(5, 3)], [S0, R]),  # a batch of vectors
        (lambda a: torch.linalg.qr(a), [rect], [S0]),
        (torch.linalg.svdvals, [rect], [S0]),
        (torch.linalg.eigvalsh, [spd], [S0]),
        (lambda a: torch.linalg.slogdet(a), [spd], [S0]),
        (lambda a, b: torch.cdist(a, b), [torch.randn(5, 4, 3), torch.randn(5, 2, 3)], [S0, S0]),
        (lambda a: torch.fft.fft(a).abs(), [torch.randn(6, 8)], [S0]),
        (lambda a: torch.fft.rfft2(a).real, [torch.randn(5, 6, 8)], [S0]),
        (lambda a: torch.fft.irfft(torch.fft.rfft(a, dim=0), n=6, dim=0), [torch.randn(6, 8)], [S0]),
    ]
    failures = []
    for fn, inputs, layouts in cases:
        failures += check_op(fn, inputs, layouts, mesh)
    # Batch dims sharded: each rank factorizes / transforms its own rows, nothing moves. (The
    # checking forms, torch.linalg.cholesky, also gather the small info codes, so that every
    # rank raises together on a non-definite matrix.)
    failures += check_op(lambda a: torch.linalg.cholesky_ex(a).L, [_spd(8, 3)], [S0], mesh, expect_comms={})
    failures += check_op(torch.linalg.cholesky, [_spd(8, 3)], [S0], mesh, expect_comms={"all_gather": 1})
    failures += check_op(lambda a: torch.fft.fft(a, dim=1).real, [torch.randn(8, 6)], [S0], mesh, grad=False, expect_comms={})
    return failures


def test_linalg_and_fft_match_single_device(dist):
    assert_no_failures(dist.run(4, _linalg_fft))


# ---------------------------------------------------------------------- everything else
def _misc():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    img = torch.randn(5, 3, 6, 6)
    rounded = torch.randint(0, 3, (5, 7)).float()
    cases = [
        (lambda a: F.max_pool2d(a, 2), [img], [S0], True),
        (lambda a: F.max_pool2d(a, 2), [img], [S1], True),  # 3 channels over 4 ranks: gathered
        (lambda a: F.avg_pool2d(a, 3), [img], [S0], True),
        (lambda a: F.adaptive_avg_pool2d(a, 4), [img], [S0], True),
        (lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), [img], [S0], True),
        (lambda a: torch.median(a, dim=1), [torch.randn(5, 7)], [S0], True),
        (torch.median, [torch.randn(5, 7)], [S0], True),
        (lambda a: torch.kthvalue(a, 2, dim=0), [torch.randn(5, 7)], [S0], True),
        (lambda a: torch.mode(a, dim=1), [rounded], [S0], False),
        (lambda a: torch.quantile(a, 0.3, dim=1), [torch.randn(5, 7)], [S0], True),
        (torch.unique, [torch.randint(0, 4, (9,)).float()], [S0], False),
        (torch.nonzero, [torch.randint(0, 2, (9, 3)).float()], [S0], False),
        (torch.masked_select, [torch.randn(9, 3), torch.rand(9, 3) > 0.5], [S0, S0], True),
        (lambda a: F.pad(a, (1, 2, 1, 0), value=0.5), [torch.randn(5, 6)], [S0], True),  # pads the sharded dim
        (lambda a: F.pad(a, (1, 2), mode="reflect"), [torch.randn(5, 3, 6)], [S0], True),
        (lambda a: F.glu(a, dim=1), [torch.randn(5, 6)], [S0], True),
        (lambda a, w, b: F.group_norm(a, 2, w, b), [torch.randn(5, 4, 3), torch.randn(4), torch.randn(4)], [S0, R, R], True),
        (lambda a: F.pixel_shuffle(a, 2), [torch.randn(5, 8, 3, 3)], [S0], True),
        (lambda a: torch.histc(a, 5, -2, 2), [torch.randn(9, 3)], [S0], False),
        (torch.bucketize, [torch.randn(9, 3), torch.tensor([-1.0, 0.0, 1.0])], [S0, R], False),
        (torch.linalg.cross, [torch.randn(5, 3), torch.randn(5, 3)], [S0, S0], True),
        (lambda a: torch.diff(a, dim=1), [torch.randn(5, 6)], [S0], True),
        (torch.trace, [torch.randn(5, 5)], [S0], True),
        (torch.flatten, [torch.tensor(2.0)], [R], True),
        (lambda a, b: a @ b, [torch.randn(5), torch.randn(5, 3)], [S0, R], True),  # ends with squeeze_
        (lambda a: torch.roll(a, 2, 1), [torch.randn(5, 6)], [S0], True),
    ]
    failures = []
    for fn, inputs, layouts, grad in cases:
        failures += check_op(fn, inputs, layouts, mesh, grad=grad)
    # Off the padded / pooled / gated dims, the sharding stays and nothing is communicated.
    failures += check_op(lambda a: F.pad(a, (1, 2), value=0.5), [torch.randn(5, 6)], [S0], mesh, expect_comms={})
    failures += check_op(lambda a: F.max_pool2d(a, 2), [torch.randn(8, 3, 4, 4)], [S0], mesh, expect_comms={})
    failures += check_op(lambda a: F.glu(a, -1), [torch.randn(5, 6)], [S0], mesh, expect_comms={})
    return failures + _layouts(mesh)


def _layouts(mesh) -> list[str]:
    """Result types and placements: a DTensor comes back, sharded where the op allows."""
    failures = []
    x = sw.distribute_tensor(torch.randn(5, 6), mesh, S0)
    padded = F.pad(x, (1, 2), value=0.5)
    if not isinstance(padded, DTensor) or padded.placements != (Shard(0),) or padded.shape != (5, 9):
        failures.append(f"F.pad off the sharded dim: {type(padded).__name__} {getattr(padded, 'placements', None)}")
    padded = F.pad(x, (0, 0, 1, 1))
    if not isinstance(padded, DTensor) or padded.shape != (7, 6):
        failures.append(f"F.pad on the sharded dim: {type(padded).__name__}")
    counts = torch.histc(x, 4, -3, 3)
    if counts.placements != (Partial(),):
        failures.append(f"histc with a range: {counts.placements}, want the local counts pending a sum")
    picked = torch.masked_select(x, x > 0)
    if picked.placements != (Replicate(),):
        failures.append(f"masked_select: {picked.placements}")
    y = sw.distribute_tensor(torch.randn(5, 1, 3), mesh, S0)
    z = y.clone()
    if z.squeeze_(1) is not z or z.shape != (5, 3) or z.placements != (Shard(0),):
        failures.append(f"squeeze_: {z.shape} {z.placements}")
    if not torch.equal(z.full_tensor(), y.full_tensor().squeeze(1)):
        failures.append("squeeze_: values differ")
    z.unsqueeze_(0)
    if z.shape != (1, 5, 3) or z.placements != (Shard(1),):
        failures.append(f"unsqueeze_: {z.shape} {z.placements}")
    batch = sw.distribute_tensor(_spd(4, 3), mesh, S0)
    with CommDebugMode() as comms:
        factor = torch.linalg.cholesky_ex(batch).L
    if comms.get_total_counts() != 0 or factor.placements != (Shard(0),):
        failures.append(f"cholesky of a batch-sharded tensor: {factor.placements}, {comms.get_comm_counts()}")
    return failures


def test_pooling_padding_order_statistics_and_data_dependent_ops(dist):
    assert_no_failures(dist.run(4, _misc))


def test_padded_dims_counts_pairs_from_the_last_dim():
    assert padded_dims(3, (1, 2)) == {2}
    assert padded_dims(3, (0, 0, 1, 0)) == {1}
    assert padded_dims(4, (1, 1, 0, 0, 2, 2)) == {3, 1}
