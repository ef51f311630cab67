"""Reductions and scans on DTensors: values, gradients, Partial inputs/outputs and collectives.

Shapes are uneven over the meshes used ((4,) and (2, 2)); some ranks hold empty blocks.
"""

import warnings

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op

INF = float("inf")

# (name, fn, differentiable): every op of the family on a 2-D input.
CASES_2D = [
    ("sum", lambda x: x.sum(), True),
    ("sum_dim_dtype", lambda x: x.sum(1, dtype=torch.float64), True),
    ("sum_dims_keepdim", lambda x: torch.sum(x, [0, 1], keepdim=True), True),
    ("mean", lambda x: x.mean(), True),
    ("mean_dim_keepdim", lambda x: x.mean(0, keepdim=True), True),
    ("mean_dtype", lambda x: x.mean(1, dtype=torch.float64), True),
    ("amax", lambda x: x.amax(0), True),
    ("amin_keepdim", lambda x: x.amin(1, keepdim=True), True),
    ("max_all", lambda x: x.max(), True),
    ("min_all", lambda x: x.min(), True),
    ("max_dim", lambda x: x.max(0), True),
    ("min_dim_keepdim", lambda x: x.min(1, keepdim=True), True),
    ("argmax", lambda x: x.argmax(0), False),
    ("argmin_flat", lambda x: x.argmin(), False),
    ("argmax_keepdim", lambda x: x.argmax(1, keepdim=True), False),
    ("var", lambda x: x.var(0), True),
    ("var_correction0", lambda x: x.var(1, correction=0), True),
    ("std_all", lambda x: x.std(), True),
    ("std_keepdim", lambda x: x.std(0, keepdim=True), True),
    ("var_mean", lambda x: torch.var_mean(x, 1), True),
    ("std_mean", lambda x: torch.std_mean(x, 0, correction=2), True),
    ("norm", lambda x: x.norm(), True),
    ("norm1_dim", lambda x: torch.linalg.vector_norm(x, 1, dim=0), True),
    ("norm3_keepdim", lambda x: torch.linalg.vector_norm(x, 3, dim=1, keepdim=True), True),
    ("norm_inf", lambda x: torch.linalg.vector_norm(x, INF), True),
    ("norm_neg_inf_dim", lambda x: torch.linalg.vector_norm(x, -INF, dim=0), True),
    ("norm0", lambda x: torch.linalg.vector_norm(x.relu(), 0), False),
    ("norm_dtype", lambda x: torch.linalg.vector_norm(x, dtype=torch.float64), True),
    ("any", lambda x: (x > 0.5).any(0), False),
    ("all", lambda x: (x > -2).all(), False),
    ("all_dim_float", lambda x: x.relu().all(1), False),
    ("count_nonzero", lambda x: torch.count_nonzero(x.relu(), 0), False),
    ("cumsum", lambda x: x.cumsum(1), True),
    ("cumsum_dim0_dtype", lambda x: x.cumsum(0, dtype=torch.float64), True),
    ("cumprod", lambda x: x.cumprod(1), False),
    ("cummax", lambda x: x.cummax(0), False),
    ("logcumsumexp", lambda x: x.logcumsumexp(1), True),
    ("logsumexp", lambda x: x.logsumexp(0), True),
    ("logsumexp_keepdim", lambda x: torch.logsumexp(x, [0, 1], keepdim=True), True),
    ("prod", lambda x: x.prod(0), False),
    ("prod_all", lambda x: x.prod(), False),
]

# N-D: several reduced dims at once.
CASES_3D = [
    ("sum_02", lambda x: x.sum([0, 2]), True),
    ("mean_01_keepdim", lambda x: x.mean((0, 1), keepdim=True), True),
    ("amax_12", lambda x: x.amax([1, 2]), True),
    ("var_02", lambda x: x.var([0, 2]), True),
    ("std_12_keepdim", lambda x: x.std([1, 2], keepdim=True), True),
    ("norm_02", lambda x: torch.linalg.vector_norm(x, dim=(0, 2)), True),
    ("max_dim2", lambda x: x.max(2), True),
    ("cumsum_2", lambda x: x.cumsum(2), True),
]


