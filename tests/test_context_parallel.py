"""Context parallelism: ring attention equals single-device SDPA, values and gradients.

Pure tests check the layout and the log-sum-exp math in one process (``ring_reference``); one
4-rank body runs ``context_parallel`` + ``F.scaled_dot_product_attention`` over real gloo
point-to-point transfers for many cases (causal or not, balanced or plain layout, GQA, float32
and float64, DTensor heads on a tp axis) and counts the bytes with ``CommDebugMode``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.parallel.context_parallel.ring_attention import (Mask, SequenceLayout, block_backward, block_forward, chunk_pairs,
                                               ring_reference)


# ---------------------------------------------------------------------- pure
@pytest.mark.parametrize("cp,balanced", [(1, True), (2, True), (4, True), (3, False), (4, False)])
def test_layout_shards_tile_the_sequence(cp, balanced):
    layout = SequenceLayout(cp, balanced)
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    parts = [layout.shard(x, 1, r) for r in range(cp)]
    assert all(p.shape == (2, 24 // cp, 3) for p in parts)
    assert torch.equal(layout.unshard(parts, 1), x)
    seen = torch.cat([layout.positions(24, r) for r in range(cp)]).sort().values
    assert torch.equal(seen, torch.arange(24))
    if balanced and cp == 4:
        assert layout.positions(24, 1).tolist() == [3, 4, 5, 18, 19, 20]  # chunks 1 and 6 of 8
    with pytest.raises(ValueError, match="sequence length 25 does not divide"):
        layout.check_length(25, "x")


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_layout_evens_out_causal_work(cp):
    """Work in units of one chunk pair's scores (a diagonal pair is half); plain causal is uneven."""
    def work(layout: SequenceLayout, rank: int) -> float:
        return sum(1.0 if m is Mask.FULL else 0.5 for src in range(cp) for _, _, m in chunk_pairs(layout, rank, src, True))

    balanced = [work(SequenceLayout(cp, True), r) for r in range(cp)]
    plain = [work(SequenceLayout(cp, False), r) for r in range(cp)]
    assert len(set(balanced)) == 1 and len(set(plain)) == cp
    assert sum(balanced) == (2 * cp) ** 2 / 2  # the lower triangle of (2cp)^2 chunk pairs, diagonal halved


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu_kernel", "matmuls"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("cp,balanced", [(2, True), (4, True), (4, False)])
def test_ring_math_equals_sdpa(causal, heads, kv_heads, cp, balanced, kernel):
    g = torch.Generator().manual_seed(cp * 10 + heads + kv_heads)
    q = torch.randn(2, heads, 24, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, kv_heads, 24, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, kv_heads, 24, 8 if kernel else 5, dtype=torch.float64, generator=g)  # the kernel: Ev == E
    got = ring_reference(q, k, v, SequenceLayout(cp, balanced), causal, 0.3, kernel)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu_kernel", "matmuls"])
@pytest.mark.parametrize("mask", [Mask.FULL, Mask.DIAGONAL])
def test_block_backward_with_the_final_lse_equals_autograd(mask, kernel):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 6, 8 if kernel else 3, dtype=torch.float64, generator=g, requires_grad=True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is Mask.DIAGONAL, enable_gqa=True)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    out.backward(dout)
    with torch.no_grad():
        block_out, lse = block_forward(q, k, v, 8 ** -0.5, mask, kernel)
        got = block_backward(dout, q, k, v, block_out, lse, (dout * block_out).sum(-1), 8 ** -0.5, mask, kernel)
    for mine, theirs in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- 4 ranks
CASES = [  # (causal, load_balance, heads, kv_heads, dtype)
    (True, True, 4, 4, torch.float64),
    (True, True, 4, 2, torch.float64),
    (False, True, 4, 1, torch.float64),
    (True, False, 2, 2, torch.float64),
    (False, False, 4, 2, torch.float64),
    (True, True, 4, 2, torch.float32),
]
SEQ, BATCH, DIM = 16, 2, 8


def _inputs(heads: int, kv_heads: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, heads, SEQ, DIM), (BATCH, kv_heads, SEQ, DIM), (BATCH, kv_heads, SEQ, DIM), (BATCH, heads, SEQ, DIM)]
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]  # q, k, v, upstream gradient


def _single_device(q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring_cases() -> dict:
    """Every case: worst relative error of out/dq/dk/dv vs one device, and the bytes sent."""
    import shardwise as sw
    from shardwise.debug import CommDebugMode
    from shardwise.parallel import context_parallel, context_parallel_unshard, ring_attention

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    result: dict = {"cases": []}
    for n, (causal, balance, heads, kv_heads, dtype) in enumerate(CASES):
        q, k, v, dout = _inputs(heads, kv_heads, dtype, seed=n)
        want = _single_device(q, k, v, dout, causal)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with context_parallel(mesh, buffers=[q, k, v, dout], seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q, k, v, dout}, load_balance=balance):
            local_shapes = [tuple(t.shape) for t in (q, k, v)]
            with CommDebugMode() as fwd:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
            with CommDebugMode() as bwd:
                out.backward(dout)
        direct = ring_attention(q.detach(), k.detach(), v.detach(), mesh, is_causal=causal, enable_gqa=heads != kv_heads,
                                load_balance=balance)  # the function itself, outside the block
        got = context_parallel_unshard(mesh, [out.detach(), q.grad, k.grad, v.grad], [2] * 4, load_balance=balance)
        errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
        result["cases"].append({"errors": errors, "local_shapes": local_shapes, "direct": torch.equal(direct, out.detach()),
                                "fwd_bytes": fwd.bytes_sent, "fwd_counts": dict(fwd.get_comm_counts()),
                                "bwd_bytes": bwd.bytes_sent, "kv_bytes": 2 * k.numel() * k.element_size()})
    result["restored"] = _restores_buffers(mesh)
    result["dtensor_heads"] = _dtensor_heads_on_tp()
    result["errors"] = _refusals(mesh)
    return result


