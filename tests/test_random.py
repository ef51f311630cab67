"""The counter-based generator: blocks are slices of the whole, sane statistics, stream state.

Most tests are pure (no processes); the last one lays random DTensors out over 4 ranks.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.tensor import random as R

N = 1 << 20  # samples for the statistics tests
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _whole(fn, shape, **kw):
    return fn(shape, (0,) * len(shape), shape, **kw)


# ---------------------------------------------------------------------- the hash
def test_bits_match_the_python_reference():
    """Wrapping multiplication and logical shifts in int64 tensors equal the 64-bit integer math."""
    for seed, offset in [(0, 0), (7, 12), (2**64 - 1, 2**63 + 5)]:
        got = R.random_bits((3, 4, 5), (0, 0, 0), (3, 4, 5), seed=seed, offset=offset, words=2, word=1)
        want = [R._signed(R.mix64((offset + 2 * i + 1) * R._GAMMA + R._key(seed))) for i in range(60)]
        assert got.flatten().tolist() == want


def test_mix64_known_values():
    """SplitMix64's published first outputs for seed 0 (state advanced by gamma before mixing)."""
    assert [R.mix64(k * R._GAMMA) for k in (1, 2, 3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
    ]


# ---------------------------------------------------------------------- blocks
@st.composite
def _block(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    offset, length = [], []
    for size in shape:
        start = draw(st.integers(0, size))
        offset.append(start)
        length.append(draw(st.integers(0, size - start)))
    return shape, tuple(offset), tuple(length)


@settings(max_examples=150, deadline=None)
@given(
    block=_block(),
    kind=st.sampled_from(["uniform", "normal", "bernoulli"]),
    dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40),
    chunk=st.sampled_from([1, 3, 1 << 16]),
)
def test_block_is_the_slice_of_the_whole(block, kind, dtype, seed, offset, chunk):
    """Any block, cut into any chunks, holds exactly the whole tensor's values at its indices."""
    shape, start, length = block
    fn = {"uniform": R.uniform, "normal": R.normal}.get(kind) or (lambda *a, **k: R.bernoulli(0.3, *a, **k))
    kw = {"seed": seed, "offset": offset, "dtype": dtype}
    whole = _whole(fn, shape, **kw)
    old, R._CPU_CHUNK = R._CPU_CHUNK, chunk
    try:
        part = fn(shape, start, length, **kw)
    finally:
        R._CPU_CHUNK = old
    want = whole[tuple(slice(s, s + n) for s, n in zip(start, length))]
    assert part.dtype == dtype and part.shape == want.shape
    assert torch.equal(part, want)


def test_blocks_outside_the_tensor_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        R.uniform((4, 4), (2, 0), (3, 4), seed=0, offset=0)
    with pytest.raises(ValueError, match="rank"):
        R.uniform((4, 4), (0,), (4,), seed=0, offset=0)
    with pytest.raises(TypeError, match="float dtype"):
        R.uniform((4,), (0,), (4,), seed=0, offset=0, dtype=torch.int64)


def test_a_later_offset_is_the_same_stream_shifted():
    """One word per element: offset k reads the counters offset 0 reads from index k on."""
    a = _whole(R.uniform, (100,), seed=3, offset=0, dtype=torch.float64)
    b = _whole(R.uniform, (96,), seed=3, offset=4, dtype=torch.float64)
    assert torch.equal(a[4:], b)


def test_deterministic_and_different_across_seeds_and_offsets():
    base = _whole(R.normal, (64, 64), seed=1, offset=0)
    assert torch.equal(base, _whole(R.normal, (64, 64), seed=1, offset=0))
    for other in (_whole(R.normal, (64, 64), seed=2, offset=0), _whole(R.normal, (64, 64), seed=1, offset=4096)):
        assert (other == base).float().mean() < 0.01


# ---------------------------------------------------------------------- statistics
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_uniform_statistics(dtype):
    u = _whole(R.uniform, (N,), seed=11, offset=0, dtype=dtype).double()
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert abs(u.var() - 1 / 12) < 1e-3
    bins = 100
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    chi2 = ((counts - N / bins) ** 2 / (N / bins)).sum()
    assert chi2 < bins + 6 * math.sqrt(2 * bins), chi2  # 99 degrees of freedom: mean 99, sd 14
    lag1 = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(lag1) < 5 / math.sqrt(N)


def test_uniform_pairs_fill_the_square():
    """Adjacent values, as points of the unit square, fall evenly into a 16 x 16 grid."""
    u = _whole(R.uniform, (N,), seed=5, offset=0, dtype=torch.float64)
    cells = (u[0::2] * 16).long() * 16 + (u[1::2] * 16).long()
    counts = torch.bincount(cells, minlength=256).double()
    expected = N / 2 / 256
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255), chi2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_normal_statistics(dtype):
    z = _whole(R.normal, (N,), seed=12, offset=0, dtype=dtype).double()
    assert abs(z.mean()) < 5 / math.sqrt(N)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / N)
    assert abs((z**3).mean()) < 5 * math.sqrt(15 / N)  # skewness 0
    assert abs((z**4).mean() - 3) < 5 * math.sqrt(96 / N)  # kurtosis 3
    within = (z.abs() < 1).double().mean()
    assert abs(within - math.erf(1 / math.sqrt(2))) < 5 * math.sqrt(0.68 * 0.32 / N)
    lag1 = torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1]
    assert abs(lag1) < 5 / math.sqrt(N)
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_bernoulli_mean_is_p(p):
    hits = _whole(lambda *a, **k: R.bernoulli(p, *a, **k), (N,), seed=13, offset=0)
    assert hits.dtype == torch.bool
    assert abs(hits.double().mean() - p) < 5 * math.sqrt(p * (1 - p) / N) + 1e-12


