"""Matrix products on DTensors: mm, bmm, addmm, baddbmm, mv, dot, and matmul / linear / einsum.

Values and gradients against single-device results on meshes (4,) and (2, 2) with uneven
shapes (7 rows, and 5 contracted over 4 ranks: one rank's slice is empty), plus the seed 5.2.1
signatures pinned with the collectives they use. Gradients and the composites also exercise the
view ops (t, transpose, view, expand, permute) of ``ops/view.py``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op, layouts_for

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()


def _meshes():
    return [sw.init_device_mesh("cpu", (4,)), sw.init_device_mesh("cpu", (2, 2))]


def _operand_layouts(mesh_ndim: int) -> list[list]:
    """Layouts for a 2-D operand: replicated, sharded on each dim, Partial, nested (2-D mesh)."""
    if mesh_ndim == 1:
        return [[R], [S0], [S1], [P], [Partial("avg")]]
    return [[R, R], [S0, S1], [S1, S0], [S0, S0], [P, S1], [S1, P], [R, S1]]


# ---------------------------------------------------------------------- values
def _values(grad: bool):
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(5, 6)
    bias_row, bias_full = torch.randn(6), torch.randn(7, 6)
    a3, b3, bias3 = torch.randn(3, 7, 5), torch.randn(3, 5, 6), torch.randn(7, 6)
    vec, vec7 = torch.randn(5), torch.randn(7)
    failures = []
    for mesh in _meshes():
        layouts = _operand_layouts(mesh.ndim)
        for la in layouts:
            for lb in layouts:
                failures += check_op(torch.mm, [a, b], [la, lb], mesh, grad=grad)
            failures += check_op(lambda x, y, z: torch.addmm(x, y, z, beta=0.5, alpha=2.0), [bias_row, a, b], [[R] * mesh.ndim, la, layouts[1]], mesh, grad=grad)
            failures += check_op(torch.addmm, [bias_full, a, b], [la, layouts[2], layouts[0]], mesh, grad=grad)
            failures += check_op(torch.mv, [a, vec], [la, [R] * mesh.ndim], mesh, grad=grad)
            failures += check_op(torch.addmv, [vec7, a, vec], [[R] * mesh.ndim, la, [S0] + [R] * (mesh.ndim - 1)], mesh, grad=grad)
        for l3 in layouts_for(mesh.ndim, 3, partial=mesh.ndim == 1):
            failures += check_op(torch.bmm, [a3, b3], [l3, [S0] + [R] * (mesh.ndim - 1)], mesh, grad=grad)
            failures += check_op(torch.bmm, [a3, b3], [[R] * mesh.ndim, l3], mesh, grad=grad)
            failures += check_op(torch.baddbmm, [bias3, a3, b3], [[S1] + [R] * (mesh.ndim - 1), l3, l3], mesh, grad=grad)
        failures += check_op(torch.dot, [vec, vec], [[S0] * mesh.ndim, [S0] * mesh.ndim], mesh, grad=grad)
        # a pending max does not commute with a product: it is reduced first
        failures += check_op(torch.mm, [a, b], [[Partial("max")] * mesh.ndim, layouts[2]], mesh, grad=grad)
        failures += check_op(torch.addmm, [bias_row, a, b], [[Partial("min")] * mesh.ndim, layouts[2], layouts[1]], mesh, grad=grad)
    return failures


def test_mm_family_values(dist):
    assert_no_failures(dist.run(4, _values, False))


def test_mm_family_gradients(dist):
    assert_no_failures(dist.run(4, _values, True))


# ---------------------------------------------------------------------- seed signatures
def _signature(mesh, a: torch.Tensor, la, b: torch.Tensor, lb, op=torch.mm, bias=None, lbias=None) -> tuple:
    """(output placements, collectives, values right) of ``op`` on the given layouts."""
    da, db = sw.distribute_tensor(a, mesh, la), sw.distribute_tensor(b, mesh, lb)
    args = (da, db) if bias is None else (sw.distribute_tensor(bias, mesh, lbias), da, db)
    with CommDebugMode() as comms:
        out = op(*args)
    want = op(a, b) if bias is None else op(bias, a, b)
    return out.placements, comms.get_comm_counts(), torch.allclose(out.full_tensor(), want, atol=1e-5)


def _signatures():
    mesh = sw.init_device_mesh("cpu", (4,))
    mesh2 = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    a, b = torch.randn(7, 10), torch.randn(10, 9)
    rank = dist.get_rank()
    parts = torch.randn(4, 7, 10)
    partial_a = DTensor.from_local(parts[rank].clone(), mesh, [P])
    replicated_b = sw.distribute_tensor(b, mesh, [R])
    with CommDebugMode() as comms:
        out = torch.mm(partial_a, replicated_b)
    partial_pass = (out.placements, comms.get_comm_counts(), torch.allclose(out.full_tensor(), parts.sum(0) @ b, atol=1e-4))
    partial_b = DTensor.from_local(parts[rank].t().contiguous(), mesh, [P])
    with CommDebugMode() as comms:
        out = torch.mm(partial_a, partial_b)
    both_partial = (len(comms.get_comm_counts()) > 0, torch.allclose(out.full_tensor(), parts.sum(0) @ parts.sum(0).t(), atol=1e-3))
    return {
        "S1xS0": _signature(mesh, a, [S1], b, [S0]),
        "RxS1": _signature(mesh, a, [R], b, [S1]),
        "S0xR": _signature(mesh, a, [S0], b, [R]),
        "S0xS1_small_a": _signature(mesh, torch.randn(16, 8), [S0], torch.randn(8, 64), [S1]),
        "S0xS1_small_b": _signature(mesh, torch.randn(64, 8), [S0], torch.randn(8, 16), [S1]),
        "S0xS1_square": _signature(mesh, torch.randn(8, 8), [S0], torch.randn(8, 8), [S1]),
        "bmm_S0xS0": _signature(mesh, torch.randn(5, 3, 4), [S0], torch.randn(5, 4, 2), [S0], op=torch.bmm),
        "addmm_S1xS0_bias_R": _signature(mesh, a, [S1], b, [S0], op=torch.addmm, bias=torch.randn(9), lbias=[R]),
        "addmm_S0xR_bias_R": _signature(mesh, a, [S0], b, [R], op=torch.addmm, bias=torch.randn(9), lbias=[R]),
        "addmm_RxS1_bias_R": _signature(mesh, a, [R], b, [S1], op=torch.addmm, bias=torch.randn(9), lbias=[R]),
        "2d_S0S1xRS0": _signature(mesh2, a, [S0, S1], b, [R, S0]),
        "partial_x_R": partial_pass,
        "partial_x_partial": both_partial,
    }


_EXPECTED = {
    "S1xS0": ((P,), {}),
    "RxS1": ((S1,), {}),
    "S0xR": ((S0,), {}),
    "S0xS1_small_a": ((S1,), {"all_gather": 1}),  # A is the cheaper one to gather
    "S0xS1_small_b": ((S0,), {"all_gather": 1}),  # B is
    "bmm_S0xS0": ((S0,), {}),
    "addmm_S1xS0_bias_R": ((P,), {}),  # the bias becomes Partial for free (first rank keeps it)
    "addmm_S0xR_bias_R": ((S0,), {}),
    "addmm_RxS1_bias_R": ((S1,), {}),
    "2d_S0S1xRS0": ((S0, P), {}),
    "partial_x_R": ((P,), {}),
}


def test_seed_signatures_with_their_collectives(dist):
    for rank, got in enumerate(dist.run(4, _signatures)):
        for name, (placements, comms) in _EXPECTED.items():
            assert got[name] == (placements, comms, True), f"rank {rank} {name}: {got[name]}"
        square_placements, square_comms, square_ok = got["S0xS1_square"]
        assert square_comms == {"all_gather": 1} and square_placements in ((S0,), (S1,)) and square_ok, got["S0xS1_square"]
        reduced, ok = got["partial_x_partial"]
        assert reduced and ok, f"rank {rank}: Partial x Partial must reduce one side first"


def _backward_signatures():
    """Gradient layouts and backward collectives of the three parallel forms of mm."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 10), torch.randn(10, 9)
    out = {}
    for name, la, lb in [("data", S0, R), ("column", R, S1), ("row", S1, S0)]:
        da = sw.distribute_tensor(a.clone().requires_grad_(), mesh, [la])
        db = sw.distribute_tensor(b.clone().requires_grad_(), mesh, [lb])
        y = torch.mm(da, db)
        upstream = torch.randn(7, 9)
        grad = sw.distribute_tensor(upstream, mesh, [R if y.placements[0].is_partial() else y.placements[0]])
        with CommDebugMode() as comms:
            y.backward(grad)
        ok = torch.allclose(da.grad.full_tensor(), upstream @ b.t(), atol=1e-5) and torch.allclose(db.grad.full_tensor(), a.t() @ upstream, atol=1e-5)
        out[name] = (da.grad.placements, db.grad.placements, comms.get_comm_counts(), ok)
    return out


