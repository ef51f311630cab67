"""torch's tensor-parallel API surface: uneven Colwise/Rowwise splits, head alignment,
PrepareModuleInputOutput, PrepareModuleInput keyword layouts, parallelize_module's optional mesh
and plan, src_data_rank, local_map.

Oracle: the same module on one device (values and gradients).
"""

import warnings

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, parallelize_module,
)
from shardwise.parallel.tensor_parallel.heads import block_sizes
from tests.llama_block import Block, rotary_tables

TP = 4
# An attention block whose dims are all uneven on 4 ranks: 7 heads of 2 (14 features: blocks
# 4, 4, 4, 2, whole heads) and a 10-wide MLP hidden layer (blocks 3, 3, 3, 1).
DIM, HEADS, HIDDEN, SEQ = 14, 7, 10, 6


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))


def _embeddings() -> nn.ModuleDict:
    torch.manual_seed(2)
    return nn.ModuleDict({"rows": nn.Embedding(10, 6), "cols": nn.Embedding(11, 10)})


def _block() -> Block:
    torch.manual_seed(3)
    return Block(dim=DIM, n_heads=HEADS, n_kv_heads=HEADS, hidden=HIDDEN)


_BLOCK_PLAN = {
    "attention.w[qkv]": ColwiseParallel(), "attention.wo": RowwiseParallel(),
    "feed_forward.w[13]": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
}


