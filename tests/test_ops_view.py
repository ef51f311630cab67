"""View and shape ops on DTensors: values and gradients against single-device results, and the
layouts that must survive a reshape without communication."""

import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op, layouts_for

# (name, fn, number of inputs) applied to x of shape (5, 6, 8) [and y of shape (5, 6, 8)].
_CASES = [
    ("view_split_last", lambda x: x.view(5, 6, 2, 4)),
    ("view_minus_one", lambda x: x.view(5, 6, -1, 4)),
    ("view_merge_first", lambda x: x.view(30, 8)),
    ("view_merge_last", lambda x: x.view(5, 48)),
    ("view_regroup", lambda x: x.view(10, 3, 8)),
    ("reshape_all", lambda x: x.reshape(-1)),
    ("flatten", lambda x: x.flatten(1)),
    ("unflatten", lambda x: x.unflatten(2, (4, 2))),
    ("view_size_one", lambda x: x.view(5, 1, 6, 8, 1)),
    ("transpose", lambda x: x.transpose(0, 2)),
    ("t", lambda x: x[:, 0].t()),
    ("permute", lambda x: x.permute(2, 0, 1)),
    ("transpose_reshape", lambda x: x.transpose(1, 2).reshape(5, 48)),
    ("contiguous", lambda x: x.transpose(0, 1).contiguous()),
    ("unsqueeze_squeeze", lambda x: x.unsqueeze(1).unsqueeze(-1).squeeze(1).squeeze()),
    ("squeeze_dim_noop", lambda x: x.squeeze(0)),
    ("expand", lambda x: x[:, :1].expand(5, 6, 8) + x),
    ("expand_new_dims", lambda x: x[0].expand(3, 6, 8)),
    ("repeat", lambda x: x.repeat(1, 2, 1)),
    ("repeat_new_dim", lambda x: x.repeat(2, 1, 1, 1)),
    ("slice", lambda x: x[1:4]),
    ("slice_step", lambda x: x[:, ::2, 1:-1]),
    ("slice_full", lambda x: x[:, :]),
    ("select", lambda x: x[:, 2]),
    ("select_negative", lambda x: x[..., -1]),
    ("narrow", lambda x: x.narrow(1, 2, 3)),
    ("split", lambda x: x.split(3, dim=1)),
    ("split_sizes", lambda x: x.split([1, 4, 3], dim=2)),
    ("chunk", lambda x: x.chunk(2, dim=0)),
    ("unbind", lambda x: x.unbind(1)),
    ("cat", lambda x: torch.cat([x, x * 2], dim=1)),
    ("cat_dim0", lambda x: torch.cat([x, x[:2]], dim=0)),
    ("stack", lambda x: torch.stack([x, x + 1], dim=1)),
    ("to_double", lambda x: x.to(torch.float64)),
    ("broadcast_add", lambda x: x + x[:1, :, :1]),
]


def _run_cases(mesh, layouts) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(5, 6, 8)
    failures = []
    for name, fn in _CASES:
        fn.__name__ = name
        for layout in layouts:
            failures += check_op(fn, [x], [layout], mesh)
    return failures


def _views_1d():
    mesh = sw.init_device_mesh("cpu", (4,))
    return _run_cases(mesh, layouts_for(1, 3, partial=True))


def _views_2d():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    layouts = layouts_for(2, 3) + [[Shard(0), Shard(0)], [Shard(2), Shard(2)], [Shard(2), Shard(1)]]
    return _run_cases(mesh, layouts)


def test_view_ops_match_single_device_on_a_1d_mesh(dist):
    assert_no_failures(dist.run(4, _views_1d, timeout=300))


def test_view_ops_match_single_device_on_a_2d_mesh(dist):
    assert_no_failures(dist.run(4, _views_2d, timeout=300))


def _new_tensors():
    failures = []
    for shape in [(4,), (2, 2)]:
        mesh = sw.init_device_mesh("cpu", shape)
        torch.manual_seed(0)
        x = torch.randn(5, 6)
        for layout in layouts_for(len(shape), 2):
            for fn in [lambda t: t.new_zeros(3, 4), lambda t: t.new_ones(5, 6), lambda t: t.new_full((5, 6), 2.0),
                       lambda t: t.new_empty(5, 6).zero_() + t]:
                failures += check_op(fn, [x], [layout], mesh, grad=False)
    return failures


