"""Collectives per trainer block under tensor (and sequence) parallelism: the hand-written ideal.

The trainer's TP plan (``shardwise.train.models.llama.tp_plans``) on one ``TransformerBlock``,
4 ranks, with and without the ``PrepareModuleInput`` entries on ``attention`` / ``feed_forward``.
Ideal per block, forward and backward each: TP 2 all-reduces, TP+SP 2 all-gathers and 2
reduce-scatters (one per sub-block). Values and gradients are checked against one device.
"""


import torch

import shardwise as sw
from shardwise import DTensor, Shard
from shardwise.debug import CommDebugMode
from shardwise.parallel import ColwiseParallel, parallelize_module
from shardwise.train.models.llama import ModelArgs, tp_plans
from shardwise.train.models.llama.model import TransformerBlock, rotary_table

TP, BATCH, SEQ = 4, 2, 8
ARGS = ModelArgs(dim=32, n_layers=1, n_heads=8, n_kv_heads=4, multiple_of=16, max_seq_len=SEQ)
CASES = [(sp, prepare) for sp in (False, True) for prepare in (True, False)]
IDEAL = {False: {"all_reduce": 2}, True: {"all_gather": 2, "reduce_scatter": 2}}


def _block_and_input():
    torch.manual_seed(0)
    block = TransformerBlock(0, ARGS)
    block.init_weights()
    torch.manual_seed(1)
    return block, torch.randn(BATCH, SEQ, ARGS.dim), rotary_table(ARGS.head_dim, SEQ, ARGS.rope_theta)


def _reference():
    block, x, rotary = _block_and_input()
    x.requires_grad_()
    out = block(x, rotary)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _run(case):
    sequence_parallel, prepare = case
    mesh = sw.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    _, plan = tp_plans(sequence_parallel, loss_parallel=False)
    if not prepare:
        plan = {k: v for k, v in plan.items() if k not in ("attention", "feed_forward")}
    block, x, rotary = _block_and_input()
    block = parallelize_module(block, mesh, plan)
    if sequence_parallel:  # between blocks each rank holds its slice of the sequence
        rank = torch.distributed.get_rank()
        x = x[:, rank * SEQ // TP:(rank + 1) * SEQ // TP]
        with torch.no_grad():  # SequenceParallel checks its plain inputs on the first call only
            block(x, rotary)
    x = x.clone().requires_grad_()
    with CommDebugMode() as forward:
        out = block(x, rotary)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, dict(forward.get_comm_counts()), dict(backward.get_comm_counts())


def _two_readers():
    """Two colwise layers reading one row-sharded plain tensor, written in place between reads:
    the first two reads share one all_gather, the read after the write gathers the new values."""
    mesh = sw.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    torch.manual_seed(2)
    layers = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 8), "b": torch.nn.Linear(4, 8)})
    style = dict(input_layouts=Shard(0), use_local_output=False)
    parallelize_module(layers, mesh, {"a": ColwiseParallel(**style), "b": ColwiseParallel(**style)})
    rank = torch.distributed.get_rank()
    x = torch.randn(8, 4)[2 * rank:2 * rank + 2].clone()
    with CommDebugMode() as comms:
        first = [layers["a"](x), layers["b"](x)]
        x.mul_(2)
        after = layers["b"](x)
    moves = dict(comms.get_comm_counts())
    return [y.full_tensor() for y in first], after.full_tensor(), moves


def _all_cases():
    return [_run(case) for case in CASES], _two_readers()


def test_trainer_tp_blocks_communicate_as_the_hand_written_ideal(dist):
    out, x_grad, ref_grads = _reference()
    torch.manual_seed(2)
    a, b = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
    x = torch.randn(8, 4)
    for rank, (results, (shared, after, counts)) in enumerate(dist.run(TP, _all_cases)):
        torch.testing.assert_close(shared, [a(x), b(x)])
        torch.testing.assert_close(after, b(2 * x))  # written in place: moved again, not reused
        assert counts == {"all_gather": 2}  # x once for a and b, once more after the write
        for (sequence_parallel, prepare), (got, got_x_grad, grads, fwd, bwd) in zip(CASES, results):
            case = f"sp={sequence_parallel} prepare={prepare} rank={rank}"
            piece = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP) if sequence_parallel else slice(None)
            torch.testing.assert_close(got, out[:, piece], atol=1e-5, rtol=1e-5, msg=case)
            torch.testing.assert_close(got_x_grad, x_grad[:, piece], atol=1e-5, rtol=1e-5, msg=case)
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=f"{case} {name}")
            assert fwd == IDEAL[sequence_parallel], case
            assert bwd == IDEAL[sequence_parallel], case
