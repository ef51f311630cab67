"""Gradients through the layout conversions (redistribute, to_local, from_local, full_tensor,
user autograd Functions), checked against the single-device gradient.

The rule under test: the gradient of a Partial value is Replicate (each contribution's gradient
is the whole gradient), never Partial, except where the incoming gradient is Partial already.
"""

import random

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode


def _mesh22():
    return sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------------- named cases
def _issue_case(mesh) -> dict:
    """The issue's program: a Partial(sum) matmul result through to_local/from_local."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 8), torch.randn(8, 4)
    x = sw.distribute_tensor(x0, mesh, [Replicate()]).requires_grad_()
    w = sw.distribute_tensor(w0, mesh, [Shard(0)])
    y = x.redistribute(mesh, [Shard(1)]) @ w
    DTensor.from_local(y.to_local(), mesh, y.placements).sum().full_tensor().backward()
    ref = x0.clone().requires_grad_()
    (ref @ w0).sum().backward()
    return {"y_placements": y.placements, "grad": x.grad.full_tensor(), "want": ref.grad}


def _local_partial_grad_cases(mesh) -> dict:
    """to_local(grad_placements=[Partial()]) where each rank computes its own loss term: the
    gradient reaching a Replicate input (from_local or redistribute) is reduced to Replicate."""
    rank = dist.get_rank()
    scale = float(rank + 1)
    total = sum(range(1, dist.get_world_size() + 1))
    t = torch.arange(6.0).reshape(2, 3).requires_grad_()
    d = DTensor.from_local(t, mesh, [Replicate()])
    (d.to_local(grad_placements=[Partial()]) * scale).sum().backward()
    x = sw.distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)]).requires_grad_()
    (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) * scale).sum().backward()
    f = sw.distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)]).requires_grad_()
    (f.full_tensor(grad_placements=[Partial()]) * scale).sum().backward()
    # Without grad_placements the local gradient of a Replicate tensor is read as the whole
    # gradient (every rank's): here each rank uses its local copy once, as one device would.
    r = sw.distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)]).requires_grad_()
    r.redistribute(mesh, [Replicate()]).to_local().sum().backward()
    return {
        "from_local": (t.grad, torch.full((2, 3), float(total))),
        "redistribute": (x.grad.to_local(), torch.full((2, 2), float(total)), x.grad.placements),
        "full_tensor": (f.grad.to_local(), torch.full((2, 2), float(total)), f.grad.placements),
        "default": (r.grad.to_local(), torch.ones(2, 2), r.grad.placements),
    }


def _partial_to_partial_case() -> dict:
    """Backward of a redistribute from Partial to Partial: the gradient stays Partial (no
    all_reduce) until it reaches the from_local block, which takes Replicate."""
    mesh = _mesh22()
    t = (torch.arange(16.0).reshape(4, 4) + dist.get_rank()).requires_grad_()
    p = DTensor.from_local(t, mesh, [Partial(), Shard(0)])
    q = p * 3.0
    seen = {}
    q.register_hook(lambda g: seen.__setitem__("placements", g.placements))
    z = q.redistribute(mesh, [Partial(), Replicate()])
    loss = (z.to_local(grad_placements=[Partial(), Replicate()]) * 2.0).sum()
    with CommDebugMode() as comms:
        loss.backward()
    return {"placements": seen["placements"], "grad": t.grad, "counts": dict(comms.get_comm_counts())}


def _dtype_case(mesh) -> dict:
    """forward_dtype: the result and the forward communication; backward_dtype: the gradient's
    communication; the input receives its own dtype. Bytes sent tell the communicated dtype."""
    x0 = torch.linspace(-1, 1, 32).reshape(8, 4)
    weight = torch.linspace(0.5, 2, 32).reshape(8, 4)
    rank = dist.get_rank()
    out = {}
    for name, fwd, bwd in (("f32", None, None), ("bf16/f16", torch.bfloat16, torch.float16)):
        x = sw.distribute_tensor(x0, mesh, [Shard(0)]).requires_grad_()
        with CommDebugMode() as forward:
            y = x.redistribute(mesh, [Replicate()], forward_dtype=fwd, backward_dtype=bwd)
        local = y.to_local(grad_placements=[Partial()])
        loss = (local.float() * weight * (rank + 1)).sum()
        with CommDebugMode() as backward:
            loss.backward()
        out[name] = {
            "dtype": y.dtype, "local_dtype": y.to_local().dtype, "value": y.full_tensor().float(),
            "grad_dtype": x.grad.dtype, "grad": x.grad.full_tensor(),
            "fwd_bytes": forward.bytes_sent, "bwd_bytes": backward.bytes_sent,
            "bwd_counts": dict(backward.get_comm_counts()),
        }
    out["x0"], out["weight"] = x0, weight
    return out


def _named_cases() -> dict:
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    out = {"issue": _issue_case(mesh), "local_partial": _local_partial_grad_cases(mesh)}
    out["partial_to_partial"] = _partial_to_partial_case()
    out["dtype"] = _dtype_case(mesh)
    return out


def test_partial_gradients_and_gradient_placements(dist):
    world = 4
    total = sum(range(1, world + 1))
    for rank, out in enumerate(dist.run(world, _named_cases)):
        issue = out["issue"]
        assert issue["y_placements"] == (Partial(),)
        assert torch.allclose(issue["grad"], issue["want"], atol=1e-5), "x.grad world-size times too large"

        local = out["local_partial"]
        got, want = local["from_local"]
        assert torch.equal(got, want)
        for key in ("redistribute", "full_tensor", "default"):
            got, want, placements = local[key]
            assert torch.equal(got, want), key
            assert placements == (Shard(0),), key

        p2p = out["partial_to_partial"]
        assert p2p["placements"] == (Partial(), Shard(0))  # was (Replicate(), Shard(0)): an extra all_reduce
        # Partial over dp (2 ranks) reduced once at the from_local block: 2 * 3 * (1 + 1)
        assert torch.equal(p2p["grad"], torch.full((4, 4), 12.0))
        assert p2p["counts"] == {"all_reduce": 1}

        dtype = out["dtype"]
        plain, cast = dtype["f32"], dtype["bf16/f16"]
        assert plain["dtype"] == torch.float32 and cast["dtype"] == cast["local_dtype"] == torch.bfloat16
        assert torch.equal(cast["value"], dtype["x0"].to(torch.bfloat16).float())
        assert plain["grad_dtype"] == cast["grad_dtype"] == torch.float32
        assert plain["bwd_counts"] == cast["bwd_counts"] == {"reduce_scatter": 1}
        assert cast["fwd_bytes"] * 2 == plain["fwd_bytes"] > 0  # gathered in bf16
        assert cast["bwd_bytes"] * 2 == plain["bwd_bytes"] > 0  # gradient reduced in f16
        assert torch.allclose(plain["grad"], dtype["weight"] * total)
        assert torch.allclose(cast["grad"], dtype["weight"] * total, rtol=1e-2)


# ---------------------------------------------------------------------- random chains
PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial()]
# Weighted: the conversions twice as often as the ops that make gradients non-trivial.
CHAIN_OPS = ("redistribute", "redistribute", "local_roundtrip", "local_roundtrip", "full_roundtrip", "local_terms",
             "user_function", "matmul", "sin")


class _TimesThree(torch.autograd.Function):
    """A user Function over DTensors: forward and backward both dispatched DTensor ops."""

    @staticmethod
    def forward(ctx, d):
        return d * 3.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class _LocalDouble(torch.autograd.Function):
    """A user Function that works on the local block and rewraps it (linear and positive, so
    valid on any placement, Partial ones included)."""

    @staticmethod
    def forward(ctx, d):
        return DTensor.from_local(d.to_local() * 2.0, d.device_mesh, d.placements, shape=d.shape, stride=d.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


def _random_placements(rng: random.Random, ndim: int, partial: bool) -> list:
    """Shard/Replicate, and with ``partial`` Partial axes of one reduce op (a DTensor holds one kind)."""
    pool = PLACEMENTS[:4] if partial else PLACEMENTS[:3]
    op = rng.choice(["sum", "sum", "avg", "max"])
    return [Partial(op) if isinstance(p, Partial) else p for p in (rng.choice(pool) for _ in range(ndim))]


def _chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's block of ``full`` under non-Partial ``placements`` (even shapes: nested chunks)."""
    block = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            block = block.chunk(mesh.size(axis), p.dim)[mesh.get_local_rank(axis)]
    return block


