"""softmax / log_softmax, layer_norm, rms_norm, nll_loss / cross_entropy on DTensors.

Every case compares values and gradients with the single-device computation (tests/op_check),
on meshes (4,) and (2,2), with uneven shapes (5 rows over 4 ranks) and, for the losses, empty
shards (3 rows over 4 ranks) and ignored targets.
"""

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op, layouts_for

MESHES = [(4,), (2, 2)]
aten = torch.ops.aten


def _rep(mesh) -> list:
    return [Replicate()] * mesh.ndim


def _along(mesh, placement) -> list:
    """``placement`` on the first mesh axis, Replicate on the others."""
    return [placement] + [Replicate()] * (mesh.ndim - 1)


# ---------------------------------------------------------------------- softmax
def _softmax(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(5, 7, 3)
    failures = []
    for layout in layouts_for(mesh.ndim, 3, partial=True):
        failures += check_op(lambda t: F.softmax(t, -1), [x], [layout], mesh)
        failures += check_op(lambda t: F.log_softmax(t, 1), [x], [layout], mesh)
    # Sharded off the softmax dim: no communication at all.
    failures += check_op(lambda t: F.softmax(t, -1), [x], [_along(mesh, Shard(0))], mesh, expect_comms={})
    failures += check_op(lambda t: aten._safe_softmax(t, 1), [x], [_along(mesh, Shard(2))], mesh, expect_comms={})
    # Masked rows (all -inf) are zeros with _safe_softmax, as on one device.
    masked = x.clone()
    masked[1] = float("-inf")
    failures += check_op(lambda t: aten._safe_softmax(t, -1), [masked], [_along(mesh, Shard(0))], mesh, grad=False)
    # The softmax dim sharded: row statistics all-reduced (vocab_parallel), and the result is right.
    failures += check_op(lambda t: F.softmax(t, 0), [x], [_along(mesh, Shard(0))], mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_softmax_and_log_softmax(dist, mesh_shape):
    assert_no_failures(dist.run(4, _softmax, mesh_shape))


def _softmax_layouts():
    """Output layouts: sharding kept off the dim, a Partial upstream gradient passes through."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = sw.distribute_tensor(torch.randn(5, 6), mesh, [Shard(0)])
    out = F.log_softmax(x, -1)
    grad = DTensor.from_local(torch.randn(5, 6), mesh, [Partial()])
    y = F.softmax(sw.distribute_tensor(torch.randn(5, 6), mesh, [Replicate()]), -1)
    with CommDebugMode() as comms:
        back = aten._softmax_backward_data(grad, y, -1, torch.float32)
    return out.placements, back.placements, comms.get_total_counts()


def test_softmax_layouts(dist):
    for placements, back, comms in dist.run(4, _softmax_layouts):
        assert placements == (Shard(0),)
        assert back == (Partial(),) and comms == 0


# ---------------------------------------------------------------------- layer_norm / rms_norm
def _fused_rms_norm(t, shape, w):
    """``aten._fused_rms_norm`` (reached on CUDA builds; on CPU it decomposes above dispatch,
    so the DTensor call is sent to the dispatcher directly to exercise its strategy)."""
    if isinstance(t, DTensor):
        return sw.dispatch.dispatch(aten._fused_rms_norm.default, (t, shape, w, 1e-6), {})[0]
    return aten._fused_rms_norm(t, shape, w, 1e-6)[0]


def _norms(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 8), torch.randn(8), torch.randn(8)
    w2, b2 = torch.randn(3, 8), torch.randn(3, 8)
    rep = _rep(mesh)
    failures = []
    for i, layout in enumerate(layouts_for(mesh.ndim, 3, partial=True)):
        failures += check_op(lambda t, w, b: F.layer_norm(t, (8,), w, b), [x, w, b], [layout, rep, rep], mesh)
        if i >= 5:
            continue
        failures += check_op(lambda t, w, b: F.layer_norm(t, (3, 8), w, b), [x, w2, b2], [layout, rep, rep], mesh)
        failures += check_op(lambda t: F.layer_norm(t, (8,)), [x], [layout], mesh)
        failures += check_op(lambda t, w: _fused_rms_norm(t, [8], w), [x, w], [layout, rep], mesh, grad=False)
        failures += check_op(lambda t: _fused_rms_norm(t, [3, 8], None), [x], [layout], mesh, grad=False)
    # Batch sharded, parameters replicated: no communication in the forward.
    for layout in ([Shard(0), Shard(1)], [Shard(1), Shard(0)]) if mesh.ndim == 2 else ([Shard(0)], [Shard(1)]):
        failures += check_op(lambda t, w, b: F.layer_norm(t, (8,), w, b), [x, w, b], [layout, rep, rep], mesh, expect_comms={})
        failures += check_op(lambda t, w: _fused_rms_norm(t, [8], w), [x, w], [layout, rep], mesh, grad=False, expect_comms={})
    # Sharded parameters are gathered; a sharded normalized dim is gathered.
    failures += check_op(lambda t, w, b: F.layer_norm(t, (8,), w, b), [x, w, b], [_along(mesh, Shard(2)), _along(mesh, Shard(0)), rep], mesh)
    # An empty shard (3 rows over 4 ranks).
    failures += check_op(lambda t, w, b: F.layer_norm(t, (8,), w, b), [x[:3], w, b], [[Shard(0)] * mesh.ndim, rep, rep], mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_layer_norm_and_fused_rms_norm(dist, mesh_shape):
    assert_no_failures(dist.run(4, _norms, mesh_shape))


def _norm_grad_layouts():
    """Parameter gradients of a batch-sharded layer_norm are Partial(sum), and exact."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 8), torch.randn(8), torch.randn(8)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    dw = sw.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    db = sw.distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
    g = torch.randn(7, 8)
    F.layer_norm(dx, (8,), dw, db).backward(sw.distribute_tensor(g, mesh, [Shard(0)]))
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    F.layer_norm(x, (8,), rw, rb).backward(g)
    return (dw.grad.placements, db.grad.placements,
            torch.allclose(dw.grad.full_tensor(), rw.grad, atol=1e-5), torch.allclose(db.grad.full_tensor(), rb.grad, atol=1e-5))


def _fused_rms_norm_backward_plan():
    """No CPU kernel for ``_fused_rms_norm_backward``: check its propagation (layouts) only."""
    from shardwise.dispatch.dispatcher import plan_call

    mesh = sw.init_device_mesh("cpu", (4,))
    rows = lambda t: sw.distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    args = (rows(torch.randn(7, 8)), rows(torch.randn(7, 8)), [8], rows(torch.randn(7, 1)),
            sw.distribute_tensor(torch.randn(8), mesh, [Replicate()]), [True, True])
    plan = plan_call(aten._fused_rms_norm_backward.default, args, {}, [a for a in args if isinstance(a, DTensor)])
    return plan.moves_inputs, [s.placements for s in plan.output_specs]


def test_fused_rms_norm_backward_layouts(dist):
    for moves, outputs in dist.run(4, _fused_rms_norm_backward_plan):
        assert not moves and outputs == [(Shard(0),), (Partial(),)]


def test_layer_norm_parameter_gradients_are_partial(dist):
    for wp, bp, w_ok, b_ok in dist.run(4, _norm_grad_layouts):
        assert wp == (Partial(),) and bp == (Partial(),) and w_ok and b_ok


def _rms_norm(mesh_shape):
    """``F.rms_norm``: on CPU it decomposes (pow, mean, add_, rsqrt, mul) above dispatch."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 8), torch.randn(8)
    rep = _rep(mesh)
    failures = []
    for layout in ([Shard(0)] * mesh.ndim, _along(mesh, Shard(1)), rep):
        failures += check_op(lambda t, w: F.rms_norm(t, (8,), w), [x, w], [layout, rep], mesh)
    for layout in ([Shard(0)] * mesh.ndim, rep):
        failures += check_op(lambda t: F.rms_norm(t, (3, 8)), [x], [layout], mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_functional_rms_norm(dist, mesh_shape):
    assert_no_failures(dist.run(4, _rms_norm, mesh_shape))


def _rms_norm_over_sharded_dim():
    mesh = sw.init_device_mesh("cpu", (4,))
    x, w = torch.randn(5, 8), torch.randn(8)
    return check_op(lambda t, w: F.rms_norm(t, (8,), w), [x, w], [[Shard(1)], [Replicate()]], mesh)


def test_functional_rms_norm_over_a_sharded_normalized_dim(dist):
    assert_no_failures(dist.run(4, _rms_norm_over_sharded_dim))


# ---------------------------------------------------------------------- losses
def _targets(n: int, classes: int, ignored: tuple[int, ...] = ()) -> torch.Tensor:
    t = torch.randint(0, classes, (n,))
    t[list(ignored)] = -100
    return t


def _like(a, value: torch.Tensor):
    """``value`` as a constant next to ``a``: replicated on ``a``'s mesh if ``a`` is a DTensor."""
    if isinstance(a, DTensor):
        return sw.distribute_tensor(value, a.device_mesh, [Replicate()] * a.device_mesh.ndim)
    return value


def _losses(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    rep, rows, first = _rep(mesh), [Shard(0)] * mesh.ndim, _along(mesh, Shard(0))
    weight = torch.rand(6) + 0.5
    failures = []
    cases = [
        (torch.randn(5, 6), _targets(5, 6, (1,))),          # uneven
        (torch.randn(3, 6), _targets(3, 6)),                # an empty shard
        (torch.randn(8, 6), _targets(8, 6, (0, 1, 2, 3))),  # a shard fully ignored
    ]
    for x, t in cases:
        for reduction in ("mean", "sum", "none"):
            failures += check_op(lambda a, b: F.cross_entropy(a, b, reduction=reduction), [x, t], [rows, rows], mesh)
            failures += check_op(lambda a, b: F.cross_entropy(a, b, _like(a, weight), reduction=reduction), [x, t], [rows, rows], mesh)
    x, t = cases[0]
    # Other layouts of the logits: replicated, class dim sharded (gathered), Partial (reduced).
    for lx, lt in ((first, first), (rep, rep), (_along(mesh, Shard(1)), rep), (_along(mesh, Partial()), rows), (rep, rows)):
        failures += check_op(lambda a, b: F.cross_entropy(a, b, _like(a, weight)), [x, t], [lx, lt], mesh)
    for reduction in ("mean", "sum", "none"):
        failures += check_op(lambda a, b: F.nll_loss(F.log_softmax(a, -1), b, ignore_index=2, reduction=reduction), [x, t.clamp(min=0)], [rows, rows], mesh)
    failures += check_op(lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1), [x, t], [rows, rows], mesh)
    failures += check_op(lambda a, b: F.cross_entropy(a, b), [x[0], t[0]], [rep, rep], mesh)  # no batch dim
    # 4-D input: nll_loss2d, sharded on batch or a spatial dim.
    x4, t4 = torch.randn(3, 5, 4, 2), torch.randint(0, 5, (3, 4, 2))
    t4[0, 1, 1] = -100
    for lx, lt in ((rows, rows), (_along(mesh, Shard(2)), _along(mesh, Shard(1))), (rep, first)):
        failures += check_op(lambda a, b: F.cross_entropy(a, b), [x4, t4], [lx, lt], mesh)
    for reduction in ("sum", "none"):
        failures += check_op(lambda a, b: F.cross_entropy(a, b, reduction=reduction), [x4, t4], [rows, rows], mesh)
    # mse_loss: the mean divides by the global element count.
    y = torch.randn(5, 6)
    for reduction in ("mean", "sum", "none"):
        failures += check_op(lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, y], [rows, rows], mesh)
    failures += check_op(lambda a, b: F.mse_loss(a, b), [x, y], [_along(mesh, Shard(1)), rep], mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_cross_entropy_and_nll_loss(dist, mesh_shape):
    assert_no_failures(dist.run(4, _losses, mesh_shape))


def _loss_layouts():
    """Batch-sharded mean: Partial(sum) loss, one scalar all_reduce, no NaN on empty shards."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = sw.distribute_tensor(torch.randn(3, 6), mesh, [Shard(0)])
    t = sw.distribute_tensor(torch.tensor([1, 4, 0]), mesh, [Shard(0)])
    with CommDebugMode() as comms:
        logp = F.log_softmax(x, -1)
        mean = F.nll_loss(logp, t)
    total = F.nll_loss(logp, t, reduction="sum")
    none = F.nll_loss(logp, t, reduction="none")
    return (mean.placements, comms.get_comm_counts(), bool(torch.isnan(mean.to_local()).any()),
            total.placements, none.placements)


def test_loss_layouts_and_empty_shards(dist):
    for mean, comms, nan, total, none in dist.run(4, _loss_layouts):
        assert mean == (Partial(),) and comms == {"all_reduce": 1} and not nan
        assert total == (Partial(),) and none == (Shard(0),)
