"""Tensor-parallel styles and parallelize_module on a Llama-style block, against single-device."""

import warnings

import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module,
)
from tests.llama_block import make_block, rotary_tables

TP = 4
BATCH, SEQ = 2, 8


def _inputs():
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    return x, rotary_tables(SEQ, 4)


def _reference():
    block = make_block()
    x, rope = _inputs()
    out = block(x, rope)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _plan(sequence_parallel: bool, prepare: bool = True) -> dict:
    rowwise_out = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=rowwise_out),
        "feed_forward.w[13]": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=rowwise_out),
    }
    if sequence_parallel:
        plan["*_norm"] = SequenceParallel()
    if sequence_parallel and prepare:
        plan.update({
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_block(sequence_parallel: bool, one_input: bool = False, prepare: bool = True):
    mesh = sw.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    plan = _plan(sequence_parallel, prepare)
    if one_input:
        plan["attention"] = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    block = parallelize_module(make_block(), mesh, plan)
    x, rope = _inputs()
    rank = torch.distributed.get_rank()
    if sequence_parallel:  # each rank holds its slice of the sequence between blocks
        x = x.detach()[:, rank * SEQ // TP:(rank + 1) * SEQ // TP].requires_grad_()
        with torch.no_grad():  # SequenceParallel checks its plain inputs on the first call only
            block(x, rope)
    with CommDebugMode() as forward:
        out = block(x, rope)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    layouts = {n: p.placements for n, p in block.named_parameters() if isinstance(p, DTensor)}
    grads = {n: _full(p.grad) for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, layouts, forward.get_comm_counts(), backward.get_comm_counts()


def _check_against_reference(results, sequence_parallel: bool):
    out, x_grad, ref_grads = _reference()
    for rank, (got, got_x_grad, grads, layouts, fwd, bwd) in enumerate(results):
        if sequence_parallel:
            piece = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP)
            out_piece, x_grad_piece = out[:, piece], x_grad[:, piece]
        else:
            out_piece, x_grad_piece = out, x_grad
        torch.testing.assert_close(got, out_piece, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_x_grad, x_grad_piece, atol=1e-5, rtol=1e-5)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
        assert layouts["attention.wq.weight"] == (Shard(0),) and layouts["attention.wo.weight"] == (Shard(1),)
        assert layouts["feed_forward.w3.weight"] == (Shard(0),) and layouts["feed_forward.w2.weight"] == (Shard(1),)
        yield fwd, bwd, layouts


def _tp_block_one_input(sequence_parallel: bool):
    """TP with the block inputs made DTensors once: the colwise layers share one input."""
    return _tp_block(sequence_parallel, one_input=True)


def test_shared_replicated_input_reduces_input_gradients_once(dist):
    """wq/wk/wv (and w1/w3) fed one replicated DTensor: their input gradients add up as one
    pending sum, reduced once per sub-block (2 all-reduces in backward instead of 5)."""
    for fwd, bwd, _ in _check_against_reference(dist.run(TP, _tp_block_one_input, False), False):
        assert fwd == {"all_reduce": 2} and bwd == {"all_reduce": 2}


def test_tensor_parallel_block_matches_single_device(dist):
    """Megatron TP: one all-reduce per rowwise layer forward; backward, the colwise layers that
    read one input share its move, so their input gradients are reduced once per sub-block."""
    for fwd, bwd, layouts in _check_against_reference(dist.run(TP, _tp_block, False), False):
        assert fwd == {"all_reduce": 2}
        assert bwd == {"all_reduce": 2}  # not one per input gradient of wq, wk, wv, w1, w3
        assert "attention_norm.weight" not in layouts  # left alone: plain parameters


def _sp_block_without_prepare():
    return _tp_block(True, prepare=False)


def test_sequence_parallel_block_without_prepare_module_input(dist):
    """TP + SP with no PrepareModuleInput in the plan: the colwise layers that read the norm's
    sequence-sharded output share one all-gather (forward) and one reduce-scatter (backward)."""
    for fwd, bwd, _ in _check_against_reference(dist.run(TP, _sp_block_without_prepare), True):
        assert fwd == {"all_gather": 2, "reduce_scatter": 2}
        assert bwd == {"all_gather": 2, "reduce_scatter": 2}


def test_sequence_parallel_block_matches_single_device(dist):
    """TP + SP: the all-reduces become all-gather + reduce-scatter pairs; norms stay sequence-sharded."""
    for fwd, bwd, layouts in _check_against_reference(dist.run(TP, _tp_block, True), True):
        assert fwd == {"all_gather": 2, "reduce_scatter": 2}
        assert bwd == {"all_gather": 2, "reduce_scatter": 2}
        assert layouts["attention_norm.weight"] == (Replicate(),)


# ---------------------------------------------------------------------- single styles
def _colwise_rowwise_layouts():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(12, 8), nn.Embedding(12, 8))
    parallelize_module(model, mesh, {
        "0": ColwiseParallel(use_local_output=False), "1": RowwiseParallel(use_local_output=False),
        "2": ColwiseParallel(use_local_output=False), "3": RowwiseParallel(use_local_output=False),
    })
    torch.manual_seed(1)
    x = torch.randn(3, 6)
    h = model[0](x)
    y = model[1](h)
    ids = torch.tensor([[0, 5, 11], [3, 3, 7]])
    e_col, e_row = model[2](ids), model[3](ids)
    params = {n: (p.placements, p.full_tensor()) for n, p in model.named_parameters()}
    return (h.placements, y.placements, e_col.placements, e_row.placements,
            y.to_local(), e_col.full_tensor(), e_row.to_local(), params)


def test_colwise_rowwise_on_linear_and_embedding(dist):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(12, 8), nn.Embedding(12, 8))
    torch.manual_seed(1)
    x = torch.randn(3, 6)
    ids = torch.tensor([[0, 5, 11], [3, 3, 7]])
    for h_pl, y_pl, ec_pl, er_pl, y, e_col, e_row, params in dist.run(4, _colwise_rowwise_layouts):
        assert (h_pl, y_pl, ec_pl, er_pl) == ((Shard(1),), (Replicate(),), (Shard(2),), (Replicate(),))
        assert params["0.weight"][0] == (Shard(0),) and params["0.bias"][0] == (Shard(0),)
        assert params["1.weight"][0] == (Shard(1),) and params["1.bias"][0] == (Replicate(),)
        assert params["2.weight"][0] == (Shard(1),) and params["3.weight"][0] == (Shard(0),)
        torch.testing.assert_close(y, model[1](model[0](x)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e_col, model[2](ids))
        torch.testing.assert_close(e_row, model[3](ids))
        for name, p in model.named_parameters():
            assert torch.equal(params[name][1], p.detach())


def _prepare_output():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(model, mesh, {
        "0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False),
    })
    out = model(torch.ones(8, 4))
    return out.placements, tuple(out.to_local().shape), tuple(out.shape)


def test_prepare_module_output(dist):
    for placements, local_shape, shape in dist.run(4, _prepare_output):
        assert placements == (Shard(0),) and local_shape == (2, 4) and shape == (8, 4)


# ---------------------------------------------------------------------- bad input
def _conv():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = nn.Sequential(nn.Conv2d(3, 8, 3))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})