def _leaf(rng: random.Random, mesh, x0: torch.Tensor):
    """A DTensor leaf holding x0: distribute_tensor, or from_local blocks with Partial(sum) axes
    (contributions 1/4 and 3/4 of the block). Returns (dtensor, expected grad of the leaf from G)."""
    if rng.random() < 0.5:
        placements = _random_placements(rng, mesh.ndim, partial=False)
        x = sw.distribute_tensor(x0, mesh, placements).requires_grad_()
        return x, lambda: x.grad.full_tensor(), lambda g: g, f"distribute_tensor({placements})"
    placements = [Partial() if rng.random() < 0.4 else p for p in _random_placements(rng, mesh.ndim, False)]
    block = _chunk(x0, mesh, [Replicate() if isinstance(p, Partial) else p for p in placements])
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):  # the 2 ranks of the axis hold 1/4 and 3/4 of the block
            block = block * (0.25 if mesh.get_local_rank(axis) == 0 else 0.75)
    t = block.clone().requires_grad_()
    x = DTensor.from_local(t, mesh, placements)
    grad_layout = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return x, lambda: t.grad, lambda g: _chunk(g, mesh, grad_layout), f"from_local({placements})"


def _step(rng: random.Random, mesh, d: DTensor, v: torch.Tensor):
    """One random op on the DTensor ``d`` and the same op on its single-device value ``v``."""
    op = rng.choice(CHAIN_OPS)
    if op == "redistribute":
        placements = _random_placements(rng, mesh.ndim, partial=True)
        return d.redistribute(mesh, placements), v, f"redistribute({placements})"
    if op == "local_roundtrip":  # to_local without grad_placements, from_local with the same layout
        return DTensor.from_local(d.to_local(), mesh, d.placements, shape=d.shape, stride=d.stride()), v, op
    if op == "full_roundtrip":
        return DTensor.from_local(d.full_tensor(), mesh, [Replicate()] * mesh.ndim), v, op
    if op == "local_terms":  # each rank of a Replicate axis contributes coordinate+1 times its copy
        axes = [a for a, p in enumerate(d.placements) if p.is_replicate()]
        if not axes:
            return d, v, "local_terms(skipped: no Replicate axis)"
        axis = rng.choice(axes)
        grads = [Partial() if a == axis else (Replicate() if isinstance(p, Partial) else p)
                 for a, p in enumerate(d.placements)]
        if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in d.placements):
            d = d.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in d.placements])
            grads = [Replicate() if isinstance(p, Partial) else p for p in grads]
            grads[axis] = Partial()
        local = d.to_local(grad_placements=grads) * float(mesh.get_local_rank(axis) + 1)
        out = [Partial() if a == axis else p for a, p in enumerate(d.placements)]
        factor = sum(range(1, mesh.size(axis) + 1))
        return DTensor.from_local(local, mesh, out, shape=d.shape, stride=d.stride()), v * factor, f"local_terms(axis {axis})"
    if op == "matmul":  # a dispatched op that may leave a Partial(sum) result, as in the issue
        weight = torch.linspace(-1, 1, 64).reshape(8, 8)
        w = sw.distribute_tensor(weight, mesh, _random_placements(rng, mesh.ndim, partial=False))
        return d @ w, v @ weight, f"matmul -> {list((d @ w).placements)}"
    if op == "user_function":
        if rng.random() < 0.5:
            return _TimesThree.apply(d), v * 3.0, "TimesThree"
        return _LocalDouble.apply(d), v * 2.0, "LocalDouble"
    return d.sin(), v.sin(), "sin"


