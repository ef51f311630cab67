"""Indexing, gather/scatter, sort/topk, fills and item() on DTensors, against single-device
results (values and gradients), plus the layouts and errors that must hold."""

import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op, layouts_for

R = Replicate()


def _put(x, idx, v):
    y = x * 1.0
    y[idx] = v
    return y


def _index_cases(mesh) -> list[str]:
    """x (7, 5, 6) in every layout of the spread; indices plain or replicated DTensors."""
    torch.manual_seed(0)
    x = torch.randn(7, 5, 6)
    rows = torch.tensor([0, 6, 2, 2])
    cols = torch.tensor([[1, 4], [0, 0]])
    rep = [R] * mesh.ndim
    # (fn, extra inputs after x, their layouts[, a dim written in place through an index])
    cases = [
        (lambda x: x[rows], [], []),
        (lambda x: x[:, cols], [], []),
        (lambda x: x[rows, :, rows % 6], [], []),         # non-adjacent: index dims go first
        (lambda x: x[:, torch.tensor([4, 1]), torch.tensor([0, 5])], [], []),  # adjacent pair in the middle
        (lambda x, i: x[i], [rows], [rep]),              # DTensor index
        (lambda x, i: x[:, :, i], [cols], [rep]),
        (lambda x: x.index_select(1, torch.tensor([4, 0, 1])), [], []),
        (lambda x, i: x.index_select(2, i), [torch.tensor([5, 0, 2])], [rep]),
        (lambda x, v: _put(x, (slice(None), torch.tensor([1, 3])), v), [torch.randn(7, 2, 6)], [rep], 1),
        (lambda x, v: torch.index_put(x, (rows[:2],), v, accumulate=True), [torch.randn(6)], [rep]),
        (lambda x: torch.ops.aten.index_put(x, [None, torch.tensor([0, 2])], torch.tensor(3.0)), [], []),
        (lambda x: x.masked_fill(x > 0, 0.5), [], []),
        (lambda x: _put(x, x > 0.5, torch.tensor(0.0)), [], []),                # x[x > .5] = 0
        (lambda x, m: _put(x, (slice(None), m), torch.tensor(2.0)), [torch.rand(5, 6) > 0.5], [None]),
        (lambda x: _put(x, torch.tensor([True, False, True, False, False, True, True]), torch.tensor(1.5)), [], []),
        (lambda x, m: x.masked_fill(m, torch.tensor(0.5)), [torch.rand(5, 1) > 0.5], [rep]),
        (lambda x: torch.where(x > 0, x, torch.zeros(())), [], []),
        (lambda x: x.topk(3, dim=1), [], []),
        (lambda x: x.sort(dim=-1, descending=True), [], []),
        (lambda x: x.argsort(dim=0), [], []),
    ]
    failures = []
    for k, (fn, extra, extra_layouts, *written) in enumerate(cases):
        fn.__name__ = f"index_case_{k}"
        for layout in layouts_for(mesh.ndim, 3, partial=mesh.ndim == 1):
            if written and Shard(written[0]) in layout:
                continue  # written in place along a sharded indexed dim: an error (see below)
            failures += check_op(fn, [x] + extra, [layout] + extra_layouts, mesh)
    return failures


def _gather_cases(mesh) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(7, 6)
    idx = torch.randint(0, 6, (7, 6))
    narrow_idx = torch.randint(0, 6, (7, 3))
    src = torch.randn(7, 6)
    cases = [
        (lambda x, i: x.gather(1, i), [x, idx]),
        (lambda x, i: x.gather(1, i), [x, narrow_idx]),
        (lambda x, i, s: x.scatter(1, i, s), [x, idx, src]),
        (lambda x, i, s: x.scatter_add(1, i, s), [x, idx, src]),
        (lambda x, i: x.scatter(1, i, 2.0), [x, idx]),
        (lambda x, i, s: x.scatter_reduce(1, i, s, "amax"), [x, idx, src]),
    ]
    failures = []
    for k, (fn, inputs) in enumerate(cases):
        fn.__name__ = f"gather_case_{k}"
        for la in layouts_for(mesh.ndim, 2, partial=mesh.ndim == 1):
            for li in ([R] * mesh.ndim, la):
                layouts = [la, li] + ([la] if len(inputs) == 3 else [])
                if inputs[1].shape != x.shape and li is la:
                    continue
                failures += check_op(fn, inputs, layouts, mesh)
    return failures


