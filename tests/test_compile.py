"""torch.compile of DTensor programs (shardwise/compile/opaque.py): compiled equals eager equals one
device, collectives are graph nodes, no graph breaks inside a tensor-parallel block.

The matrix: a TP MLP and a TP+SP Llama block on 2 ranks, an FSDP+TP two-block model on 4 (the
one with two mesh axes), values and gradients against eager shardwise and against one device.
Every rank compiles its own graphs, so ranks beyond what the layout needs only compile the same
graphs again (the 2-rank TP tests cost half the CPU of 4-rank ones; the pools' workers have
Dynamo and Inductor imported already, tests/harness.py). The MLP is compiled with the backends
eager, aot_eager and inductor; the two larger models with aot_eager and inductor (``COMPILING``):
the eager backend runs Dynamo's graph on DTensors, the path the MLP already covers, and tracing
a block costs seconds per backend. Real processes and gloo. Compiling is slow on small CPUs, so
each model is one distributed body that runs all its backends (see ``_matrix_backends``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
import shardwise.tensor.random
from shardwise import DTensor, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.parallel.dims import ParallelDims
from shardwise.train.config import get_model_args
from shardwise.train.models.llama import build_llama
from shardwise.train.parallelize import ParallelOptions

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


BACKENDS = ("eager", "aot_eager", "inductor")
COMPILING = ("aot_eager", "inductor")  # the backends that compile the graph they are handed


def _matrix_backends(backends: tuple[str, ...] = BACKENDS):
    """For each backend of the matrix: its name, the backend wrapped to count the graphs Dynamo
    hands it, and that count (zero graphs would mean the code ran eagerly, not compiled).

    Dynamo's caches are reset before each backend, so no backend reuses another's graphs or
    runs into the recompile limit (past it Dynamo silently runs eagerly). Inductor compiles
    in this process (compile_threads=1): the ranks already share the CPUs, and its
    compile-worker pool would start one more process per rank.
    """
    import torch._inductor.config as inductor_config

    for name in backends:
        torch._dynamo.reset()
        inner, graphs = torch._dynamo.lookup_backend(name), []

        def counted(gm, example_inputs, inner=inner, graphs=graphs):
            graphs.append(gm)
            return inner(gm, example_inputs)

        with inductor_config.patch(compile_threads=1):
            yield name, counted, graphs.__len__


# ---------------------------------------------------------------------- a TP MLP
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _tp_mlp(mesh) -> nn.Module:
    return parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _mlp_gaps() -> dict:
    """Per backend: output and gradient gaps of the compiled TP MLP to eager shardwise and to
    one device, and the graphs the backend compiled."""
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    ref = _mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.square().sum().backward()
    eager = _tp_mlp(mesh)
    eager_out = eager(x)
    eager_out.square().sum().backward()
    out = {}
    for backend, counted, graphs in _matrix_backends():
        model = _tp_mlp(mesh)
        got = torch.compile(model, backend=counted, fullgraph=True)(x)
        got.square().sum().backward()
        out[backend] = ((got - eager_out).abs().max().item(), _grad_gap(model, eager),
                        (got - want).abs().max().item(), _grad_gap(model, ref), graphs())
    return out


def test_tp_mlp_compiles_with_every_backend(dist):
    for gaps in dist.run(2, _mlp_gaps, timeout=600):
        assert set(gaps) == set(BACKENDS), gaps
        for backend, (value, grad, value_one, grad_one, graphs) in gaps.items():
            assert graphs == 1, (backend, graphs)  # fullgraph: one forward graph, compiled once
            assert value < 1e-5 and grad < 1e-5, (backend, value, grad)
            assert value_one < 1e-5 and grad_one < 1e-5, (backend, value_one, grad_one)


# ---------------------------------------------------------------------- the trainer's model
def _model(dims: ParallelDims, mesh, sequence_parallel: bool) -> nn.Module:
    shardwise.tensor.random.manual_seed(0)
    return build_llama(get_model_args("tiny"), dims, mesh, ParallelOptions(sequence_parallel=sequence_parallel), "cpu")


def _step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(_full(logits).flatten(0, 1).float(), tokens.flatten(0, 1))
    loss.backward()
    return loss.detach()


def _compile_blocks(model: nn.Module, backend) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=False)


def _trainer_model_gaps() -> dict:
    """The FSDP+TP two-block model (dp_shard=2 x tp=2), each block compiled as the trainer
    compiles it, per backend: the loss, the gradient gaps to eager shardwise and to one device,
    and the graphs compiled; plus the one-device and eager losses and the parameter
    all_gathers of an eager step (with the number of blocks)."""
    from shardwise.debug import CommDebugMode

    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    one = _model(ParallelDims(world_size=1), None, False)
    single = _step(one, tokens).item()
    world = dist.get_world_size()
    dims = ParallelDims(dp_shard=2, tp=world // 2, world_size=world)
    mesh = dims.build_mesh("cpu")
    eager = _model(dims, mesh, False)
    with CommDebugMode() as comm:
        eager_loss = _step(eager, tokens).item()
    gathers = sum(1 for r in comm.records if r.kind == "all_gather" and r.mesh.axis_name(r.axis) == "dp_shard")
    out: dict = {"eager": (single, eager_loss, gathers, len(eager.layers)), "compiled": {}}
    for backend, counted, graphs in _matrix_backends(COMPILING):
        compiled = _model(dims, mesh, False)
        _compile_blocks(compiled, counted)
        out["compiled"][backend] = (_step(compiled, tokens).item(), _grad_gap(compiled, eager),
                                    _grad_gap(compiled, one), graphs())
    return out


def test_fsdp_tp_model_compiled_per_block_matches_eager_and_one_device(dist):
    for result in dist.run(4, _trainer_model_gaps, timeout=600):
        single, eager, gathers, blocks = result["eager"]
        # Forward gathers the root and every block; backward only the blocks that were freed
        # after forward: all but the last (the root keeps its parameters, as torch's FSDP2).
        assert gathers == 1 + blocks + (blocks - 1), (gathers, blocks)
        assert blocks == 2 and abs(eager - single) <= 1e-5 * abs(single), (blocks, eager, single)
        assert set(result["compiled"]) == set(COMPILING), result
        for backend, (loss, gap, gap_one, graphs) in result["compiled"].items():
            assert graphs >= 1, (backend, graphs)
            assert abs(loss - eager) <= 1e-6 * abs(eager), (backend, loss, eager)
            assert abs(loss - single) <= 1e-5 * abs(single), (backend, loss, single)
            assert gap < 1e-5 and gap_one < 1e-4, (backend, gap, gap_one)


# ---------------------------------------------------------------------- a TP+SP Llama block
def _block_gaps() -> dict:
    """The TP+SP Llama block (tp=4) compiled alone (fullgraph) inside an eager model, per
    backend: the loss, the block's gradient gaps to eager shardwise and to one device, and the
    graphs compiled; plus the one-device and eager losses."""
    world = dist.get_world_size()
    dims = ParallelDims(tp=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    one = _model(ParallelDims(world_size=1), None, False)
    single = _step(_OneBlock(one.layers["0"], one), tokens).item()
    eager = _model(dims, mesh, True)
    out: dict = {"eager": (single, _step(_OneBlock(eager.layers["0"], eager), tokens).item()), "compiled": {}}
    for backend, counted, graphs in _matrix_backends(COMPILING):
        model = _model(dims, mesh, True)
        block = model.layers["0"]
        block.compile(backend=counted, fullgraph=True)
        loss = _step(_OneBlock(block, model), tokens).item()
        out["compiled"][backend] = (loss, _grad_gap(block, eager.layers["0"]), _grad_gap(block, one.layers["0"]), graphs())
    return out


def test_tp_sp_block_compiles_with_every_compiling_backend(dist):
    for result in dist.run(2, _block_gaps, timeout=600):
        single, eager = result["eager"]
        assert abs(eager - single) <= 1e-5 * abs(single), (eager, single)
        assert set(result["compiled"]) == set(COMPILING), result
        for backend, (loss, gap, gap_one, graphs) in result["compiled"].items():
            assert graphs == 1, (backend, graphs)
            assert abs(loss - eager) <= 1e-6 * abs(eager), (backend, loss, eager)
            assert abs(loss - single) <= 1e-5 * abs(single), (backend, loss, single)
            assert gap < 1e-5 and gap_one < 1e-4, (backend, gap, gap_one)


# ---------------------------------------------------------------------- the graph itself
def _graph_collectives() -> dict:
    """Collectives of one TP+SP step: counted in the captured forward/backward graphs before
    and after shardwise's communication pass (comm_schedule), and issued by eager shardwise
    (CommDebugMode); the block is compiled whole (fullgraph: a graph break raises) into one
    forward graph; then the bucketing of independent small collectives in a compiled gradient
    reduction."""
    from shardwise.compile import schedule as comm_schedule
    from shardwise.debug import CommDebugMode

    world = dist.get_world_size()
    dims = ParallelDims(tp=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    censuses: dict[str, tuple] = {}
    compiled_kinds: list[str] = []

    def inspect(kind, before, gm):
        compiled_kinds.append(kind)
        censuses[kind] = (before, comm_schedule.census(gm))

    torch._dynamo.reset()
    eager = _model(dims, mesh, True)
    block = eager.layers["0"]
    with CommDebugMode() as comm:
        eager_loss = _step(block_only := _OneBlock(block, eager), tokens)
    eager_counts = dict(comm.get_comm_counts())
    compiled = _model(dims, mesh, True)
    compiled.layers["0"].compile(backend=comm_schedule.backend("aot_eager", inspect=inspect), fullgraph=True)
    compiled_loss = _step(_OneBlock(compiled.layers["0"], compiled), tokens)
    gap = _grad_gap(compiled.layers["0"], eager.layers["0"])
    graphs = {kind: before.counts for kind, (before, _) in censuses.items()}
    optimized = {kind: (after.counts, before.overlap, after.overlap) for kind, (before, after) in censuses.items()}
    del block_only
    return {"graphs": graphs, "optimized": optimized, "eager": eager_counts, "compiled_kinds": compiled_kinds,
            "losses": (eager_loss.item(), compiled_loss.item()), "grad_gap": gap,
            "bucketing": _bucketed_reduction(mesh)}


def _reduce_partials(a, b, c, d):
    """Four independent reductions of Partial values: two all_reduces, two reduce_scatters."""
    return (a.redistribute(placements=[Replicate()]), b.redistribute(placements=[Replicate()]),
            c.redistribute(placements=[Shard(0)]), d.redistribute(placements=[Shard(0)]))


def _bucketed_reduction(mesh) -> dict:
    """``_reduce_partials`` compiled with the communication pass: the collectives before and
    after bucketing, eager's count, and the gap of the results to eager."""
    from shardwise.compile import schedule as comm_schedule
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
    result = dist.run(2, _graph_collectives, timeout=600)[0]
    graphs, eager = result["graphs"], result["eager"]
    assert result["compiled_kinds"] == ["forward", "backward"], result["compiled_kinds"]  # one graph each
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