def _chains(seeds: list, length: int) -> list:
    """Random chains on a 2x2 mesh; each returns what it did and the gradients to compare."""
    mesh = _mesh22()
    results = []
    for seed in seeds:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        x0 = torch.randn(4, 8)
        weight = torch.randn(4, 8)
        d, leaf_grad, expected_block, what = _leaf(rng, mesh, x0)
        ref = x0.clone().requires_grad_()
        v, steps = ref, [what]
        for _ in range(length):
            d, v, name = _step(rng, mesh, d, v)
            steps.append(name)
        loss = (d.full_tensor() * weight).sum()
        loss.backward()
        (v * weight).sum().backward()
        results.append((seed, " -> ".join(steps), loss.detach(), (v * weight).sum().detach(),
                        leaf_grad(), expected_block(ref.grad)))
    return results


def test_random_chains_give_single_device_gradients(dist):
    for rank, results in enumerate(dist.run(4, _chains, list(range(16)), 5)):
        for seed, steps, loss, want_loss, grad, want_grad in results:
            assert torch.allclose(loss, want_loss, rtol=1e-4, atol=1e-4), (rank, seed, steps)
            assert torch.allclose(grad, want_grad, rtol=1e-4, atol=1e-4), (rank, seed, steps, grad / want_grad)


