"""On a GPU: scaled dot-product attention's CUDA kernels on DTensors, without host syncs.

Marked ``cuda``: skipped where no GPU is visible (``scripts/gpu_check.sh`` runs them). One
process, no process group: a one-rank CUDA mesh holds the whole tensor as its block, so the
kernels run exactly as the dispatcher hands them over, and values and gradients must equal
plain torch's. With ``torch.cuda.set_sync_debug_mode("error")`` a host synchronization inside
the sharded call (that plain torch's own call does not make) raises.
"""

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta

pytestmark = pytest.mark.cuda


def _leaf(mesh, value: torch.Tensor) -> DTensor:
    spec = DTensorSpec(mesh, (Shard(1),), TensorMeta(value.shape, value.stride(), value.dtype))
    return DTensor(value.detach().clone(), spec, requires_grad=True)


def _run(q, k, v):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    local = out.to_local() if isinstance(out, DTensor) else out
    local.float().square().sum().backward()
    return local.detach()


def _syncs(fn) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_cuda_attention_kernels_match_torch(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = sw.DeviceMesh("cuda", [0])
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            want = _run(*plain)
        except RuntimeError as err:
            pytest.skip(f"{backend} not available on this GPU: {err}")
        sharded = [_leaf(mesh, t) for t in (q, k, v)]
        got = _run(*sharded)
        torch.testing.assert_close(got, want)
        for s, p in zip(sharded, plain):
            torch.testing.assert_close(s.grad.to_local(), p.grad)
        # no host synchronization beyond plain torch's own
        again = [t.clone().requires_grad_() for t in (q, k, v)]
        plain_syncs = _syncs(lambda: _run(*again))
        if not plain_syncs:
            assert not _syncs(lambda: _run(*[_leaf(mesh, t) for t in (q, k, v)])), backend
