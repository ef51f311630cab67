"""torch.compile of DTensor programs (shardwise/compile.py): compiled equals eager equals one
device, collectives are graph nodes, no graph breaks inside a tensor-parallel block.

Real processes and gloo. Compiling is slow on this machine's CPUs, so each distributed body
checks several models and backends at once; inductor runs on the smallest model only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
import shardwise.random
from shardwise import DTensor, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.parallel.parallel_dims import ParallelDims
from shardwise.train.config import get_model_args
from shardwise.train.parallelize import ParallelOptions, build_llama, compile_backend

_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_gap(model: nn.Module, ref: nn.Module) -> float:
    return max((_full(p.grad) - _full(q.grad)).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))


# ---------------------------------------------------------------------- a TP MLP
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _tp_mlp(mesh) -> nn.Module:
    return parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _mlp_gaps(backends: tuple[str, ...]) -> dict:
    """Per backend: output and gradient gaps of the compiled TP MLP to one device."""
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    ref = _mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.square().sum().backward()
    out = {}
    for backend in backends:
        torch._dynamo.reset()
        model = _tp_mlp(mesh)
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
        got.square().sum().backward()
        out[backend] = ((got - want).abs().max().item(), _grad_gap(model, ref))
    return out


def test_tp_mlp_compiles_with_every_backend(dist):
    for gaps in dist.run(2, _mlp_gaps, ("eager", "aot_eager", "inductor"), timeout=600):
        for backend, (value, grad) in gaps.items():
            assert value < 1e-5 and grad < 1e-5, (backend, value, grad)


# ---------------------------------------------------------------------- the trainer's model
def _model(dims: ParallelDims, mesh, sequence_parallel: bool) -> nn.Module:
    shardwise.random.manual_seed(0)
    return build_llama(get_model_args("tiny"), dims, mesh, ParallelOptions(sequence_parallel=sequence_parallel), "cpu")


def _step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(_full(logits).flatten(0, 1).float(), tokens.flatten(0, 1))
    loss.backward()
    return loss.detach()


def _compile_blocks(model: nn.Module, backend) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=False)


def _layouts() -> dict:
    world = dist.get_world_size()
    return {"fsdp_tp": (ParallelDims(dp_shard=2, tp=world // 2, world_size=world), False)}


def _trainer_model_gaps() -> dict:
    """Per layout: losses (one device, eager, compiled), the compiled-vs-eager gradient gap, and
    the parameter all_gathers of an eager step (with the number of blocks)."""
    from shardwise.debug import CommDebugMode

    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    one = _model(ParallelDims(world_size=1), None, False)
    single = _step(one, tokens).item()
    out = {}
    for name, (dims, sp) in _layouts().items():
        torch._dynamo.reset()
        mesh = dims.build_mesh("cpu")
        eager, compiled = _model(dims, mesh, sp), _model(dims, mesh, sp)
        _compile_blocks(compiled, compile_backend("aot_eager+comm"))  # with the communication pass
        with CommDebugMode() as comm:
            eager_loss = _step(eager, tokens).item()
        gathers = sum(1 for r in comm.records if r.kind == "all_gather" and r.mesh.axis_name(r.axis) == "dp_shard")
        out[name] = (single, eager_loss, _step(compiled, tokens).item(), _grad_gap(compiled, eager),
                     _grad_gap(compiled, one), gathers, len(eager.layers))
    return out


def test_trainer_model_compiled_per_block_matches_eager_and_one_device(dist):
    for result in dist.run(4, _trainer_model_gaps, timeout=600):
        for name, (single, eager, compiled, gap, gap_one, gathers, blocks) in result.items():
            # Forward gathers the root and every block; backward only the blocks that were freed
            # after forward: all but the last (the root keeps its parameters, as torch's FSDP2).
            assert gathers == 1 + blocks + (blocks - 1), (name, gathers, blocks)
            assert abs(compiled - eager) <= 1e-6 * abs(eager), (name, compiled, eager)
            assert abs(compiled - single) <= 1e-5 * abs(single), (name, compiled, single)
            assert gap < 1e-6 and gap_one < 1e-4, (name, gap, gap_one)


# ---------------------------------------------------------------------- the graph itself
def _graph_collectives() -> dict:
    """Collectives of one TP+SP step: counted in the captured forward/backward graphs before
    and after shardwise's communication pass (comm_schedule), and issued by eager shardwise
    (CommDebugMode); graph breaks of one block (torch._dynamo.explain); then the bucketing of
    independent small collectives in a compiled gradient reduction."""
    from shardwise import comm_schedule
    from shardwise.debug import CommDebugMode

    world = dist.get_world_size()
    dims = ParallelDims(tp=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    censuses: dict[str, tuple] = {}

    def inspect(kind, before, gm):
        censuses[kind] = (before, comm_schedule.census(gm))

    torch._dynamo.reset()
    eager = _model(dims, mesh, True)
    block = eager.layers["0"]
    with CommDebugMode() as comm:
        eager_loss = _step(block_only := _OneBlock(block, eager), tokens)
    eager_counts = dict(comm.get_comm_counts())
    compiled = _model(dims, mesh, True)
    compiled.layers["0"].compile(backend=comm_schedule.backend("aot_eager", inspect=inspect))
    compiled_loss = _step(_OneBlock(compiled.layers["0"], compiled), tokens)
    gap = _grad_gap(compiled.layers["0"], eager.layers["0"])
    graphs = {kind: before.counts for kind, (before, _) in censuses.items()}
    optimized = {kind: (after.counts, before.overlap, after.overlap) for kind, (before, after) in censuses.items()}
    torch._dynamo.reset()
    fresh = _model(dims, mesh, True)
    x = fresh.tok_embeddings(tokens)
    explained = torch._dynamo.explain(fresh.layers["0"])(x, fresh.rotary)
    del block_only
    return {"graphs": graphs, "optimized": optimized, "eager": eager_counts, "graph_count": explained.graph_count,
            "losses": (eager_loss.item(), compiled_loss.item()), "grad_gap": gap,
            "breaks": explained.graph_break_count, "reasons": [str(r.reason) for r in explained.break_reasons],
            "bucketing": _bucketed_reduction(mesh)}


def _reduce_partials(a, b, c, d):
    """Four independent reductions of Partial values: two all_reduces, two reduce_scatters."""
    return (a.redistribute(placements=[Replicate()]), b.redistribute(placements=[Replicate()]),
            c.redistribute(placements=[Shard(0)]), d.redistribute(placements=[Shard(0)]))


def _bucketed_reduction(mesh) -> dict:
    """``_reduce_partials`` compiled with the communication pass: the collectives before and
    after bucketing, eager's count, and the gap of the results to eager."""
    from shardwise import comm_schedule
    from shardwise.debug import CommDebugMode

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(10 + rank)
    inputs = [DTensor.from_local(torch.randn(8, 3, generator=gen), mesh, [sw.Partial()]) for _ in range(4)]
    _reduce_partials(*inputs)  # settles from_local's deferred agreement check (one all_reduce)
    with CommDebugMode() as comm:
        want = _reduce_partials(*inputs)
    censuses = {}
    torch._dynamo.reset()
    fn = torch.compile(_reduce_partials, fullgraph=True,
                       backend=comm_schedule.backend("aot_eager", inspect=lambda k, b, gm: censuses.update(
                           {k: (b.counts, comm_schedule.census(gm).counts)})))
    got = fn(*inputs)
    gap = max((g.to_local() - w.to_local()).abs().max().item() for g, w in zip(got, want))
    before, after = censuses["forward"]
    return {"eager": dict(comm.get_comm_counts()), "before": before, "after": after, "gap": gap}


