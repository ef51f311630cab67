"""Drop-in surprises on DTensors, each against one device: plain scalar tensors mixed with
DTensors, metadata queries, views of unevenly sharded tensors (counted with CommDebugMode),
``torch.inference_mode()``, complex views (rotary embeddings), and backward through autograd's
own plain zero gradients.

Every distributed body batches its cases and returns per-case results, asserted in the parent.
"""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.train.models.llama.model import apply_rotary, rotary_table
from tests.op_check import check_op


# ---------------------------------------------------------------------- plain scalars
def _plain_scalars():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x, v = torch.randn(6, 5), torch.randn(6)
    dx, dv = sw.distribute_tensor(x, mesh, [Shard(0)]), sw.distribute_tensor(v, mesh, [Shard(0)])
    out = {}
    for name, scalar in {"0d": torch.tensor(3.0), "1d": torch.tensor([3.0]), "2d": torch.tensor([[3.0]])}.items():
        want = x * scalar
        got = dx * scalar
        out[f"mul_{name}"] = (got.shape == want.shape, torch.equal(got.full_tensor(), want))
        got = scalar - dx  # the plain tensor first
        out[f"rsub_{name}"] = torch.equal(got.full_tensor(), scalar - x)
        # a one-element tensor broadcasts like a tensor: [6] * [1, 1] is [1, 6]
        got = dv * scalar
        out[f"broadcast_{name}"] = (tuple(got.shape), torch.equal(got.full_tensor(), v * scalar))
        # gradient reaching the plain scalar
        s_ref = scalar.clone().requires_grad_()
        (x * s_ref).sum().backward()
        s = scalar.clone().requires_grad_()
        (sw.distribute_tensor(x, mesh, [Shard(0)]) * s).sum().backward()
        grad = s.grad.full_tensor() if isinstance(s.grad, sw.DTensor) else s.grad
        out[f"grad_{name}"] = torch.allclose(grad, s_ref.grad, atol=1e-5)
    out["is_same_size"] = (x.is_same_size(dx), dx.is_same_size(x), torch.randn(5, 6).is_same_size(dx), dx.is_same_size(dx))
    try:  # zero-filled, but in forward: still a tensor without a layout
        dx * torch.zeros(6, 5)
        out["strict"] = "no error"
    except ValueError as err:
        out["strict"] = str(err)
    return out


def test_one_element_plain_tensors_are_replicated_scalars(dist):
    for out in dist.run(4, _plain_scalars):
        for name in ("0d", "1d", "2d"):
            assert out[f"mul_{name}"] == (True, True), name
            assert out[f"rsub_{name}"], name
            assert out[f"broadcast_{name}"] == ({"0d": (6,), "1d": (6,), "2d": (1, 6)}[name], True), name
            assert out[f"grad_{name}"], name
        assert out["is_same_size"] == (True, True, False, True)
        assert "argument #1 is a plain tensor f32[6,5](plain) mixed with DTensors" in out["strict"]


# ---------------------------------------------------------------------- views of uneven shards
def _uneven_views():
    mesh = sw.init_device_mesh("cpu", (4,))
    mesh2 = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    cases = {
        # batch 1 sharded over 4 ranks (one rank holds it): the attention head split
        "batch1_heads": (mesh, (1, 5, 8), [Shard(0)], (1, 5, 2, 4), (Shard(0),)),
        "batch1_merge": (mesh, (1, 5, 2, 4), [Shard(0)], (1, 5, 8), (Shard(0),)),
        "trailing1": (mesh, (6, 1), [Shard(1)], (2, 3, 1), (Shard(2),)),
        "identity": (mesh, (1, 6), [Shard(0)], (1, 6), (Shard(0),)),
        "two_axes": (mesh2, (1, 6), [Shard(0), Shard(1)], (1, 2, 3), (Shard(0), Shard(1))),
        "empty": (mesh, (0, 6), [Shard(1)], (0, 2, 3), (Shard(2),)),
    }
    out = {}
    for name, (m, shape, placements, target, want) in cases.items():
        x = torch.randn(shape)
        d = sw.distribute_tensor(x, m, placements)
        with CommDebugMode() as comms:
            y = d.view(target)
        out[name] = (y.placements == want, comms.get_total_counts(), torch.equal(y.full_tensor(), x.view(target)))
    return out


def test_view_keeps_uneven_blocks_without_communication(dist):
    for out in dist.run(4, _uneven_views):
        bad = {k: v for k, v in out.items() if v != (True, 0, True)}
        assert not bad, bad