class _Mix(nn.Module):
    """Needs its whole input (a sum over dim 0), hands on rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + x.sum(0, keepdim=True)


class _Masked(nn.Module):
    """Takes a keyword tensor whole; checks it receives plain tensors (use_local_output)."""

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        assert not isinstance(x, DTensor) and not isinstance(mask, DTensor)
        return x * mask.sum(0)[:, None]


def _data():
    torch.manual_seed(5)
    return (torch.randn(3, 6, requires_grad=True), torch.tensor([[0, 9, 4], [7, 3, 8]]),
            torch.randn(2, SEQ, DIM, requires_grad=True), torch.randn(8, 3))


def _grads(module: nn.Module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _run_all(module_sets: dict, x, ids, h, rows):
    """Forward, backward, values and gradients of every case (same code on one device)."""
    mlp, emb, block = module_sets["mlp"], module_sets["emb"], module_sets["block"]
    res = {}
    y = mlp(x)
    y.pow(2).sum().backward()
    res["mlp"] = (y.detach(), x.grad, _grads(mlp))
    cols = emb["cols"](ids).pow(2).sum()  # distributed: a DTensor (use_local_output=False)
    e = emb["rows"](ids).sum() + (cols.full_tensor() if isinstance(cols, DTensor) else cols)
    e.backward()
    res["emb"] = (e.detach(), _grads(emb))
    rope = rotary_tables(SEQ, DIM // HEADS)
    out = block(h, rope)
    out.pow(2).sum().backward()
    res["block"] = (out.detach(), h.grad, _grads(block))
    mixed = module_sets["mix"](rows)
    res["mix"] = mixed
    return res


def _uneven_distributed():
    mesh = sw.init_device_mesh("cpu", (TP,))
    mlp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    emb = parallelize_module(_embeddings(), mesh, {"rows": RowwiseParallel(),
                                                   "cols": ColwiseParallel(use_local_output=False)})
    block = parallelize_module(_block(), mesh, _BLOCK_PLAN)
    mix = parallelize_module(_Mix(), mesh, PrepareModuleInputOutput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    x, ids, h, rows = _data()
    rank = torch.distributed.get_rank()
    local_rows = rows[2 * rank:2 * rank + 2]  # this rank's rows of the 8 (Shard(0) input)
    with CommDebugMode() as mix_comm:
        mix_out = mix(local_rows)
    res = _run_all({"mlp": mlp, "emb": emb, "block": block, "mix": lambda r: mix_out}, x, ids, h, rows)
    res["local_shapes"] = {
        "mlp.0.weight": tuple(mlp[0].weight.to_local().shape), "mlp.2.weight": tuple(mlp[2].weight.to_local().shape),
        "emb.rows": tuple(emb["rows"].weight.to_local().shape), "emb.cols": tuple(emb["cols"].weight.to_local().shape),
        "wq": tuple(block.attention.wq.weight.to_local().shape),
    }
    res["mix_counts"] = mix_comm.get_comm_counts()
    masked = parallelize_module(_Masked(), mesh, PrepareModuleInput(
        input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"mask": Replicate()},
        use_local_output=True))
    res["masked"] = masked(x.detach(), mask=local_rows)
    return res


def test_uneven_colwise_rowwise_match_single_device(dist):
    """10 features (and 7 heads of 2) on 4 ranks: split as torch.chunk, values and gradients
    equal the single-device ones; PrepareModuleInputOutput moves inputs and outputs."""
    x, ids, h, rows = _data()
    want = _run_all({"mlp": _mlp(), "emb": _embeddings(), "block": _block(), "mix": _Mix()}, x, ids, h, rows)
    tol = dict(atol=1e-5, rtol=1e-5)
    for rank, got in enumerate(dist.run(TP, _uneven_distributed)):
        hidden_block = block_sizes(10, TP)[rank]  # 3, 3, 3, 1
        assert got["local_shapes"] == {
            "mlp.0.weight": (hidden_block, 6), "mlp.2.weight": (6, hidden_block),
            "emb.rows": (hidden_block, 6), "emb.cols": (11, hidden_block),
            "wq": (block_sizes(DIM, TP)[rank], DIM),
        }
        for case in ("mlp", "block"):
            out, in_grad, grads = got[case]
            w_out, w_in_grad, w_grads = want[case]
            torch.testing.assert_close(out, w_out, **tol)
            torch.testing.assert_close(in_grad, w_in_grad, **tol)
            assert grads.keys() == w_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], w_grads[name], **tol, msg=f"{case} {name}")
        torch.testing.assert_close(got["emb"][0], want["emb"][0], **tol)
        for name, g in got["emb"][1].items():
            torch.testing.assert_close(g, want["emb"][1][name], **tol, msg=name)
        torch.testing.assert_close(got["mix"], want["mix"][2 * rank:2 * rank + 2], **tol)
        assert sum(got["mix_counts"].values()) == 1, got["mix_counts"]  # one all_gather in, none out
        torch.testing.assert_close(got["masked"], _Masked()(x.detach(), mask=rows), **tol)


def _split_heads():
    torch.manual_seed(0)
    parallelize_module(Block(dim=10, n_heads=5, n_kv_heads=5, hidden=12), sw.init_device_mesh("cpu", (TP,)),
                       {"attention.wq": ColwiseParallel()})


def _split_heads_rowwise():
    parallelize_module(Block(dim=12, n_heads=6, n_kv_heads=6, hidden=12), sw.init_device_mesh("cpu", (TP,)),
                       {"attention.wo": RowwiseParallel()})


def _kv_heads_apart():
    # 12 query heads over 3 kv heads (head_dim 2) on 4 ranks: 3 query heads per rank, kv heads 1, 1, 1, 0.
    parallelize_module(Block(dim=24, n_heads=12, n_kv_heads=3, hidden=8), sw.init_device_mesh("cpu", (TP,)),
                       {"attention.w[qkv]": ColwiseParallel()})


def test_a_split_that_would_cut_an_attention_head_names_module_and_numbers(dist):
    """Uneven splits are refused only where the attention's view into heads needs whole heads,
    or its grouped kv heads would not match the query heads of the same rank."""
    dist.run_expect_error(TP, _split_heads, match=(
        r"plan\['attention.wq'\] on module 'attention.wq' \(Linear.*would split attention heads across ranks: "
        r"its 10 out_features are 5 heads of 2 \(attention.head_dim = 2\).*\[3, 3, 3, 1\] features "
        r"\(1.5, 1.5, 1.5, 0.5 heads\).*\(1, 3, 5 ranks\)"))
    dist.run_expect_error(TP, _split_heads_rowwise, match=(
        r"module 'attention.wo'.*its 12 in_features are 6 heads of 2.*\[3, 3, 3, 3\] features"))
    dist.run_expect_error(TP, _kv_heads_apart, match=(
        r"splits the attention heads of module 'attention' apart: the 12 heads of 'attention.wq' share the 3 "
        r"heads of 'attention.wk' in groups of 4, but the 4 ranks .* would hold \[3, 3, 3, 3\] and \[1, 1, 1, 0\]"))


def _default_mesh_and_src_rank():
    rank = torch.distributed.get_rank()
    own = _mlp(seed=10 + rank)  # every rank initialized differently
    own_w = own[0].weight.detach().clone()
    with CommDebugMode() as local_only:
        parallelize_module(own, parallelize_plan={"0": ColwiseParallel()}, src_data_rank=None)
    from_zero = parallelize_module(_mlp(seed=10 + rank), parallelize_plan={"0": ColwiseParallel()})
    rank0_w = _mlp(seed=10)[0].weight.detach()
    rows = slice(3 * rank, 3 * rank + block_sizes(10, TP)[rank])
    return (own[0].weight.device_mesh.size(), local_only.get_total_counts(),
            torch.equal(own[0].weight.to_local(), own_w[rows]),
            torch.equal(from_zero[0].weight.to_local(), rank0_w[rows]))


def test_parallelize_module_default_mesh_and_src_data_rank(dist):
    """No mesh: the world; src_data_rank=None: each rank's own values, no communication;
    default 0: rank 0's values everywhere."""
    assert dist.run(TP, _default_mesh_and_src_rank) == [(TP, 0, True, True)] * TP


