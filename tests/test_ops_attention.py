"""scaled_dot_product_attention on DTensors, and small models end to end (MLP, Llama block).

Attention sharded on heads or batch must match single-device values and gradients with no
communication in the forward; the models compare outputs and parameter gradients with the
single-device module.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op

MESHES = [(4,), (2, 2)]


def _like(a, value: torch.Tensor):
    """``value`` as a constant next to ``a``: replicated on ``a``'s mesh if ``a`` is a DTensor."""
    if isinstance(a, DTensor):
        return sw.distribute_tensor(value, a.device_mesh, [Replicate()] * a.device_mesh.ndim)
    return value


def _sdpa_layouts(mesh) -> list[list]:
    """q/k/v layouts that need no communication: heads, batch, or both on a 2-D mesh."""
    if mesh.ndim == 1:
        return [[Shard(1)], [Shard(0)]]
    return [[Shard(1), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Replicate()]]


# ---------------------------------------------------------------------- attention
def _attention(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    # Uneven: 3 batches (an empty shard on (4,)), 5 heads over 4 ranks; L != S.
    q, k, v = torch.randn(3, 5, 6, 4), torch.randn(3, 5, 7, 4), torch.randn(3, 5, 7, 4)
    float_mask = torch.randn(6, 7)
    bool_mask = torch.rand(3, 1, 6, 7) > 0.3
    bool_mask[..., 0] = True  # every query row sees at least one key
    sdpa = F.scaled_dot_product_attention
    failures = []
    for layout in _sdpa_layouts(mesh):
        qkv = [q, k, v]
        layouts = [layout] * 3
        failures += check_op(lambda a, b, c: sdpa(a, b, c), qkv, layouts, mesh, expect_comms={})
        failures += check_op(lambda a, b, c: sdpa(a, b[:, :, :6], c[:, :, :6], is_causal=True), qkv, layouts, mesh)
        failures += check_op(lambda a, b, c: sdpa(a, b, c, attn_mask=_like(a, float_mask)), qkv, layouts, mesh)
        failures += check_op(lambda a, b, c: sdpa(a, b, c, attn_mask=_like(a, bool_mask), scale=0.3), qkv, layouts, mesh)
    # No communication with a causal mask either (the q/k/v slicing above is a view op).
    same = [q[:, :, :6], k[:, :, :6], v[:, :, :6]]
    failures += check_op(lambda a, b, c: sdpa(a, b, c, is_causal=True), same, [_sdpa_layouts(mesh)[0]] * 3, mesh, expect_comms={})
    # Query rows sharded, keys/values replicated: exact without a causal mask.
    rows = [Shard(2)] + [Replicate()] * (mesh.ndim - 1)
    rep = [Replicate()] * mesh.ndim
    failures += check_op(lambda a, b, c: sdpa(a, b, c), [q, k, v], [rows, rep, rep], mesh, expect_comms={})
    # Layouts that need gathering (sequence / head_dim sharded) still give the right answer.
    for bad in ([Shard(2)] + rep[1:], [Shard(3)] + rep[1:]):
        failures += check_op(lambda a, b, c: sdpa(a, b, c), [q, k, v], [bad] * 3, mesh)
        failures += check_op(lambda a, b, c: sdpa(a, b, c, is_causal=True), same, [bad] * 3, mesh)
    # A mask that needs a gradient takes the "math" path (matmuls, views, _safe_softmax).
    for layout in _sdpa_layouts(mesh):
        failures += check_op(lambda a, b, c, m: sdpa(a, b, c, attn_mask=m), [q, k, v, float_mask], [layout] * 3 + [rep], mesh)
    # Grouped-query attention: 4 query heads share 2 kv heads.
    gq, gk, gv = torch.randn(2, 4, 5, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    for layout in _sdpa_layouts(mesh):
        failures += check_op(lambda a, b, c: sdpa(a, b, c, enable_gqa=True), [gq, gk, gv], [layout] * 3, mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_scaled_dot_product_attention(dist, mesh_shape):
    assert_no_failures(dist.run(4, _attention, mesh_shape))


def _attention_placements():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    q, k, v = (sw.distribute_tensor(torch.randn(2, 8, 5, 4), mesh, [Shard(1)]).requires_grad_() for _ in range(3))
    with CommDebugMode() as comms:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(sw.distribute_tensor(torch.randn(2, 8, 5, 4), mesh, [Shard(1)]))
    return out.placements, comms.get_total_counts(), [t.grad.placements for t in (q, k, v)]


def test_heads_sharded_attention_stays_sharded(dist):
    for placements, comms, grads in dist.run(4, _attention_placements):
        assert placements == (Shard(1),) and comms == 0
        assert grads == [(Shard(1),)] * 3


# ---------------------------------------------------------------------- models
def _mlp(mesh_shape):
    """Linear-ReLU-Linear as functional code on DTensors: tensor-, data- and 2-D parallel."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    x, w1, b1, w2, b2 = torch.randn(5, 8), torch.randn(12, 8), torch.randn(12), torch.randn(8, 12), torch.randn(8)

    def mlp(x, w1, b1, w2, b2):
        return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)

    R = Replicate()
    if mesh.ndim == 1:
        layouts = [
            [[R], [Shard(0)], [Shard(0)], [Shard(1)], [R]],    # tensor parallel
            [[Shard(0)], [R], [R], [R], [R]],                   # data parallel
            [[Shard(0)], [Shard(0)], [Shard(0)], [Shard(1)], [R]],
        ]
    else:
        layouts = [
            [[Shard(0), R], [R, Shard(0)], [R, Shard(0)], [R, Shard(1)], [R, R]],  # DP x TP
            [[R, R], [Shard(0), Shard(0)], [Shard(0), Shard(0)], [Shard(1), Shard(1)], [R, R]],
        ]
    failures = []
    for layout in layouts:
        failures += check_op(mlp, [x, w1, b1, w2, b2], layout, mesh)
    return failures


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_mlp(dist, mesh_shape):
    assert_no_failures(dist.run(4, _mlp, mesh_shape))


class LlamaBlock(nn.Module):
    """Pre-norm attention (RMSNorm, wq/wk/wv/wo, causal SDPA over heads) + SwiGLU MLP."""

    def __init__(self, dim: int = 32, heads: int = 8, hidden: int = 48) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attn_norm = nn.Parameter(torch.rand(dim) + 0.5)
        self.ffn_norm = nn.Parameter(torch.rand(dim) + 0.5)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        q, k, v = (w(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(F.rms_norm(x, (x.shape[-1],), self.attn_norm, eps=1e-6))
        g = F.rms_norm(h, (h.shape[-1],), self.ffn_norm, eps=1e-6)
        return h + self.w2(F.silu(self.w1(g)) * self.w3(g))


TP_PLAN = {"wq.weight": Shard(0), "wk.weight": Shard(0), "wv.weight": Shard(0), "w1.weight": Shard(0),
           "w3.weight": Shard(0), "wo.weight": Shard(1), "w2.weight": Shard(1)}


def _distribute_params(module: nn.Module, mesh, plan: dict) -> None:
    """Replace every parameter by a DTensor parameter laid out by ``plan`` (else replicated)."""
    for name, param in list(module.named_parameters()):
        owner, _, attr = name.rpartition(".")
        placement = plan.get(name, Replicate())
        setattr(module.get_submodule(owner), attr,
                nn.Parameter(sw.distribute_tensor(param.detach().clone(), mesh, [placement])))


def _llama_block():
    """Column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2, replicated norms; replicated input."""
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = LlamaBlock()
    block = copy.deepcopy(ref)
    _distribute_params(block, mesh, TP_PLAN)
    x = torch.randn(2, 8, 32)
    g = torch.randn(2, 8, 32)
    want = ref(x)
    (want * g).sum().backward()
    got = block(sw.distribute_tensor(x, mesh, [Replicate()]))
    (got.full_tensor() * g).sum().backward()
    failures = []
    if not torch.allclose(got.full_tensor(), want, atol=1e-5, rtol=1e-4):
        failures.append(f"output differs by {(got.full_tensor() - want).abs().max().item():.3g}")
    for (name, p), (_, r) in zip(block.named_parameters(), ref.named_parameters()):
        if p.grad is None:
            failures.append(f"{name}: no gradient")
        elif not torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-4):
            failures.append(f"{name}: gradient differs by {(p.grad.full_tensor() - r.grad).abs().max().item():.3g}")
        elif p.grad.placements[0].is_shard() != p.placements[0].is_shard():
            failures.append(f"{name}: gradient {p.grad.placements} vs parameter {p.placements}")
    return failures


def test_llama_block_tensor_parallel(dist):
    assert_no_failures(dist.run(4, _llama_block))