# ---------------------------------------------------------------------- inference mode
def _inference_mode():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x, x3 = torch.randn(8, 6), torch.randn(2, 4, 6)
    w, b, w2, v = torch.randn(4, 6), torch.randn(4), torch.randn(6, 3), torch.randn(6)
    dx, dx3 = sw.distribute_tensor(x, mesh, [Shard(0)]), sw.distribute_tensor(x3, mesh, [Shard(1)])
    dw, db = sw.distribute_tensor(w, mesh, [Shard(0)]), sw.distribute_tensor(b, mesh, [Shard(0)])
    dw2, dv = sw.distribute_tensor(w2, mesh, [Shard(1)]), sw.distribute_tensor(v, mesh, [Replicate()])
    cases = {
        "linear": (lambda: F.linear(dx, dw, db), lambda: F.linear(x, w, b)),
        "linear_3d": (lambda: F.linear(dx3, dw), lambda: F.linear(x3, w)),
        "matmul": (lambda: torch.matmul(dx, dw2), lambda: torch.matmul(x, w2)),
        "matmul_3d": (lambda: dx3 @ dw2, lambda: x3 @ w2),
        "matmul_vector": (lambda: dx @ dv, lambda: x @ v),
        "matmul_t": (lambda: dx @ dw.t(), lambda: x @ w.t()),
        "layer_norm": (lambda: F.layer_norm(dx, (6,)), lambda: F.layer_norm(x, (6,))),
    }
    out = {}
    for name, (fn, ref) in cases.items():
        with torch.inference_mode():
            got = fn()
        out[name] = torch.allclose(got.full_tensor(), ref(), atol=1e-5)
    return out


def test_linear_and_matmul_work_under_inference_mode(dist):
    for out in dist.run(4, _inference_mode):
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, bad


# ---------------------------------------------------------------------- complex views, rotary
def _rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding in the complex formulation."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, x.shape[1], 1, x.shape[-1] // 2)
    return torch.view_as_real(pairs * freqs).flatten(3).type_as(x)


def _complex_roundtrip(a: torch.Tensor) -> torch.Tensor:
    c = torch.view_as_complex(a)
    return torch.view_as_real(c * c.conj())


def _complex_views():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 8)  # [batch, seq, heads, head_dim]
    angles = torch.outer(torch.arange(5.0), 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    table = rotary_table(8, 5, 10000.0)
    failures = []
    for layout in ([Replicate()], [Shard(0)], [Shard(1)], [Shard(2)], [Shard(3)]):
        failures += check_op(_rotary_complex, [x, freqs_cis], [layout, [Replicate()]], mesh)
        failures += check_op(apply_rotary, [x, table], [layout, [Replicate()]], mesh)
    failures += check_op(_rotary_complex, [x, freqs_cis], [[Shard(1)], [Shard(0)]], mesh)
    for layout in ([Replicate()], [Shard(0)], [Shard(1)], [Shard(2)]):
        failures += check_op(_complex_roundtrip, [torch.randn(4, 3, 2)], [layout], mesh)
    # the pair dim is not sharded: heads stay sharded through the complex view, no communication
    d = sw.distribute_tensor(x, mesh, [Shard(2)])
    with CommDebugMode() as comms:
        c = torch.view_as_complex(d.reshape(2, 5, 4, 4, 2))
        r = torch.view_as_real(c)
    return failures, (c.placements, r.placements, comms.get_total_counts())


def test_complex_views_and_rotary_match_one_device(dist):
    for failures, kept in dist.run(4, _complex_views):
        assert not failures, failures
        assert kept == ((Shard(2),), (Shard(2),), 0)


# ---------------------------------------------------------------------- backward on edge shapes
def _edge_backward():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    cases = [
        # autograd fills the gradient of the unused pieces with plain zeros, then cats them
        ("split_unused", lambda a: a.split(2)[0], [torch.randn(5, 3)]),
        ("unbind_unused", lambda a: a.unbind(1)[1], [torch.randn(5, 3)]),
        # select_scatter's backward builds the source's zeros as a plain tensor
        ("select_scatter", lambda a, b: a.select_scatter(b, 1, 2), [torch.randn(5, 4, 3), torch.randn(5, 3)]),
        ("cat_empty", lambda a, b: torch.cat([a * 2, b]), [torch.randn(0, 4), torch.randn(3, 4)]),
        ("cat_empty_1d", lambda a, b: torch.cat([a, b * 2]), [torch.randn(0), torch.randn(3, 4)]),
        ("expand_empty", lambda a: (a * 2).expand(3, 0), [torch.randn(1, 0)]),
        ("select_empty", lambda a: (a * 2).select(0, 1), [torch.randn(3, 0)]),
    ]
    failures = []
    for name, fn, inputs in cases:
        fn.__name__ = name
        for layout in ([Replicate()], [Shard(0)], [Shard(1)]):
            layouts = [layout if layout[0].is_replicate() or layout[0].dim < x.ndim else [Replicate()] for x in inputs]
            failures += check_op(fn, inputs, layouts, mesh)
    return failures


def test_backward_through_autograd_zero_gradients(dist):
    for failures in dist.run(4, _edge_backward):
        assert not failures, failures


def _matmul_1d():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    v, m, w = torch.randn(8), torch.randn(8, 6), torch.randn(6, 8)
    failures = []
    for lv, lm in (([Replicate()], [Replicate()]), ([Shard(0)], [Shard(0)]), ([Replicate()], [Shard(1)])):
        failures += check_op(torch.matmul, [v, m], [lv, lm], mesh)
        failures += check_op(torch.matmul, [m.t().contiguous(), v], [lm, lv], mesh)
        failures += check_op(F.linear, [v, w], [lv, [Shard(0)] if lm[0].is_shard() else lm], mesh)
    return failures


def test_matmul_and_linear_with_a_1d_operand(dist):
    for failures in dist.run(4, _matmul_1d):
        assert not failures, failures