def _restores_buffers(mesh) -> bool:
    from shardwise.parallel import context_parallel

    x, rotary = torch.arange(32.0).view(2, 16), torch.arange(16.0)
    with context_parallel(mesh, buffers=[x, rotary], seq_dims=[1, 0], no_restore_buffers=[rotary]):
        inside = tuple(x.shape) == (2, 4) and F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention
        me = mesh.get_local_rank()
        balanced = rotary.tolist() == [2.0 * me, 2.0 * me + 1, 14.0 - 2 * me, 15.0 - 2 * me]
    back = torch.equal(x, torch.arange(32.0).view(2, 16)) and tuple(rotary.shape) == (4,)
    return inside and balanced and back and F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _dtensor_heads_on_tp() -> list[float]:
    """cp=2 x tp=2: q/k/v DTensors with heads sharded over tp, ring over cp; errors vs one device."""
    import shardwise as sw
    from shardwise import Shard
    from shardwise.parallel import context_parallel, context_parallel_unshard

    world = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    q, k, v, dout = _inputs(4, 2, torch.float64, seed=99)
    want = _single_device(q, k, v, dout, True)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with context_parallel(world["cp"], buffers=[q, k, v, dout], seq_dims=[2] * 4, no_restore_buffers={q, k, v, dout}):
        tp = world.get_local_rank("tp")
        dq, dk, dv, ddout = (sw.DTensor.from_local(t.chunk(2, 1)[tp], world["tp"], [Shard(1)]) for t in (q, k, v, dout))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        placements = tuple(out.placements)
        out.backward(ddout)
    assert placements == (Shard(1),), placements
    got = context_parallel_unshard(world["cp"], [out.full_tensor().detach(), q.grad, k.grad, v.grad], [2] * 4)
    got[1:] = [g.chunk(2, 1)[tp] for g in got[1:]]  # this rank's heads (the gradients reached only those)
    want[1:] = [w.chunk(2, 1)[tp] for w in want[1:]]
    return [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


def _refusals(mesh) -> list[str]:
    """Bad calls raise before any transfer (a hang would fail the test by timeout)."""
    from shardwise.parallel import context_parallel

    messages = []
    q = torch.randn(1, 2, 16, 4)
    calls = [
        lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool)),
        lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        lambda: F.scaled_dot_product_attention(q, q[:, :1], q[:, :1]),  # GQA without enable_gqa
    ]
    for call in calls:
        with context_parallel(mesh, buffers=[q], seq_dims=[2]):
            try:
                call()
            except (ValueError, NotImplementedError) as err:
                messages.append(str(err))
    for kwargs in ({"buffers": [torch.zeros(2, 12)], "seq_dims": [1]}, {"buffers": [q], "seq_dims": [1, 2]}):
        try:
            with context_parallel(mesh, **kwargs):
                pass
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_ring_attention_on_four_ranks_equals_sdpa_and_sends_three_quarters_of_kv(dist):
    result = dist.run(4, _ring_cases, timeout=180)
    for rank, per_rank in enumerate(result):
        for case, got in zip(CASES, per_rank["cases"]):
            causal, balance, heads, kv_heads, dtype = case
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            assert max(got["errors"]) < tol, (rank, case, got["errors"])
            assert got["direct"], "ring_attention(...) differs from SDPA inside context_parallel"
            assert got["local_shapes"][0] == (BATCH, heads, SEQ // 4, DIM), got["local_shapes"]
            # forward: the local k and v blocks go around 3 of 4 hops: (cp - 1) / cp of K and V
            assert got["fwd_counts"] == {"send_recv": 3}, got["fwd_counts"]
            whole_kv = 4 * got["kv_bytes"]
            assert got["fwd_bytes"] == whole_kv * 3 // 4, (got["fwd_bytes"], whole_kv)
            # backward: k/v again 3 hops, their gradient accumulators (float32 or wider) 4 hops home
            acc = max(torch.finfo(dtype).bits, 32) // torch.finfo(dtype).bits
            assert got["bwd_bytes"] == 3 * got["kv_bytes"] + 4 * acc * got["kv_bytes"], got["bwd_bytes"]
        assert per_rank["restored"]
        assert max(per_rank["dtensor_heads"]) < 1e-12, per_rank["dtensor_heads"]
        expected = ["attn_mask is not supported", "dropout_p=0.1 is not supported", "enable_gqa=True",
                    "sequence length 12 does not divide into 2 * cp = 8 chunks", "1 buffers but 2 seq_dims"]
        assert len(per_rank["errors"]) == len(expected), per_rank["errors"]
        for message, fragment in zip(per_rank["errors"], expected):
            assert fragment in message, (message, fragment)