def test_mm_backward_keeps_parallel_forms_free_of_communication(dist):
    for got in dist.run(4, _backward_signatures):
        assert got["data"] == ((S0,), (P,), {}, True), got["data"]  # weight grad: pending sum
        assert got["column"] == ((P,), (S1,), {}, True), got["column"]
        assert got["row"] == ((S1,), (S0,), {}, True), got["row"]


# ---------------------------------------------------------------------- composites
def _composites():
    torch.manual_seed(0)
    x3, w, bias = torch.randn(2, 7, 5), torch.randn(6, 5), torch.randn(6)
    y3 = torch.randn(2, 5, 3)
    failures = []
    for mesh in _meshes():
        rest = [R] * (mesh.ndim - 1)
        for lx in layouts_for(mesh.ndim, 3):
            failures += check_op(F.linear, [x3, w, bias], [lx, [R] * mesh.ndim, [R] * mesh.ndim], mesh)
            failures += check_op(torch.matmul, [x3, w.t().contiguous()], [lx, [S1] + rest], mesh)
            failures += check_op(torch.matmul, [x3, y3], [lx, [S0] + rest], mesh)
            failures += check_op(lambda p, q: torch.einsum("bij,bjk->bik", p, q), [x3, y3], [lx, [R] * mesh.ndim], mesh)
        # tensor parallel: column-parallel then row-parallel linear, no communication forward
        failures += check_op(lambda x, w1, w2: F.linear(F.linear(x, w1), w2), [x3, torch.randn(8, 5), torch.randn(4, 8)],
                             [[R] * mesh.ndim, [S0] + rest, [S1] + rest], mesh, expect_comms={})
    return failures


def test_matmul_linear_einsum(dist):
    assert_no_failures(dist.run(4, _composites))