# ---------------------------------------------------------------------- graph breaks vs torch's DTensor
def _dtensor_library(name: str):
    """The names the comparison programs use, from shardwise or from torch.distributed.tensor."""
    if name == "torch":
        from torch.distributed.tensor import DTensor as T, Replicate as R, Shard as S, distribute_tensor, init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel as C, RowwiseParallel as W, parallelize_module as P
    else:
        from shardwise import DTensor as T, Replicate as R, Shard as S, distribute_tensor, init_device_mesh
        from shardwise.parallel import ColwiseParallel as C, RowwiseParallel as W, parallelize_module as P
    return T, R, S, distribute_tensor, init_device_mesh, C, W, P


def _break_counts() -> dict:
    """Graph breaks (``torch._dynamo.explain``) of the same small programs written against
    shardwise and against torch's DTensor, per program: (shardwise, torch, shardwise's reasons)."""
    out: dict = {}
    for lib in ("shardwise", "torch"):
        T, R, S, distribute_tensor, init_device_mesh, C, W, P = _dtensor_library(lib)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        x = distribute_tensor(torch.randn(8, 4, generator=torch.Generator().manual_seed(5)), mesh, [S(0)])
        mlp = P(_mlp(), mesh, {"0": C(), "2": W()})
        programs = {
            "ops": (lambda t: (t @ t.T).relu().sum(), x),
            "redistribute(placements=...)": (lambda t: t.redistribute(placements=[R()]) * 2, x),
            "redistribute(mesh, ...)": (lambda t: t.redistribute(mesh, [R()]) * 2, x),
            "(t * 2).redistribute(mesh, ...)": (lambda t: (t * 2).redistribute(mesh, [R()]) + mesh.size(), x),
            "full_tensor": (lambda t: t.full_tensor() + 1, x),
            "from_local/to_local": (lambda b: T.from_local(b * 2, mesh, [S(0)]).redistribute(placements=[R()]).to_local() + 1,
                                    torch.ones(2, 4)),
            "TP MLP": (mlp, torch.randn(8, 16, generator=torch.Generator().manual_seed(6))),
        }
        for name, (fn, arg) in programs.items():
            torch._dynamo.reset()
            explained = torch._dynamo.explain(fn)(arg)
            out.setdefault(name, {})[lib] = (explained.graph_break_count, [str(r.reason) for r in explained.break_reasons])
    torch._dynamo.reset()
    return out




