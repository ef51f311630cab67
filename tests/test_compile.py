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
from shardwise.train.parallelize import ParallelOptions, build_llama

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
    """Per layout: losses (one device, eager, compiled) and the compiled-vs-eager gradient gap."""
    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    one = _model(ParallelDims(world_size=1), None, False)
    single = _step(one, tokens).item()
    out = {}
    for name, (dims, sp) in _layouts().items():
        torch._dynamo.reset()
        mesh = dims.build_mesh("cpu")
        eager, compiled = _model(dims, mesh, sp), _model(dims, mesh, sp)
        _compile_blocks(compiled, "aot_eager")
        out[name] = (single, _step(eager, tokens).item(), _step(compiled, tokens).item(), _grad_gap(compiled, eager),
                     _grad_gap(compiled, one))
    return out


def test_trainer_model_compiled_per_block_matches_eager_and_one_device(dist):
    for result in dist.run(4, _trainer_model_gaps, timeout=600):
        for name, (single, eager, compiled, gap, gap_one) in result.items():
            assert abs(compiled - eager) <= 1e-6 * abs(eager), (name, compiled, eager)
            assert abs(compiled - single) <= 1e-5 * abs(single), (name, compiled, single)
            assert gap < 1e-6 and gap_one < 1e-4, (name, gap, gap_one)


# ---------------------------------------------------------------------- the graph itself
def _graph_collectives() -> dict:
    """Collectives of one TP+SP step: counted in the captured forward/backward graphs, and
    issued by eager shardwise (CommDebugMode); graph breaks of one block (torch._dynamo.explain)."""
    from torch._dynamo.backends.common import aot_autograd

    from shardwise.debug import CommDebugMode

    world = dist.get_world_size()
    dims = ParallelDims(tp=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    args = get_model_args("tiny")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    graphs: dict[str, list] = {"forward": [], "backward": []}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return gm
        return compiler

    torch._dynamo.reset()
    eager = _model(dims, mesh, True)
    block = eager.layers["0"]
    with CommDebugMode() as comm:
        eager_loss = _step(block_only := _OneBlock(block, eager), tokens)
    eager_counts = dict(comm.get_comm_counts())
    compiled = _model(dims, mesh, True)
    compiled.layers["0"].compile(backend=aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward")))
    compiled_loss = _step(_OneBlock(compiled.layers["0"], compiled), tokens)
    gap = _grad_gap(compiled.layers["0"], eager.layers["0"])
    counts = {}
    for kind, gms in graphs.items():
        found: dict[str, int] = {}
        for gm in gms:
            for node in gm.graph.nodes:
                name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
                if node.op == "call_function" and name in _COLLECTIVES:
                    found[_COLLECTIVES[name]] = found.get(_COLLECTIVES[name], 0) + 1
        counts[kind] = found
    torch._dynamo.reset()
    fresh = _model(dims, mesh, True)
    x = fresh.tok_embeddings(tokens)
    explained = torch._dynamo.explain(fresh.layers["0"])(x, fresh.rotary)
    del block_only
    return {"graphs": counts, "eager": eager_counts, "graph_count": explained.graph_count,
            "losses": (eager_loss.item(), compiled_loss.item()), "grad_gap": gap,
            "breaks": explained.graph_break_count, "reasons": [str(r.reason) for r in explained.break_reasons]}


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