class _OneBlock(nn.Module):
    """Embedding, one transformer block, output: the smallest step that runs a TP+SP block."""

    def __init__(self, block: nn.Module, model: nn.Module) -> None:
        super().__init__()
        self.block, self.model = block, model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.model.tok_embeddings(tokens)
        return self.model.output(self.model.norm(self.block(h, self.model.rotary)))


def test_tp_sp_block_compiles_to_one_graph_with_its_collectives(dist):
    result = dist.run(4, _graph_collectives, timeout=600)[0]
    graphs, eager = result["graphs"], result["eager"]
    assert result["breaks"] == 0 and result["graph_count"] == 1, result["reasons"]
    eager_loss, compiled_loss = result["losses"]
    assert abs(compiled_loss - eager_loss) <= 1e-6 * abs(eager_loss) and result["grad_gap"] < 1e-6, result
    # The block's own collectives: SP all_gathers its inputs, reduce_scatters its outputs.
    assert graphs["forward"].get("all_gather", 0) >= 2 and graphs["forward"].get("reduce_scatter", 0) >= 2, graphs
    assert graphs["backward"].get("reduce_scatter", 0) >= 2 and graphs["backward"].get("all_gather", 0) >= 2, graphs
    # Every kind eager shardwise issues for the step is in the compiled graphs (the embedding
    # and output layers run eagerly around the block and issue the rest).
    assert set(graphs["forward"]) | set(graphs["backward"]) <= set(eager), (graphs, eager)
    # The communication pass keeps every collective of the chain (none is independent of
    # another) and moves independent compute between issue and wait: before it every wait
    # follows its issue directly.
    for kind, (counts, before, after) in result["optimized"].items():
        assert counts == graphs[kind] and not any(before), (kind, counts, before)
        assert len(after) == len(before) and all(a >= 0 for a in after), (kind, after)
    assert sum(result["optimized"]["backward"][2]) >= 8 and result["optimized"]["backward"][2].count(0) == 0, result
    # Independent small reductions are bucketed: eager issues 2 all_reduces + 2 reduce_scatters,
    # the compiled graph one of each; the values are eager's.
    bucketing = result["bucketing"]
    assert bucketing["eager"] == {"all_reduce": 2, "reduce_scatter": 2}, bucketing
    assert bucketing["before"] == bucketing["eager"] and bucketing["after"] == {"all_reduce": 1, "reduce_scatter": 1}, bucketing
    assert bucketing["gap"] < 1e-6, bucketing