def _layouts(mesh_shape, ndim):
    if len(mesh_shape) == 1:
        return [[Shard(d)] for d in range(ndim)] + [[Replicate()]]
    if ndim == 2:
        return [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]]
    return [[Shard(0), Shard(2)], [Shard(2), Shard(1)], [Shard(1), Shard(1)]]


def _family(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    failures = []
    for shape, cases in [((7, 5), CASES_2D), ((5, 3, 6), CASES_3D)]:
        x = torch.randn(shape)
        for layout in _layouts(mesh_shape, len(shape)):
            for name, fn, grad in cases:
                fn.__name__ = name
                failures += check_op(fn, [x], [layout], mesh, grad=grad)
    return failures


def test_reductions_values_and_gradients(dist):
    for shape in [(4,), (2, 2)]:
        assert_no_failures(dist.run(4, _family, shape))


def _backward_with_plain_factories():
    """prod / cumprod / cummax backward formulas build plain tensors (``ones``, ``zeros``) for
    tensor subclasses, so their gradients need implicit replication; forwards need nothing."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(1)
    x = torch.rand(5, 7) + 0.5
    failures = []
    with sw.implicit_replication():
        for layout in _layouts((2, 2), 2):
            for fn in (lambda t: t.prod(0), lambda t: t.prod(), lambda t: t.cumprod(1), lambda t: t.cummax(0)[0]):
                failures += check_op(fn, [x], [layout], mesh)
    return failures


def test_backward_with_plain_factories(dist):
    assert_no_failures(dist.run(4, _backward_with_plain_factories))


def _partial(mesh, parts: torch.Tensor, op: str) -> DTensor:
    return DTensor.from_local(parts[dist.get_rank()].clone(), mesh, [Partial(op)])


def _run(fn):
    """(value, placements, comm counts) of ``fn()``."""
    with CommDebugMode() as comms:
        out = fn()
        placements = out.placements
    return out.full_tensor(), placements, comms.get_comm_counts()


def _partial_cases():
    """Pending reductions: kept where they commute with the reduction, reduced first otherwise."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    parts = torch.randn(4, 6, 5)
    total, average, biggest = parts.sum(0), parts.mean(0), parts.amax(0)
    psum, pavg, pmax = _partial(mesh, parts, "sum"), _partial(mesh, parts, "avg"), _partial(mesh, parts, "max")
    fractions = DTensor.from_local(torch.full((6, 5), 0.6), mesh, [Partial()])  # 2.4: trunc per rank is 0
    P = (Partial("sum"),)
    # name: (computation, expected value, expected placements or None, expected comms or None)
    cases = {
        "sum_of_sum_stays": (lambda: psum.sum(0), total.sum(0), P, {}),
        "sum_all_of_sum_stays": (lambda: psum.sum(), total.sum(), P, {}),
        "sum_of_avg_stays": (lambda: pavg.sum(1), average.sum(1), (Partial("avg"),), {}),
        "mean_of_avg": (lambda: pavg.mean(), average.mean(), (Partial("avg"),), {}),
        "mean_of_avg_dim": (lambda: pavg.mean(0), average.mean(0), None, {}),
        "mean_of_sum_stays": (lambda: psum.mean(1), total.mean(1), P, {}),
        "cumsum_of_sum_stays": (lambda: psum.cumsum(0), total.cumsum(0), P, {}),
        "amax_of_max_stays": (lambda: pmax.amax(1), biggest.amax(1), (Partial("max"),), {}),
        "max_of_max_stays": (lambda: pmax.max(), biggest.max(), (Partial("max"),), {}),
        "amin_of_max": (lambda: pmax.amin(0), biggest.amin(0), None, None),
        "sum_of_max": (lambda: pmax.sum(0), biggest.sum(0), None, None),
        "amax_of_sum": (lambda: psum.amax(0), total.amax(0), None, None),
        "sum_to_int_of_sum": (lambda: fractions.sum(dtype=torch.int64), torch.full((6, 5), 2.4).sum(dtype=torch.int64), None, None),
        "prod_of_sum": (lambda: psum.prod(1), total.prod(1), None, None),
        "var_of_sum": (lambda: psum.var(0), total.var(0), None, None),
        "var_of_avg": (lambda: pavg.var(1), average.var(1), None, None),
        "norm_of_sum": (lambda: torch.linalg.vector_norm(psum), torch.linalg.vector_norm(total), None, None),
        "norm_inf_of_max": (lambda: torch.linalg.vector_norm(pmax, INF, dim=1), torch.linalg.vector_norm(biggest, INF, dim=1), None, None),
        "max_dim_of_sum": (lambda: psum.max(1)[0], total.max(1)[0], None, None),
        "argmax_of_sum": (lambda: psum.argmax(0), total.argmax(0), None, None),
        "any_of_sum": (lambda: psum.gt(0.5).any(1), total.gt(0.5).any(1), None, None),
        "cumsum_of_max": (lambda: pmax.cumsum(1), biggest.cumsum(1), None, None),
    }
    wrong = []
    for name, (fn, want, placements, comms) in cases.items():
        got, got_placements, got_comms = _run(fn)
        if not torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-5):
            wrong.append(f"{name}: value")
        if placements is not None and got_placements != placements:
            wrong.append(f"{name}: placements {got_placements} != {placements}")
        if comms is not None and got_comms != comms:
            wrong.append(f"{name}: comms {got_comms} != {comms}")
    return wrong