def test_bernoulli_takes_a_tensor_of_probabilities():
    p = torch.linspace(0, 1, 5).repeat(20000, 1)
    hits = R.bernoulli(p, (20000, 5), (0, 0), (20000, 5), seed=1, offset=0, dtype=torch.float32)
    assert hits.dtype == torch.float32
    assert torch.allclose(hits.mean(0), torch.linspace(0, 1, 5).float(), atol=0.02)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        R.bernoulli(1.5, (4,), (0,), (4,), seed=1, offset=0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_low_precision_dtypes_stay_below_one(dtype):
    """bfloat16 and float16 use their own significand bits: no value rounds up to 1.0."""
    u = _whole(R.uniform, (1 << 16,), seed=3, offset=0, dtype=dtype)
    assert u.dtype == dtype and 0 <= u.min() and u.max() < 1
    levels = 2 ** R._SIGNIFICAND_BITS[dtype]
    assert torch.equal((u.double() * levels).frac(), torch.zeros(1 << 16, dtype=torch.float64))
    assert len(u.unique()) > min(levels, 1 << 16) // 2  # the grid is used, not a few values
    z = _whole(R.normal, (1 << 16,), seed=3, offset=0, dtype=dtype)
    assert z.dtype == dtype and torch.isfinite(z).all() and abs(z.double().std() - 1) < 0.02


# ---------------------------------------------------------------------- stream state
def test_the_stream_follows_torch_seeds_and_advances():
    R.manual_seed(1)
    assert R.get_rng_state() == (1, 0)
    assert R.next_offset(10) == 0 and R.next_offset(1) == 12 and R.get_rng_state() == (1, 16)
    torch.manual_seed(5)  # a new torch seed restarts the stream from it
    assert R.get_rng_state() == (5, 0)
    first = R.draw("normal", (3, 4), (0, 0), (3, 4), dtype=torch.float64)
    assert R.get_rng_state() == (5, 24)  # two words per float64 normal, times 12 elements
    assert torch.equal(first, R.normal((3, 4), (0, 0), (3, 4), seed=5, offset=0, dtype=torch.float64))
    second = R.draw("normal", (3, 4), (0, 0), (3, 4), dtype=torch.float64)
    assert not torch.equal(first, second)
    state = R.get_rng_state()
    third = R.draw("uniform", (7,), (2,), (3,))  # a block still consumes the whole tensor's counters
    R.set_rng_state(state)
    assert torch.equal(R.draw("uniform", (7,), (2,), (3,)), third) and R.get_rng_state()[1] == state[1] + 8
    R.manual_seed(5)  # the same seed again: shardwise's manual_seed restarts the stream
    assert torch.equal(R.draw("normal", (3, 4), (0, 0), (3, 4), dtype=torch.float64), first)


# ---------------------------------------------------------------------- distributed
def _random_dtensors():
    R.manual_seed(21)
    mesh = sw.init_device_mesh("cpu", (4,))
    rows = sw.rand(10, 3, device_mesh=mesh, placements=[Shard(0)])
    cols = sw.randn(6, 10, device_mesh=mesh, placements=[Shard(1)], dtype=torch.float64)
    partial = sw.randn(3, 2, device_mesh=mesh, placements=[Partial()])
    replicated = sw.rand(5, device_mesh=mesh, placements=[Replicate()], dtype=torch.bfloat16)
    spec = sw.DTensorSpec(mesh, (Shard(0),), sw.TensorMeta(torch.Size([9]), (1,), torch.float32))
    mask = R.random_block("bernoulli", spec, p=0.25)  # the block of a spec, for other ops to use
    tensors = [(t.to_local(), t.full_tensor()) for t in (rows, cols, partial, replicated)]
    return tensors, mask, R.get_rng_state()


def test_random_dtensors_on_four_ranks(dist):
    """Each rank holds its block of the same global values; every rank ends at the same offset."""
    want = []
    offset = 0
    for fn, shape, dtype in [
        (R.uniform, (10, 3), torch.float32), (R.normal, (6, 10), torch.float64),
        (R.normal, (3, 2), torch.float32), (R.uniform, (5,), torch.bfloat16),
    ]:
        want.append(_whole(fn, shape, seed=21, offset=offset, dtype=dtype))
        offset += -(-math.prod(shape) * (2 if fn is R.normal and dtype == torch.float64 else 1) // 4) * 4
    want_mask = R.bernoulli(0.25, (9,), (0,), (9,), seed=21, offset=offset, dtype=torch.float32)
    offset += 12
    for rank, (tensors, mask, state) in enumerate(dist.run(4, _random_dtensors)):
        assert state == (21, offset)
        assert torch.equal(mask, want_mask[3 * rank : 3 * rank + 3])  # (3, 3, 3, 0) rows
        (rows, rows_full), (cols, cols_full), (partial, partial_full), (rep, rep_full) = tensors
        for full, expected in zip((rows_full, cols_full, partial_full, rep_full), want):
            assert torch.equal(full, expected)
        starts = [Shard.chunk(10, 4, k)[1] for k in range(4)] + [10]
        assert torch.equal(rows, want[0][starts[rank] : starts[rank + 1]])
        assert torch.equal(cols, want[1][:, starts[rank] : starts[rank + 1]])
        assert torch.equal(partial, want[2] if rank == 0 else torch.zeros(3, 2))
        assert torch.equal(rep, want[3])