# ---------------------------------------------------------------------- bad input
def _mixed_meshes(compiled: bool):
    world = dist.get_world_size()
    a = sw.init_device_mesh("cpu", (world,))
    b = sw.init_device_mesh("cpu", (2, world // 2))
    x = sw.distribute_tensor(torch.ones(4, 4), a, [Shard(0)])
    y = sw.distribute_tensor(torch.ones(4, 4), b, [Replicate(), Replicate()])
    fn = (lambda u, v: u + v)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    fn(x, y)


def test_an_error_under_compile_is_the_eager_error(dist):
    eager = dist.run_expect_error(4, _mixed_meshes, False, match="mesh")
    compiled = dist.run_expect_error(4, _mixed_meshes, True, match="mesh")
    # Dynamo wraps the error (and repr-escapes its quotes); the eager text is inside it.
    core = eager[0].strip().splitlines()[-1].split(": ", 1)[-1].split("'")[0]
    assert len(core) > 20 and all(core in message for message in compiled), (core, compiled[0][-400:])


# ---------------------------------------------------------------------- loss_parallel
def _vocab_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from shardwise.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _loss_parallel_gaps() -> dict:
    """Cross entropy on vocabulary-sharded logits under loss_parallel, eager and compiled:
    loss and gradient gaps to one device."""
    from shardwise.parallel import loss_parallel

    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(4)
    full, labels = torch.randn(2, 4, 8, generator=gen), torch.randint(0, 8, (2, 4), generator=gen)
    ref = full.clone().requires_grad_()
    want = F.cross_entropy(ref.flatten(0, 1), labels.flatten(0, 1))
    want.backward()
    torch._dynamo.reset()
    out = {}
    for name, fn in (("eager", _vocab_loss), ("compiled", torch.compile(_vocab_loss, backend="aot_eager"))):
        logits = sw.distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
        loss = fn(logits, labels)
        with loss_parallel():
            loss.backward()
        out[name] = ((_full(loss) - want).abs().item(), (logits.grad.full_tensor() - ref.grad).abs().max().item())
    return out


def test_loss_parallel_inside_a_compiled_function_equals_one_device(dist):
    for gaps in dist.run(2, _loss_parallel_gaps, timeout=600):
        for name, (loss_gap, grad_gap) in gaps.items():
            assert loss_gap < 1e-6 and grad_gap < 1e-6, (name, loss_gap, grad_gap)


# ---------------------------------------------------------------------- the overlap pass alone
def _two_collective_graph():
    """x @ w is all_reduced; relu(w) and its square do not need the reduction; the second
    all_reduce needs the first one's result plus the square."""
    from torch import fx

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = g.call_function(aten.mm.default, (x, w), name="a")
    b = g.call_function(aten.relu.default, (w,), name="b")
    c1 = g.call_function(c10d.all_reduce.default, (a, "sum", "0"), name="c1")
    w1 = g.call_function(c10d.wait_tensor.default, (c1,), name="w1")
    d = g.call_function(aten.mul.Tensor, (b, b), name="d")
    e = g.call_function(aten.add.Tensor, (w1, d), name="e")
    c2 = g.call_function(c10d.all_reduce.default, (e, "sum", "0"), name="c2")
    w2 = g.call_function(c10d.wait_tensor.default, (c2,), name="w2")
    f = g.call_function(aten.neg.default, (b,), name="f")
    g.output((w2, f))
    return g


def test_overlap_pass_issues_early_and_waits_late():
    from shardwise import comm_schedule

    g = _two_collective_graph()
    before = comm_schedule.census(g)
    comm_schedule.overlap_collectives(g)
    after = comm_schedule.census(g)
    assert [n.name for n in g.nodes] == ["x", "w", "a", "c1", "b", "d", "w1", "e", "c2", "f", "w2", "output"]
    assert before.counts == after.counts == {"all_reduce": 2}
    assert before.overlap == [0, 0] and after.overlap == [2, 1]
