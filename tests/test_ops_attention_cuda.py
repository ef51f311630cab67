"""The CUDA attention kernels (flash, memory-efficient, cuDNN) on meta DTensors, on CPU.

No GPU is needed: the kernels have meta implementations, a mesh built without a process group
stands for rank 0 of a CUDA mesh, and the layouts checked here need no communication. Each
call goes through the dispatcher; the outputs' global metadata must be the single-device meta
kernel's, their placements the rule's, and each local block the shape its spec says. The
choice among candidates (which layouts are free) is checked on the rules directly.
"""

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.dispatch.ops import attention_cuda
from shardwise.dispatch.strategy import OpSchema, choose
from shardwise.core.spec import DTensorSpec, TensorMeta

aten = torch.ops.aten
B, H, L, E = 2, 8, 16, 32
MESHES = {"1d": ([0, 1, 2, 3], [Shard(1)]), "2d-batch-heads": ([[0, 1], [2, 3]], [Shard(0), Shard(1)]),
          "1d-batch": ([0, 1, 2, 3], [Shard(0)])}


def _spec(mesh, shape, placements, dtype=torch.bfloat16) -> DTensorSpec:
    g = torch.empty(shape, device="meta", dtype=dtype)
    return DTensorSpec(mesh, tuple(placements), TensorMeta(g.shape, g.stride(), g.dtype))


def _meta_dtensor(mesh, shape, placements, dtype=torch.bfloat16) -> DTensor:
    spec = _spec(mesh, shape, placements, dtype)
    return DTensor(torch.empty(spec.local_shape(), device="meta", dtype=dtype), spec, requires_grad=False)


def _plain(value):
    """A DTensor argument as the single-device meta tensor it stands for."""
    if isinstance(value, DTensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _check_outputs(outs, op, args, placements) -> list:
    """Compare the sharded call's outputs with the single-device meta call's; return the DTensors."""
    want = op(*[_plain(a) for a in args])
    assert len(outs) == len(want)
    dtensors = []
    for got, ref in zip(outs, want):
        if not isinstance(ref, torch.Tensor):
            assert got is None or isinstance(got, int), (op, got)
            continue
        assert isinstance(got, DTensor), (op, type(got))
        assert (tuple(got.shape), got.dtype) == (tuple(ref.shape), ref.dtype), (op, got.shape, ref.shape)
        assert tuple(got._local_tensor.shape) == got._spec.local_shape(), op
        dtensors.append(got)
    # The attention outputs (and logsumexp) take q's layout; the random state is replicated.
    assert dtensors[0].placements == tuple(placements), (op, dtensors[0].placements)
    assert dtensors[1].placements == tuple(placements), (op, dtensors[1].placements)
    return dtensors


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_cuda_attention_kernels_on_meta(layout):
    grid, placements = MESHES[layout]
    mesh = sw.DeviceMesh("cuda", grid)
    q, k, v = (_meta_dtensor(mesh, (B, H, L, E), placements) for _ in range(3))
    rep = [Replicate()] * mesh.ndim

    # flash: forward, then backward fed with the forward's own outputs (random state included)
    args = (q, k, v, 0.0, True)
    fwd = aten._scaled_dot_product_flash_attention.default(*args)
    out, lse = _check_outputs(fwd, aten._scaled_dot_product_flash_attention.default, args, placements)[:2]
    assert fwd[6].placements == tuple(rep) and fwd[4] == L
    args = (out, q, k, v, out, lse, None, None, fwd[4], fwd[5], 0.0, True, fwd[6], fwd[7])
    grads = aten._scaled_dot_product_flash_attention_backward.default(*args)
    want = aten._scaled_dot_product_flash_attention_backward.default(*[_plain(a) for a in args])
    for g, w in zip(grads, want):
        assert (g.placements, tuple(g.shape), g.dtype) == (tuple(placements), tuple(w.shape), w.dtype)
        assert tuple(g._local_tensor.shape) == g._spec.local_shape()

    # memory-efficient, with a bias of the scores' full shape, and its gradient
    bias = _meta_dtensor(mesh, (B, H, L, L), placements)
    args = (q, k, v, bias, True, 0.0, False)
    fwd = aten._scaled_dot_product_efficient_attention.default(*args)
    out, lse, seed, offset = _check_outputs(fwd, aten._scaled_dot_product_efficient_attention.default, args, placements)
    assert seed.placements == tuple(rep)
    args = (out, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, True], False)
    grads = aten._scaled_dot_product_efficient_attention_backward.default(*args)
    want = aten._scaled_dot_product_efficient_attention_backward.default(*[_plain(a) for a in args])
    for g, w in zip(grads, want):
        assert (g.placements, tuple(g.shape)) == (tuple(placements), tuple(w.shape))

    # cuDNN
    args = (q, k, v, None, True, 0.0, True)
    fwd = aten._scaled_dot_product_cudnn_attention.default(*args)
    out, lse = _check_outputs(fwd, aten._scaled_dot_product_cudnn_attention.default, args, placements)[:2]
    args = (out, q, k, v, out, lse, fwd[6], fwd[7], None, None, None, fwd[4], fwd[5], 0.0, True)
    grads = aten._scaled_dot_product_cudnn_attention_backward.default(*args)
    want = aten._scaled_dot_product_cudnn_attention_backward.default(*[_plain(a) for a in args])
    for g, w in zip(grads, want):
        assert (g.placements, tuple(g.shape)) == (tuple(placements), tuple(w.shape))