def _fill_cases(mesh) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(7, 6)
    cases = [
        lambda x: (x * 1.0).fill_(2.5),
        lambda x: (x * 1.0).zero_() + x,
        lambda x: torch.zeros_like(x).fill_(x.sum()),
    ]
    failures = []
    for k, fn in enumerate(cases):
        fn.__name__ = f"fill_case_{k}"
        for la in layouts_for(mesh.ndim, 2, partial=mesh.ndim == 1):
            failures += check_op(fn, [x], [la], mesh)
    return failures


def _all_cases(mesh_shape, part):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    return {"index": _index_cases, "gather": _gather_cases, "fill": _fill_cases}[part](mesh)


def test_indexing_matches_single_device_on_a_1d_mesh(dist):
    assert_no_failures(dist.run(4, _all_cases, (4,), "index", timeout=300))


def test_indexing_matches_single_device_on_a_2d_mesh(dist):
    assert_no_failures(dist.run(4, _all_cases, (2, 2), "index", timeout=300))


def test_gather_scatter_and_fills_match_single_device(dist):
    for shape in [(4,), (2, 2)]:
        assert_no_failures(dist.run(4, _all_cases, shape, "gather", timeout=300))
        assert_no_failures(dist.run(4, _all_cases, shape, "fill", timeout=300))


# ---------------------------------------------------------------------- layouts kept
def _layouts_kept():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = torch.randn(7, 9)
    out = {}
    d = sw.distribute_tensor(x, mesh, [Shard(1)])
    idx = torch.tensor([3, 0, 6])
    with CommDebugMode() as comms:
        y = d[idx]
    out["rows_of_col_sharded"] = (y.placements, comms.get_total_counts(), torch.equal(y.full_tensor(), x[idx]))
    # A sharded index with replicated data: each rank looks up its own positions.
    table = sw.distribute_tensor(x, mesh, [R])
    ids = sw.distribute_tensor(torch.tensor([1, 5, 2, 2, 0, 6, 3, 4]), mesh, [Shard(0)])
    with CommDebugMode() as comms:
        z = table[ids]
    out["sharded_index"] = (z.placements, comms.get_total_counts(), torch.equal(z.full_tensor(), x[ids.full_tensor()]))
    with CommDebugMode() as comms:
        values, order = d.topk(2, dim=0)
    out["topk"] = (values.placements, order.placements, comms.get_total_counts(),
                   torch.equal(values.full_tensor(), x.topk(2, dim=0).values))
    # Masked fills through index_put stay local: the mask is sharded (or cut) like the data.
    m = sw.distribute_tensor(x, mesh, [Shard(0)])
    rows = torch.tensor([True, False, False, True, True, False, True])
    with CommDebugMode() as comms:
        m[m < 0] = 0.0
        m[rows] = 9.0
    want = x.clone()
    want[want < 0] = 0.0
    want[rows] = 9.0
    out["mask_fill"] = (m.placements, comms.get_total_counts(), torch.equal(m.full_tensor(), want))
    # The sorted dim is sharded: it is gathered first, and the result is still right.
    s = sw.distribute_tensor(x, mesh, [Shard(0)]).sort(dim=0)
    out["sort_sharded_dim"] = torch.equal(s.values.full_tensor(), x.sort(dim=0).values)
    return out