# ---------------------------------------------------------------------- from_local metadata
PERMUTED = [((1, 2, 0), [Shard(1)]), ((1, 2, 0), [Shard(0)]), ((1, 2, 0), [Shard(2)]),
            ((2, 0, 1), [Shard(0)]), ((0, 2, 1), [Replicate()]), ((1, 0, 2), [Partial()])]


def _strides_against_torch() -> list:
    """torch.distributed.tensor is the oracle for the global stride of a permuted block."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TP, Replicate as TR, Shard as TS

    ours, theirs = sw.init_device_mesh("cpu", (4,)), torch_mesh("cpu", (4,))
    as_torch = {Shard: lambda p: TS(p.dim), Replicate: lambda p: TR(), Partial: lambda p: TP()}
    base = torch.arange(24.0).reshape(2, 3, 4) + dist.get_rank()
    out = []
    for perm, placements in PERMUTED:
        block = base.permute(*perm)
        mine = DTensor.from_local(block, ours, placements)
        want = TorchDTensor.from_local(block, theirs, [as_torch[type(p)](p) for p in placements])
        out.append((perm, placements, mine.stride(), want.stride(), mine.shape, want.shape,
                    torch.equal(mine.full_tensor(), want.full_tensor())))
    checked = DTensor.from_local(base.permute(1, 2, 0), ours, [Shard(1)], run_check=True)
    out.append(("run_check", [Shard(1)], checked.stride(), TorchDTensor.from_local(
        base.permute(1, 2, 0), theirs, [TS(1)]).stride(), checked.shape, checked.shape, True))
    return out


def test_from_local_global_stride_matches_torch(dist):
    for rows in dist.run(4, _strides_against_torch):
        for perm, placements, mine, want, shape, want_shape, same_values in rows:
            assert shape == want_shape and same_values, (perm, placements)
            assert mine == want, (perm, placements, mine, want)


def _run_check_disagreement(case: str):
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    if case == "requires_grad":
        DTensor.from_local(torch.ones(2, 3, requires_grad=rank == 2), mesh, [Shard(0)], run_check=True)
    elif case == "stride":  # same memory order, but rank 1's rows are padded more: another global stride
        block = torch.ones(2, 5)[:, :3] if rank == 1 else torch.ones(2, 4)[:, :3]
        DTensor.from_local(block, mesh, [Shard(0)], run_check=True)
    elif case == "declared_stride":
        stride = (1, 8) if rank == 0 else (3, 1)
        DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=True, shape=(8, 3), stride=stride)


RUN_CHECK_ERRORS = {
    "requires_grad": r"requires_grad differs: False on ranks 0, 1, 3; True on rank 2$",
    "stride": r"the blocks imply different global strides: \[4, 1\] on ranks 0, 2, 3; \[5, 1\] on rank 1 \(pass blocks with one memory layout, or stride=\)$",
    "declared_stride": r"ranks passed different stride=: \[1, 8\] on rank 0; \[3, 1\] on ranks 1, 2, 3$",
}


@pytest.mark.parametrize("case", sorted(RUN_CHECK_ERRORS))
def test_from_local_run_check_names_disagreeing_ranks(dist, case):
    dist.run_expect_error(4, _run_check_disagreement, case, exc_type=ValueError,
                          match=r"^from_local\(run_check=True\): the blocks do not form one .* layout on mesh\(.*\): "
                                + RUN_CHECK_ERRORS[case])


# ---------------------------------------------------------------------- meta tensors
def _meta_full_tensor():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    d = DTensor.from_local(torch.empty(2, 4, device="meta"), mesh, [Shard(0)])
    with CommDebugMode() as comms:
        moved = d.redistribute(mesh, [Shard(1)])
    assert moved.to_local().is_meta and tuple(moved.to_local().shape) == (8, 1) and moved.shape == (8, 4)
    assert comms.get_total_counts() == 0
    d.full_tensor()


def test_full_tensor_of_meta_dtensor_raises_on_every_rank(dist):
    dist.run_expect_error(4, _meta_full_tensor, exc_type=ValueError,
                          match=r"full_tensor\(\) of the meta DTensor f32\[8@tp,4\] on mesh\(tp=4\): "
                                r"a meta tensor has no data")


def _strides_disagree_without_run_check():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    # Strides of size-1 dims do not matter (they differ by how a block was cut) ...
    column = torch.ones(2, 1, 3).transpose(1, 2) if dist.get_rank() == 1 else torch.ones(2, 3, 1)
    DTensor.from_local(column, mesh, [Shard(0)]).full_tensor()
    # ... a transposed block on rank 1 does: the ranks would read different global tensors.
    block = torch.ones(3, 2).t() if dist.get_rank() == 1 else torch.ones(2, 3)
    DTensor.from_local(block, mesh, [Shard(0)]).full_tensor()


def test_from_local_stride_disagreement_is_named_before_the_collective(dist):
    dist.run_expect_error(4, _strides_disagree_without_run_check, exc_type=ValueError,
                          match=r"different global tensors: f32\[8@tp,3\] on ranks 0, 2, 3; "
                                r"f32\[8@tp,3\] \(stride \[1, 8\]\) on rank 1")


# ---------------------------------------------------------------------- gradients of leaves
def _leaf_gradient_layouts() -> dict:
    """Gradients arriving Partial or differently sharded reach each kind of leaf cut into its
    blocks; a replicated leaf keeps a Partial gradient pending (no communication)."""
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = torch.randn(8, 4)
    term = lambda: DTensor.from_local(torch.full((8, 4), float(rank + 1)), mesh, [Partial()])  # noqa: E731
    out = {}
    param = torch.nn.Parameter(sw.distribute_tensor(whole, mesh, [Shard(0)]))
    with CommDebugMode() as comm:
        param.backward(gradient=term())
    out["parameter"] = (param.grad.placements, param.grad.full_tensor(), comm.get_comm_counts())
    param.backward(gradient=term())  # accumulated: still the parameter's layout
    out["accumulated"] = (param.grad.placements, param.grad.full_tensor())
    setter = sw.distribute_tensor(whole, mesh, [Shard(1)])
    setter.requires_grad = True
    setter.backward(gradient=term())
    out["setter"] = (setter.grad.placements, setter.grad.full_tensor())
    factory = sw.ones(8, 4, device_mesh=mesh, placements=[Shard(1)], requires_grad=True)
    factory.backward(gradient=sw.distribute_tensor(whole, mesh, [Shard(0)]))
    out["factory"] = (factory.grad.placements, factory.grad.full_tensor())
    pending = DTensor.from_local(torch.ones(8, 4), mesh, [Partial()]).detach().requires_grad_()
    pending.backward(gradient=term())
    out["partial_leaf"] = (pending.grad.placements, pending.grad.full_tensor())
    replicated = sw.distribute_tensor(whole, mesh, [Replicate()]).requires_grad_()
    with CommDebugMode() as comm:
        (replicated * 1.0).backward(gradient=term())  # deferred: reduced by whoever reads it
    out["replicated_leaf"] = (replicated.grad.placements, replicated.grad.full_tensor(), comm.get_comm_counts())
    out["whole"] = whole
    return out


def test_leaf_gradients_arrive_in_the_leaf_layout(dist):
    world = 4
    total = torch.full((8, 4), float(sum(range(1, world + 1))))
    for out in dist.run(world, _leaf_gradient_layouts):
        placements, grad, counts = out["parameter"]
        assert placements == (Shard(0),) and torch.equal(grad, total)
        assert counts == {"reduce_scatter": 1}  # not an all_reduce then a chunk
        assert out["accumulated"][0] == (Shard(0),) and torch.equal(out["accumulated"][1], 2 * total)
        assert out["setter"][0] == (Shard(1),) and torch.equal(out["setter"][1], total)
        assert out["factory"][0] == (Shard(1),) and torch.equal(out["factory"][1], out["whole"])
        assert out["partial_leaf"][0] == (Replicate(),) and torch.equal(out["partial_leaf"][1], total)
        placements, grad, counts = out["replicated_leaf"]
        assert placements == (Partial(),) and torch.equal(grad, total) and counts == {}