def test_new_tensors_take_the_layout_of_a_same_shaped_self(dist):
    assert_no_failures(dist.run(4, _new_tensors, timeout=300))


# ---------------------------------------------------------------------- layouts kept
def _heads_view():
    """A column-sharded projection viewed as heads stays sharded on the heads dim, for free."""
    out = {}
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    bsz, seqlen, heads, head_dim = 2, 3, 8, 4
    x = torch.randn(bsz, seqlen, heads * head_dim)
    dx = sw.distribute_tensor(x, mesh, [Shard(-1)])
    with CommDebugMode() as comms:
        q = dx.view(bsz, seqlen, -1, head_dim)
        qt = q.transpose(1, 2)
        back = qt.transpose(1, 2).reshape(bsz, seqlen, -1)
    out["heads"] = (q.placements, qt.placements, back.placements, comms.get_total_counts())
    out["heads_values"] = torch.equal(q.full_tensor(), x.view(bsz, seqlen, -1, head_dim))
    # 2-D mesh: batch on one axis, heads on the other.
    mesh2 = sw.init_device_mesh("cpu", (2, 2))
    dx2 = sw.distribute_tensor(x, mesh2, [Shard(0), Shard(2)])
    with CommDebugMode() as comms:
        q2 = dx2.view(bsz, seqlen, -1, head_dim)
    out["heads_2d"] = (q2.placements, comms.get_total_counts())
    out["heads_2d_values"] = torch.equal(q2.full_tensor(), x.view(bsz, seqlen, -1, head_dim))
    # 6 heads over 4 ranks: blocks of 12 columns are 1.5 heads, the heads dim cannot be sharded.
    y = torch.randn(bsz, seqlen, 6 * head_dim)
    dy = sw.distribute_tensor(y, mesh, [Shard(2)])
    with CommDebugMode() as comms:
        q3 = dy.view(bsz, seqlen, -1, head_dim)
    out["uneven_heads"] = (q3.placements != (Shard(2),), comms.get_total_counts() > 0)
    out["uneven_heads_values"] = torch.equal(q3.full_tensor(), y.view(bsz, seqlen, -1, head_dim))
    return out


def test_view_with_minus_one_keeps_heads_sharded_without_communication(dist):
    for out in dist.run(4, _heads_view):
        assert out["heads"] == ((Shard(2),), (Shard(1),), (Shard(2),), 0)
        assert out["heads_2d"] == ((Shard(0), Shard(2)), 0)
        assert out["heads_values"] and out["heads_2d_values"]
        assert out["uneven_heads"] == (True, True) and out["uneven_heads_values"]


def _flatten_layouts():
    mesh = sw.init_device_mesh("cpu", (4,))
    out = {}

    def flat(shape, placements):
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        d = sw.distribute_tensor(x, mesh, placements)
        with CommDebugMode() as comms:
            f = d.flatten(0, 1)
        return f.placements, comms.get_total_counts(), torch.equal(f.full_tensor(), x.flatten(0, 1))

    out["even"] = flat((8, 3, 2), [Shard(0)])          # B divisible: Shard(0) kept
    out["uneven_aligned"] = flat((3, 2, 2), [Shard(0)])  # blocks 1,1,1,0 rows = 2,2,2,0 of 6
    out["uneven_misaligned"] = flat((5, 2, 2), [Shard(0)])  # 2,2,1,0 rows != chunks 3,3,3,1 of 10
    out["inner_dim"] = flat((4, 8, 2), [Shard(1)])     # sharded dim is not the leading factor
    x = torch.arange(24.0).reshape(4, 6)
    d = sw.distribute_tensor(x, mesh, [Shard(1)]).view(24)
    out["inner_dim_view"] = torch.equal(d.full_tensor(), x.view(24))
    return out


def test_flatten_keeps_the_leading_shard_only_when_blocks_line_up(dist):
    for out in dist.run(4, _flatten_layouts):
        assert out["even"] == ((Shard(0),), 0, True)
        assert out["uneven_aligned"] == ((Shard(0),), 0, True)
        placements, comms, ok = out["uneven_misaligned"]
        assert ok and comms > 0 and placements != (Shard(0),)
        placements, comms, ok = out["inner_dim"]
        assert ok and comms > 0
        assert out["inner_dim_view"]