def test_indexing_and_sorting_keep_the_other_dims_sharded(dist):
    for out in dist.run(4, _layouts_kept):
        assert out["rows_of_col_sharded"] == ((Shard(1),), 0, True)
        assert out["sharded_index"] == ((Shard(0),), 0, True)
        assert out["topk"] == ((Shard(1),), (Shard(1),), 0, True)
        assert out["mask_fill"] == ((Shard(0),), 0, True)
        assert out["sort_sharded_dim"]


def _item_and_equal():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.arange(12.0).reshape(4, 3)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    total = d.sum().item()
    first = d[1, 2].item()
    same = torch.equal(d, sw.distribute_tensor(x.clone(), mesh, [Shard(1), R]))
    other = torch.equal(d, sw.distribute_tensor(x + 1, mesh, [Shard(0), Shard(1)]))
    sizes = (torch.is_same_size(d, d * 2), torch.is_same_size(d, d[1:]))
    return total, first, same, other, sizes


def test_item_and_equal_read_the_whole_value(dist):
    for total, first, same, other, sizes in dist.run(4, _item_and_equal):
        assert total == 66.0 and first == 5.0 and isinstance(total, float)
        assert same is True and other is False and sizes == (True, False)


def _fill_partial():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = torch.distributed.get_rank()
    p = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    m = DTensor.from_local(torch.ones(3) * rank, mesh, [Partial("max")])
    s = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with CommDebugMode() as comms:
        p.zero_()
        m.fill_(7.0)
    kept = (p.placements, p.full_tensor(), m.placements, m.full_tensor(), comms.get_total_counts())
    # Writing 2 on every rank of a Partial(sum) would mean 8: rank 0 writes 2, the others 0.
    with CommDebugMode() as comms:
        same = s.fill_(2.0) is s
    written = (same, s.placements, s.full_tensor(), comms.get_total_counts())
    return kept, written


def test_fill_keeps_layout_rules_honest_for_partial(dist):
    for kept, written in dist.run(4, _fill_partial):
        placements, value, mplacements, mvalue, comms = kept
        assert placements == (Partial(),) and torch.equal(value, torch.zeros(3))
        assert mplacements == (Partial("max"),) and torch.equal(mvalue, torch.full((3,), 7.0)) and comms == 0
        same, splacements, svalue, scomms = written
        assert same and splacements == (Partial(),) and scomms == 0
        assert torch.equal(svalue, torch.full((3,), 2.0))


def _plain_source_is_data():
    mesh = sw.init_device_mesh("cpu", (4,))
    d = sw.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    d.index_add(1, torch.tensor([0, 1]), torch.randn(8, 2))  # the index may be plain, the source not


def _plain_gather_index():
    mesh = sw.init_device_mesh("cpu", (4,))
    d = sw.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    d.gather(1, torch.zeros(8, 2, dtype=torch.long))  # gather's index is data-shaped: no exemption


def test_plain_tensors_are_only_accepted_as_integer_indices(dist):
    dist.run_expect_error(4, _plain_source_is_data, match=r"aten\.index_add.*argument #3 is a plain tensor")
    dist.run_expect_error(4, _plain_gather_index, match=r"aten\.gather.*argument #2 is a plain tensor")


def _put_into_sharded_indexed_dim():
    mesh = sw.init_device_mesh("cpu", (4,))
    d = sw.distribute_tensor(torch.zeros(4, 8), mesh, [Shard(1)])
    block = d._local_tensor
    d[:, torch.tensor([1, 5])] = sw.distribute_tensor(torch.ones(4, 2), mesh, [R])
    return d.placements, d._local_tensor is block, d.full_tensor()


def test_writing_in_place_along_a_sharded_indexed_dim_keeps_the_layout(dist):
    # The write runs in a layout where dim 1 is whole and lands back in self's own block.
    expected = torch.zeros(4, 8)
    expected[:, [1, 5]] = 1
    for placements, same_block, value in dist.run(4, _put_into_sharded_indexed_dim):
        assert placements == (Shard(1),) and same_block and torch.equal(value, expected)