def _unmatched():
    mesh = sw.init_device_mesh("cpu", (4,))
    block = make_block()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(block, mesh, {"attention.wq": ColwiseParallel(), "layers.*.attention.wq": ColwiseParallel()})
    return [(w.category, str(w.message)) for w in caught], type(block.attention.wq.weight).__name__


def _two_d_mesh():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": ColwiseParallel()})


def _twice():
    mesh = sw.init_device_mesh("cpu", (4,))
    parallelize_module(make_block(), mesh, {"attention.w[qk]": ColwiseParallel(), "attention.wq": RowwiseParallel()})


def test_bad_plans_raise_on_every_rank_before_communicating(dist):
    with CommDebugMode():
        pass
    dist.run_expect_error(4, _conv, match=r"plan\['0'\] on module '0' \(Conv2d.*supports nn.Linear and nn.Embedding")
    dist.run_expect_error(4, _two_d_mesh, match="needs a 1-D mesh")
    dist.run_expect_error(4, _twice, match="matched by plan keys 'attention.w\\[qk\\]' and 'attention.wq'")


def test_a_plan_key_matching_no_module_warns_as_torch_and_the_rest_applies(dist):
    for caught, weight in dist.run(4, _unmatched):
        assert weight == "DTensor"
        assert len(caught) == 1 and caught[0][0] is UserWarning, caught
        assert caught[0][1].startswith("Parallelize plan key 'layers.*.attention.wq' could not be resolved: no "
                                       "submodule matching token 'layers' in module Block"), caught


def _no_collective_before_error():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(3, 8, 3))
    with CommDebugMode() as comm:
        try:
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": ColwiseParallel()})
        except ValueError:
            pass
    return comm.get_total_counts(), isinstance(model[0].weight, DTensor)


def test_bad_plan_distributes_nothing(dist):
    """The valid entry is not applied either: the plan is checked as a whole first."""
    assert dist.run(4, _no_collective_before_error) == [(0, False)] * 4


def _one_rowwise_style_for_embedding_and_linear():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(12, 8))
    row = RowwiseParallel()  # one object, applied to an Embedding first and then to a Linear
    parallelize_module(model, mesh, {"2": row, "0": ColwiseParallel(), "1": row})
    torch.manual_seed(1)
    return model[1](model[0](torch.randn(3, 6))), model[2](torch.tensor([[0, 5, 11]]))


def test_a_style_object_applied_to_several_modules_keeps_each_ones_layout(dist):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(12, 8))
    torch.manual_seed(1)
    want_y, want_e = model[1](model[0](torch.randn(3, 6))), model[2](torch.tensor([[0, 5, 11]]))
    for y, e in dist.run(4, _one_rowwise_style_for_embedding_and_linear):
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e, want_e)