def _mixed_pending_2d():
    """Pending avg on one mesh axis, a sharded dim on the other. Reducing the sharded dim would
    need Partial(avg) and Partial(sum) at once, which a DTensor cannot carry: the avg is reduced
    first. Keeping the sharded dim keeps the avg without communication."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    parts = torch.randn(2, 6, 5)  # one contribution per coordinate on axis 0
    average = parts.mean(0)
    row, column = mesh.get_coordinate()
    block = parts[row].chunk(2, dim=0)[column].clone()
    x = DTensor.from_local(block, mesh, [Partial("avg"), Shard(0)], shape=(6, 5), stride=(5, 1))
    wrong = []
    cases = [("sum", lambda t: t.sum(0), average.sum(0), None), ("mean", lambda t: t.mean(), average.mean(), None),
             ("sum_kept", lambda t: t.sum(1), average.sum(1), (Partial("avg"), Shard(0)))]
    for name, fn, want, placements in cases:
        with CommDebugMode() as mode:
            out = fn(x)
        if placements is not None and (out.placements != placements or mode.get_total_counts() != 0):
            wrong.append(f"{name}: {out.placements} with {mode.get_comm_counts()}")
        if not torch.allclose(out.full_tensor(), want, atol=1e-5):
            wrong.append(f"{name}: value")
    return wrong


def test_partial_inputs(dist):
    assert_no_failures(dist.run(4, _partial_cases))
    assert_no_failures(dist.run(4, _mixed_pending_2d))


def _collectives():
    """The communication each reduction pattern needs (uneven blocks, one rank empty)."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = torch.randn(7, 3)
    row = sw.distribute_tensor(x, mesh, [Shard(0)])  # 2, 2, 2, 1 rows
    col = sw.distribute_tensor(x, mesh, [Shard(1)])  # 1, 1, 1, 0 columns: rank 3 is empty
    wrong = []

    def expect(name, fn, want, comms, placements=None):
        with CommDebugMode() as mode:
            out = fn()
        got = out if isinstance(out, tuple) else (out,)
        values = [o.full_tensor() for o in got]
        wants = want if isinstance(want, tuple) else (want,)
        if not all(torch.allclose(v.double(), w.double(), atol=1e-5) for v, w in zip(values, wants)):
            wrong.append(f"{name}: value")
        if mode.get_comm_counts() != comms:
            wrong.append(f"{name}: comms {mode.get_comm_counts()} != {comms}")
        if placements is not None and got[0].placements != placements:
            wrong.append(f"{name}: placements {got[0].placements} != {placements}")

    # A reduced sharded dim: a pending reduction, no communication until needed.
    expect("sum over shards is partial", lambda: row.sum(0), x.sum(0), {}, (Partial(),))
    expect("mean of uneven shards", lambda: row.mean(0), x.mean(0), {}, (Partial(),))
    expect("mean of all, uneven", lambda: col.mean(), x.mean(), {}, (Partial(),))
    expect("amax with an empty block", lambda: col.amax(1), x.amax(1), {}, (Partial("max"),))
    expect("max() with an empty block", lambda: col.max(), x.max(), {}, (Partial("max"),))
    expect("min() with an empty block", lambda: col.min(), x.min(), {}, (Partial("min"),))
    # A surviving sharded dim stays sharded.
    expect("sum keeps other dim", lambda: row.sum(1), x.sum(1), {}, (Shard(0),))
    expect("var keeps other dim", lambda: row.var(1), x.var(1), {}, (Shard(0),))
    expect("argmax keeps other dim", lambda: col.argmax(0), x.argmax(0), {}, (Shard(0),))
    expect("cumsum keeps other dim", lambda: row.cumsum(1), x.cumsum(1), {}, (Shard(0),))
    # Statistics over a sharded dim: small all_reduces of results, never a gather of the input.
    expect("var over shards", lambda: row.var(0), x.var(0), {"all_reduce": 1}, (Partial(),))
    expect("std over shards", lambda: row.std(0), x.std(0), {"all_reduce": 1, "reduce_scatter": 1})
    expect("norm over shards", lambda: torch.linalg.vector_norm(col), torch.linalg.vector_norm(x), {"all_reduce": 1})
    expect("norm inf, empty block", lambda: torch.linalg.vector_norm(col, INF), torch.linalg.vector_norm(x, INF), {}, (Partial("max"),))
    expect("any over shards", lambda: (row > 1).any(), (x > 1).any(), {"all_reduce": 1})
    # No collective for these: the reduced / scanned dim is made whole (here all_to_all moves the
    # sharding to the other dim, cheaper than gathering), so indices are global.
    expect("max.dim makes its dim whole", lambda: row.max(0), x.max(0), {"all_to_all": 1}, (Shard(0),))
    expect("argmax gives global indices", lambda: row.argmax(0), x.argmax(0), {"all_to_all": 1})
    expect("prod makes its dim whole", lambda: row.prod(0), x.prod(0), {"all_to_all": 1})
    expect("cumsum makes its dim whole", lambda: row.cumsum(0), x.cumsum(0), {"all_to_all": 1}, (Shard(1),))
    expect("logsumexp over shards", lambda: row.logsumexp(0), x.logsumexp(0), {"all_reduce": 1, "reduce_scatter": 1})
    # Reading a pending sum is one all_reduce.
    with CommDebugMode() as mode:
        row.sum().full_tensor()
    if mode.get_comm_counts() != {"all_reduce": 1}:
        wrong.append(f"full_tensor of a partial sum: {mode.get_comm_counts()}")
    return wrong