def _choice(op, rule, args, mesh):
    specs = tuple(a for a in args if isinstance(a, DTensorSpec))
    schema = OpSchema(op, tuple(args), (), specs)
    return choose(schema, rule(schema))


def test_cuda_attention_choices():
    """Which layout each kernel runs in when q's rows are sharded, causal or not, and with a
    pending upstream gradient."""
    mesh = sw.DeviceMesh("cuda", [0, 1, 2, 3])
    rows, rep, heads = [Shard(2)], [Replicate()], [Shard(1)]
    q, kv = _spec(mesh, (B, H, L, E), rows), _spec(mesh, (B, H, L, E), rep)
    flash = aten._scaled_dot_product_flash_attention.default
    # Rows sharded, keys replicated, no causal mask: the flash kernel runs as is.
    plan = _choice(flash, attention_cuda.flash_cuda_forward, (q, kv, kv, 0.0, False), mesh)
    assert plan.inputs == ((Shard(2),), (Replicate(),), (Replicate(),)) and plan.outputs[0] == (Shard(2),)
    # With a causal mask, rows depend on their global position: not the rows layout.
    plan = _choice(flash, attention_cuda.flash_cuda_forward, (q, kv, kv, 0.0, True), mesh)
    assert plan.inputs[0] != (Shard(2),)
    # The efficient kernel pads its logsumexp per call: never the rows layout.
    efficient = aten._scaled_dot_product_efficient_attention.default
    plan = _choice(efficient, attention_cuda.efficient_forward, (q, kv, kv, None, True, 0.0, False), mesh)
    assert plan.inputs[0] != (Shard(2),)
    # Backward with the rows sharded: dK and dV are partial sums over the row blocks.
    backward = aten._scaled_dot_product_flash_attention_backward.default
    seed = _spec(mesh, (2,), rep, torch.uint64)
    lse = _spec(mesh, (B, H, L), rows, torch.float32)
    args = (q, q, kv, kv, q, lse, None, None, L, L, 0.0, False, seed, seed)
    plan = _choice(backward, attention_cuda.flash_cuda_backward, args, mesh)
    assert plan.outputs == ((Shard(2),), (Partial(),), (Partial(),))
    # A pending sum in the upstream gradient passes through to all three gradients.
    pending = _spec(mesh, (B, H, L, E), [Partial()])
    args = (pending, kv, kv, kv, kv, _spec(mesh, (B, H, L), rep, torch.float32), None, None, L, L, 0.0, True, seed, seed)
    plan = _choice(backward, attention_cuda.flash_cuda_backward, args, mesh)
    assert plan.outputs == ((Partial(),),) * 3
    # One [L, L] bias for all heads: with heads sharded its gradient is a partial sum.
    qh = _spec(mesh, (B, H, L, E), heads)
    bias = _spec(mesh, (L, L), rep)
    efficient_bwd = aten._scaled_dot_product_efficient_attention_backward.default
    lse = _spec(mesh, (B, H, 32), heads, torch.float32)
    args = (qh, qh, qh, qh, bias, qh, lse, seed, seed, 0.0, [True] * 4, False)
    plan = _choice(efficient_bwd, attention_cuda.efficient_backward, args, mesh)
    assert plan.outputs == ((Shard(1),),) * 3 + ((Partial(),),)
    # Grouped-query attention: 8 query heads, 2 kv heads over 4 ranks do not line up.
    kv2 = _spec(mesh, (B, 2, L, E), heads)
    plan = _choice(flash, attention_cuda.flash_cuda_forward, (qh, kv2, kv2, 0.0, True), mesh)
    assert plan.inputs[1] != (Shard(1),)