def test_parallelize_module_without_a_plan_warns_and_changes_nothing():
    model = _mlp()
    with pytest.warns(UserWarning, match="no parallelize_plan"):
        assert parallelize_module(model) is model
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(TypeError, match="must be a ParallelStyle or a dict of them, got list"):
        parallelize_module(model, None, [ColwiseParallel()])


def test_prepare_module_input_output_arguments():
    style = PrepareModuleInputOutput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"mask": Replicate()},
        use_local_input=True, output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False)
    assert style.prepare_module_input.desired_input_kwarg_layouts == {"mask": Replicate()}
    assert style.prepare_module_input.use_local_output and not style.prepare_module_output.use_local_output
    with pytest.raises(ValueError, match="should have same length!.*2 input layouts but 1 desired"):
        PrepareModuleInputOutput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),),
                                 output_layouts=Replicate(), desired_output_layouts=Shard(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repr(style)


# ---------------------------------------------------------------------- local_map
def _local_map_body():
    from shardwise import Partial
    from shardwise.experimental import local_map

    mesh = sw.init_device_mesh("cpu", (TP,))
    torch.manual_seed(7)
    x_full, w_full = torch.randn(8, 3), torch.randn(3, 2)
    x = sw.distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = sw.distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    mm = local_map(torch.mm, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                   in_grad_placements=([Shard(0)], [Partial()]))
    with CommDebugMode() as forward:
        y = mm(x, w)
    y.pow(2).sum().backward()
    errors = []
    x_rep = sw.distribute_tensor(x_full, mesh, [Replicate()])
    try:
        mm(x_rep, w)
    except ValueError as err:
        errors.append(str(err))
    moved = local_map(torch.mm, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                      redistribute_inputs=True)(x_rep, w)
    return (y.placements, forward.get_total_counts(), y.full_tensor().detach(), x.grad.full_tensor(),
            w.grad.full_tensor(), errors, moved.full_tensor())


def test_local_map_runs_a_blockwise_function_on_dtensors(dist):
    """A blockwise matmul through local_map: no communication, values and gradients (the
    replicated weight's per-rank gradients read as Partial) equal the single-device ones."""
    torch.manual_seed(7)
    x, w = torch.randn(8, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    y = x @ w
    y.pow(2).sum().backward()
    for placements, comms, got_y, x_grad, w_grad, errors, moved in dist.run(TP, _local_map_body):
        assert placements == (Shard(0),) and comms == 0
        torch.testing.assert_close(got_y, y.detach())
        torch.testing.assert_close(x_grad, x.grad)
        torch.testing.assert_close(w_grad, w.grad)
        torch.testing.assert_close(moved, y.detach())
        assert len(errors) == 1 and "local_map(mm): argument 0" in errors[0] and "redistribute_inputs=True" in errors[0]