def test_reduction_collectives(dist):
    assert_no_failures(dist.run(4, _collectives))


def _empty_and_edge():
    """Ranks with empty blocks; 0-dim and 1-element tensors; integer, bool and bfloat16 inputs."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    failures = []
    x = torch.randn(3, 1)  # dim 1 has one column: some ranks are empty when it is sharded
    for layout in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)]):
        for fn in (lambda t: t.amax(), lambda t: t.amin(0), lambda t: t.sum(), lambda t: t.mean(0),
                   lambda t: t.var(), lambda t: torch.linalg.vector_norm(t, INF), lambda t: t.max()):
            failures += check_op(fn, [x], [layout], mesh)
    ints = torch.randint(-5, 5, (6, 5))
    for layout in ([Shard(0), Shard(1)], [Replicate(), Shard(0)]):
        for fn in (lambda t: t.sum(0), lambda t: t.amax(), lambda t: t.prod(1), lambda t: t.cumsum(0),
                   lambda t: t.mean(0, dtype=torch.float32), lambda t: t.bool().any(1), lambda t: t.bool().all(),
                   lambda t: t.max(1), lambda t: t.argmin(0)):
            failures += check_op(fn, [ints], [layout], mesh, grad=False)
    half = torch.randn(7, 5).bfloat16()
    for layout in ([Shard(0), Shard(1)], [Replicate(), Shard(1)]):
        for fn in (lambda t: t.mean(0), lambda t: t.var(), lambda t: t.norm(dim=0), lambda t: t.sum(1),
                   lambda t: t.logsumexp(0), lambda t: t.std(1)):
            failures += check_op(fn, [half], [layout], mesh, grad=False, atol=2e-2, rtol=2e-2)
    scalar = torch.tensor(3.0)
    failures += check_op(lambda t: (t.sum(), t.mean(), t.amax(), t.norm()), [scalar], [[Replicate(), Replicate()]], mesh)
    return failures


def test_empty_blocks_and_dtypes(dist):
    assert_no_failures(dist.run(4, _empty_and_edge))


def test_reduced_dims_helper():
    from shardwise.dispatch.ops.reduction import reduced_dims

    assert reduced_dims(3, None) == (0, 1, 2)
    assert reduced_dims(3, []) == (0, 1, 2)
    assert reduced_dims(3, -1) == (2,)
    assert reduced_dims(3, [2, 0, -3]) == (0, 2)
    assert reduced_dims(0, None) == ()


_EMPTY_CASES = [((0,), None), ((0, 3), 0), ((2, 0), 1), ((2, 0), None)]
_STATS = ("var", "std", "var_mean", "std_mean", "mean", "sum")


def _empty_statistics():
    mesh = sw.init_device_mesh("cpu", (4,))
    results = {}
    for shape, dim in _EMPTY_CASES:
        for placements in ([Replicate()], [Shard(0)]):
            x = sw.distribute_tensor(torch.zeros(shape), mesh, placements)
            for name in _STATS:
                out = getattr(torch, name)(x) if dim is None else getattr(torch, name)(x, dim=dim)
                out = out if isinstance(out, tuple) else (out,)
                results[(shape, dim, str(placements), name)] = [t.full_tensor() for t in out]
    return results


def test_statistics_of_empty_tensors_match_single_device(dist):
    """A reduced dim of length 0 gives NaN (var, mean) or 0 (sum) as on one device, not garbage."""
    for results in dist.run(4, _empty_statistics):
        for (shape, dim, _, name), got in results.items():
            x = torch.zeros(shape)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # degrees of freedom <= 0
                want = getattr(torch, name)(x) if dim is None else getattr(torch, name)(x, dim=dim)
            want = want if isinstance(want, tuple) else (want,)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, equal_nan=True)


def _extremum_with_empty_blocks():
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.zeros(5, 0, 5), mesh, [Shard(0)])  # rank 3's block is empty
    lo, hi = torch.aminmax(x, dim=0)
    return tuple(torch.amax(x, dim=0).shape), tuple(lo.full_tensor().shape), tuple(hi.full_tensor().shape)


def _extremum_over_an_empty_dim():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.amax(sw.distribute_tensor(torch.zeros(5, 0, 5), mesh, [Shard(0)]), dim=1)


def test_extremum_with_empty_blocks_agrees_on_every_rank(dist):
    """An empty block of the reduced (sharded) dim does not make one rank raise alone; a dim
    that is empty globally raises on every rank, as on one device."""
    assert dist.run(4, _extremum_with_empty_blocks) == [((0, 5), (0, 5), (0, 5))] * 4
    dist.run_expect_error(4, _extremum_over_an_empty_dim, exc_type=RuntimeError,
                          match=r"zero-size dimension(.|\n)*on DTensors: aten\.amax")