def _shards_kept():
    """Ops that leave the sharded dim whole keep it, without communication."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    x = torch.randn(6, 7, 5)
    d = sw.distribute_tensor(x, mesh, [Shard(1), Shard(2)])
    cases = {
        "cat": (lambda t: torch.cat([t, t], dim=0), (Shard(1), Shard(2))),
        "stack": (lambda t: torch.stack([t, t], dim=1), (Shard(2), Shard(3))),
        "select": (lambda t: t[3], (Shard(0), Shard(1))),
        "slice": (lambda t: t[1:4], (Shard(1), Shard(2))),
        "split": (lambda t: t.split(4)[1], (Shard(1), Shard(2))),
        "unbind": (lambda t: t.unbind(0)[2], (Shard(0), Shard(1))),
        "permute": (lambda t: t.permute(2, 0, 1), (Shard(2), Shard(0))),
        "unsqueeze": (lambda t: t.unsqueeze(0), (Shard(2), Shard(3))),
        "expand": (lambda t: t[:1].expand(4, 7, 5), (Shard(1), Shard(2))),
        "repeat": (lambda t: t.repeat(2, 1, 1), (Shard(1), Shard(2))),
        "transpose": (lambda t: t.transpose(0, 2), (Shard(1), Shard(0))),
    }
    out = {}
    for name, (fn, want) in cases.items():
        with CommDebugMode() as comms:
            y = fn(d)
        out[name] = (y.placements == want, comms.get_total_counts(), torch.equal(y.full_tensor(), fn(x)))
    return out


def test_ops_leaving_the_sharded_dim_whole_keep_it(dist):
    for out in dist.run(4, _shards_kept):
        bad = {k: v for k, v in out.items() if v != (True, 0, True)}
        assert not bad, bad


def _partial_passes():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    parts = torch.randn(4, 6, 8)
    p = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])
    want = parts.sum(0)
    with CommDebugMode() as comms:
        ys = [p.view(6, 2, 4), p.t(), p[1:3], p[:, 2], p.unsqueeze(0).expand(3, 6, 8), torch.cat([p, p]), p.reshape(-1)]
    placements = [y.placements for y in ys]
    refs = [want.view(6, 2, 4), want.t(), want[1:3], want[:, 2], want.unsqueeze(0).expand(3, 6, 8), torch.cat([want, want]), want.reshape(-1)]
    values = all(torch.allclose(y.full_tensor(), r, atol=1e-5) for y, r in zip(ys, refs))
    return placements, comms.get_total_counts(), values


def test_partial_passes_through_views_without_communication(dist):
    for placements, comms, values in dist.run(4, _partial_passes):
        assert all(pl == (Partial(),) for pl in placements) and comms == 0 and values


def _as_strided_replicated():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.arange(24.0).reshape(4, 6)
    out = []
    for placements in [[Replicate(), Replicate()], [Shard(0), Shard(1)]]:
        d = sw.distribute_tensor(x, mesh, placements)
        y = torch.as_strided(d, (3, 2), (6, 2), 1)
        out.append((y.placements, torch.equal(y.full_tensor(), torch.as_strided(x, (3, 2), (6, 2), 1))))
    # Global strides (1, 6) (a transposed view) over a contiguous local copy (strides (4, 1)).
    t = DTensor.from_local(x.t().contiguous(), mesh, [Replicate(), Replicate()], shape=(6, 4), stride=(1, 6))
    out.append((t.as_strided((4,), (6,)).placements, torch.equal(t.as_strided((4,), (6,)).full_tensor(), x.t().as_strided((4,), (6,)))))
    return out


def test_as_strided_runs_on_whole_tensors(dist):
    for results in dist.run(4, _as_strided_replicated):
        for placements, ok in results:
            assert ok and placements == (Replicate(), Replicate())


def _write_through_copied_view():
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.zeros(4, 8), mesh, [Shard(1)])
    x[:, 1:3] = 1.0  # slicing a sharded dim gathers it: the slice is a copy


def _write_through_free_view():
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.zeros(4, 8), mesh, [Shard(0)])
    x[:, 1:3] = 1.0  # the sliced dim is whole: a real view, the write lands
    return x.full_tensor()


def test_writes_through_a_copied_view_fail_loudly(dist):
    dist.run_expect_error(4, _write_through_copied_view, match=r"in-place write into the result of aten.slice.Tensor.*is a copy")
    want = torch.zeros(4, 8)
    want[:, 1:3] = 1.0
    assert all(torch.equal(x, want) for x in dist.run(4, _write_through_free_view))
