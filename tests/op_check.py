"""Checking an op on DTensors against the single-device computation, values and gradients.

Runs inside a worker (send ``check_op_on_layouts`` or your own body calling ``check_op`` to the
pool). The single-device reference is computed in the same worker from the same global inputs,
so no data has to travel back to the parent to be compared.

    def _body():
        mesh = sw.init_device_mesh("cpu", (2, 2))
        return check_op(lambda a, b: a @ b, [torch.randn(5, 4), torch.randn(4, 3)],
                        [[Shard(0), Replicate()], [Replicate(), Shard(1)]], mesh)

    def test_mm(dist):
        assert_no_failures(dist.run(4, _body))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import shardwise as sw
from shardwise import DTensor
from shardwise.debug import CommDebugMode

__all__ = ["check_op", "assert_no_failures", "layouts_for"]


def _flat(out: Any) -> list:
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    return [out]


def check_op(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor | Any],
    layouts: Sequence[Sequence[sw.Placement] | None],
    mesh: sw.DeviceMesh,
    *,
    grad: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    expect_comms: dict[str, int] | None = None,
) -> list[str]:
    """Failures (empty if none) of ``fn`` on DTensors laid out by ``layouts`` vs plain tensors.

    Args:
        fn: the computation, written as single-device code.
        inputs: global tensors (every rank passes the same values) or non-tensor arguments.
        layouts: placements per input; None keeps that input a plain tensor / value.
        mesh: the mesh to distribute over.
        grad: also compare gradients of every floating input (upstream: fixed random weights).
        expect_comms: if given, the forward's collective counts must equal it exactly.
    """
    label = f"{getattr(fn, '__name__', fn)} on {[list(map(str, l)) if l else None for l in layouts]}"
    failures: list[str] = []
    refs = [_leaf(x, grad) for x in inputs]
    dts = [
        sw.distribute_tensor(x.detach().clone().requires_grad_(r.requires_grad), mesh, layout)
        if layout is not None else x
        for x, r, layout in zip(inputs, refs, layouts)
    ]
    want = _flat(fn(*refs))
    with CommDebugMode() as comms:
        got = _flat(fn(*dts))
    if expect_comms is not None and comms.get_comm_counts() != expect_comms:
        failures.append(f"{label}: collectives {comms.get_comm_counts()} != expected {expect_comms}")
    if len(got) != len(want):
        return failures + [f"{label}: {len(got)} outputs, single-device gave {len(want)}"]
    for i, (g, w) in enumerate(zip(got, want)):
        failures += _compare(f"{label} output {i}", g, w, atol, rtol)
    if grad:
        failures += _check_grads(label, got, want, refs, dts, atol, rtol)
    return failures


def _leaf(x: Any, grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(grad and x.is_floating_point())
    return x


def _compare(label: str, got: Any, want: Any, atol: float, rtol: float) -> list[str]:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{label}: got {type(got).__name__}, want a tensor"]
        value = got.full_tensor() if isinstance(got, DTensor) else got
        if value.shape != want.shape or value.dtype != want.dtype:
            return [f"{label}: {value.dtype}{list(value.shape)} != {want.dtype}{list(want.shape)}"]
        if not torch.allclose(value.detach().double(), want.detach().double(), atol=atol, rtol=rtol, equal_nan=True):
            diff = (value.detach().double() - want.detach().double()).abs().nan_to_num().max().item()
            return [f"{label}: values differ (max abs diff {diff:.3g})"]
        return []
    return [] if got == want else [f"{label}: {got!r} != {want!r}"]


def _check_grads(label, got, want, refs, dts, atol, rtol) -> list[str]:
    pairs = [(g, w) for g, w in zip(got, want) if isinstance(w, torch.Tensor) and w.requires_grad]
    if not pairs:
        return []
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(w.shape, generator=generator, dtype=w.dtype) for _, w in pairs]
    sum(((w * wt).sum() for (_, w), wt in zip(pairs, weights))).backward()
    local = sum(((g.full_tensor() if isinstance(g, DTensor) else g) * wt).sum() for (g, _), wt in zip(pairs, weights))
    local.backward()
    failures = []
    for i, (r, d) in enumerate(zip(refs, dts)):
        if isinstance(r, torch.Tensor) and r.requires_grad:
            if d.grad is None:
                failures.append(f"{label}: input {i} got no gradient")
            else:
                failures += _compare(f"{label} grad of input {i}", d.grad, r.grad, atol, rtol)
    return failures


def layouts_for(mesh_ndim: int, ndim: int, *, partial: bool = False) -> list[list[sw.Placement]]:
    """A spread of layouts for a tensor of rank ``ndim``: replicated, each dim sharded, nested."""
    options: list[sw.Placement] = [sw.Replicate()] + [sw.Shard(d) for d in range(ndim)]
    if partial:
        options.append(sw.Partial())
    if mesh_ndim == 1:
        return [[p] for p in options]
    return [[a, b] for a in options for b in options][: 4 + 2 * ndim]


def assert_no_failures(per_rank: list[list[str]]) -> None:
    """Parent side: every rank returned an empty failure list."""
    bad = [(rank, f) for rank, failures in enumerate(per_rank) for f in failures]
    assert not bad, "\n".join(f"rank {r}: {f}" for r, f in bad[:30])