def test_graph_breaks_no_more_than_torch_dtensor(dist):
    for counts in dist.run(2, _break_counts, timeout=600):
        for name, result in counts.items():
            (ours, reasons), (theirs, _) = result["shardwise"], result["torch"]
            assert ours <= theirs, (name, ours, theirs, reasons)
        # A mesh passed into a DTensor method call is a graph input (an opaque reference, as
        # torch's): no break, on an input and on an intermediate.
        assert counts["redistribute(mesh, ...)"]["shardwise"][0] == 0, counts["redistribute(mesh, ...)"]
        assert counts["(t * 2).redistribute(mesh, ...)"]["shardwise"][0] == 0, counts


def _onto_other_meshes() -> dict:
    """A compiled program that moves DTensors onto other meshes over the same ranks (a
    flattened mesh, the reversed axes), forward and backward: gaps to eager."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    flat = mesh.flatten("ab")
    swapped = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("b", "a"))

    def fn(t: DTensor) -> torch.Tensor:
        u = (t * 2).redistribute(flat, [Shard(0)])              # relabel: no communication
        v = t.redistribute(swapped, [Shard(1), Replicate()])  # through a layout of the source mesh
        return (u.redistribute(placements=[Replicate()]).to_local() + v.full_tensor()).square().sum()

    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(8))
    out = {}
    torch._dynamo.reset()
    for name, run in (("eager", fn), ("compiled", torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False))):
        x = sw.distribute_tensor(full, mesh, [Shard(0), Replicate()]).requires_grad_()
        loss = run(x)
        loss.backward()
        out[name] = (loss.item(), x.grad.full_tensor())
    return {"loss_gap": abs(out["compiled"][0] - out["eager"][0]),
            "grad_gap": (out["compiled"][1] - out["eager"][1]).abs().max().item(),
            "grad_vs_one_device": (out["eager"][1] - 18 * full).abs().max().item()}  # d/dx sum((3x)^2)


def test_redistribute_onto_another_mesh_compiles_to_one_graph_with_eager_values(dist):
    for gaps in dist.run(4, _onto_other_meshes, timeout=300):
        assert gaps["loss_gap"] < 1e-4 and gaps["grad_gap"] < 1e-5 and gaps["grad_vs_one_device"] < 1e-5, gaps


# ---------------------------------------------------------------------- bad input
def _mixed_meshes(compiled: bool):
    world = dist.get_world_size()
    a = sw.init_device_mesh("cpu", (world,))
    b = sw.init_device_mesh("cpu", (2, world // 2))
    x = sw.distribute_tensor(torch.ones(4, 4), a, [Shard(0)])
    y = sw.distribute_tensor(torch.ones(4, 4), b, [Replicate(), Replicate()])

    def fn(u, v):
        return u + v

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
    from shardwise.compile import schedule as comm_schedule

    g = _two_collective_graph()
    before = comm_schedule.census(g)
    comm_schedule.overlap_collectives(g)
    after = comm_schedule.census(g)
    assert [n.name for n in g.nodes] == ["x", "w", "a", "c1", "b", "d", "w1", "e", "c2", "f", "w2", "output"]
    assert before.counts == after.counts == {"all_reduce": 2}
    assert before.overlap == [0, 0] and after.overlap == [2, 1]


_LAZY_DYNAMO_PROGRAM = """
import inspect, sys
import shardwise, shardwise.parallel.data_parallel.state, shardwise.parallel.tensor_parallel.loss
assert "torch._dynamo" not in sys.modules, "import shardwise imported torch._dynamo"
torch_stacks = [m for m in sys.modules if m.startswith(("torch.distributed.tensor", "torch.distributed.checkpoint"))]
assert not torch_stacks, f"import shardwise imported torch's DTensor or checkpoint: {torch_stacks}"
import shardwise.tensor.dtensor as d
eager_from_local = d._from_local
import torch._dynamo
from torch._dynamo import trace_rules
from torch._dynamo.eval_frame import innermost_fn
assert d._from_local is not eager_from_local and trace_rules.is_nonstrict_trace_callable(d._from_local)
hooks = [shardwise.parallel.data_parallel.state.FSDPState._pre_forward, shardwise.parallel.tensor_parallel.loss._LossParallel.__enter__]
for hook in hooks:
    assert inspect.getattr_static(hook, "_torchdynamo_disable", False), hook
    assert innermost_fn(hook) is not hook, hook
print("ok")
"""


@pytest.mark.e2e
def test_import_leaves_dynamo_unloaded_and_marks_when_it_loads():
    """``import shardwise`` does not import torch._dynamo (seconds of every process start);
    the Dynamo markings (shardwise/compile/opaque.py) are in place as soon as it is imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _LAZY_DYNAMO_PROGRAM], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
