"""Code written against torch.distributed.tensor keeps working after switching imports.

Each test runs torch's own DTensor and shardwise side by side on the same ranks: where torch
raises, shardwise raises an exception that is an instance of torch's type with a message that
starts with torch's wording (shardwise's detail follows); where torch warns, shardwise gives the
same warning; torch's public fields and entry points (``DTensorSpec.dim_map``,
``fully_shard.state``, ``local_map(out_placements=None)``, ``register_sharding`` strategy
functions called with the op's arguments) answer as torch's do. Values against one process.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard


@torch.library.custom_op("torch_contract_test::unsharded", mutates_args=())
def _unsharded(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_unsharded.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("torch_contract_test::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x, factor):
    return torch.empty_like(x)


def _libraries() -> dict[str, Any]:
    """The names a test uses, from torch's DTensor and from shardwise."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.tensor as torch_dt
    import torch.distributed.tensor.experimental as torch_exp
    import torch.distributed.tensor.parallel as torch_tp

    import shardwise.experimental as sw_exp
    import shardwise.fsdp as sw_fsdp
    import shardwise.parallel as sw_tp
    return {"torch": (torch_dt, torch_tp, torch_fsdp, torch_exp), "shardwise": (sw, sw_tp, sw_fsdp, sw_exp)}


def _outcome(fn: Callable[[], Any]) -> tuple[type | None, str, list[tuple[type, str]]]:
    """(exception type or None, its message, the warnings given) of ``fn()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            raised, message = None, ""
        except Exception as err:  # noqa: BLE001 - the type is what is compared
            raised, message = type(err), str(err)
    return raised, message, [(w.category, str(w.message)) for w in caught]


def _error_cases(lib: str) -> dict[str, Callable[[], Any]]:
    dt, tp, fsdp, _ = _libraries()[lib]
    mesh = dt.init_device_mesh("cpu", (2,))
    twice = nn.Linear(4, 4)
    fsdp.fully_shard(twice, mesh=mesh)
    op = torch.ops.torch_contract_test.unsharded.default
    return {
        "placements length": lambda: dt.distribute_tensor(torch.ones(4, 4), mesh, [dt.Shard(0), dt.Shard(1)]),
        "PrepareModuleInput length": lambda: tp.PrepareModuleInput(
            input_layouts=(dt.Shard(0), dt.Replicate()), desired_input_layouts=(dt.Replicate(),)),
        "fully_shard twice": lambda: fsdp.fully_shard(twice, mesh=mesh),
        "fully_shard ModuleList": lambda: fsdp.fully_shard(nn.ModuleList([nn.Linear(4, 4)]), mesh=mesh),
        "fully_shard ModuleDict": lambda: fsdp.fully_shard(nn.ModuleDict({"a": nn.Linear(4, 4)}), mesh=mesh),
        "unsupported op": lambda: op(dt.distribute_tensor(torch.ones(4, 4), mesh, [dt.Shard(0)])),
    }


def _errors(_: object) -> dict[str, dict]:
    return {lib: {name: _outcome(case) for name, case in _error_cases(lib).items()} for lib in ("torch", "shardwise")}


def _first_line(message: str) -> str:
    return message.split("\n")[0]


def test_errors_are_torch_s_type_and_start_with_torch_s_wording(dist):
    for result in dist.run(2, _errors, None):
        for case, (want_type, want, _) in result["torch"].items():
            got_type, got, _ = result["shardwise"][case]
            assert want_type is not None and got_type is not None, (case, result["torch"][case], got)
            assert issubclass(got_type, want_type), (case, got_type, want_type, got)
            assert got.startswith(_first_line(want)), (case, want, got)
            assert len(got) > len(_first_line(want)), (case, "shardwise's detail follows torch's wording", got)
        # Code that caught shardwise's own exception type still catches it.
        assert issubclass(result["shardwise"]["PrepareModuleInput length"][0], ValueError)
        assert issubclass(result["shardwise"]["fully_shard twice"][0], ValueError)


def _warning_cases(lib: str) -> dict[str, Callable[[], Any]]:
    dt, tp, _, _ = _libraries()[lib]
    mesh = dt.init_device_mesh("cpu", (2,))

    def old_input_fn(inputs, device_mesh):
        return inputs

    def old_output_fn(outputs, device_mesh):
        return outputs

    def unmatched_key():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        tp.parallelize_module(model, mesh, {"0": tp.ColwiseParallel(), "nope": tp.RowwiseParallel()})
        return type(model[0].weight).__name__, type(model[1].weight).__name__

    return {
        "plan key matching no module": unmatched_key,
        "distribute_module input_fn(inputs, mesh)": lambda: dt.distribute_module(nn.Linear(4, 4), mesh, input_fn=old_input_fn),
        "distribute_module output_fn(outputs, mesh)": lambda: dt.distribute_module(nn.Linear(4, 4), mesh, output_fn=old_output_fn),
    }


def _warnings(_: object) -> dict[str, Any]:
    out: dict[str, Any] = {lib: {name: _outcome(case) for name, case in _warning_cases(lib).items()}
                           for lib in ("torch", "shardwise")}
    out["applied"] = _warning_cases("shardwise")["plan key matching no module"]()
    return out


def test_warnings_are_torch_s_and_the_rest_of_the_plan_applies(dist):
    for result in dist.run(2, _warnings, None):
        for case, (raised, _, want) in result["torch"].items():
            got_raised, got_message, got = result["shardwise"][case]
            assert raised is None and got_raised is None, (case, got_message)
            assert [c for c, _ in got] == [c for c, _ in want] and len(want) == 1, (case, want, got)
            prefix = want[0][1].split(" in module")[0]  # torch prints the whole module after it
            assert got[0][1].startswith(prefix), (case, want, got)
        assert result["applied"] == ("DTensor", "Parameter")


def _tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))


def _inference(_: object) -> list[torch.Tensor]:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (2,))
    model = parallelize_module(_tp_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.arange(18.0).reshape(3, 6) / 10
    outs = []
    with torch.inference_mode():
        outs.append(model(x))
        outs.append(model(x))  # the second call: no state left by the first
    outs.append(model(x).detach())  # and outside the mode again
    return outs


def test_colwise_and_rowwise_modules_run_under_inference_mode(dist):
    x = torch.arange(18.0).reshape(3, 6) / 10
    with torch.no_grad():
        want = _tp_model()(x)
    for outs in dist.run(2, _inference, None):
        for out in outs:
            torch.testing.assert_close(out, want)


def _spec_fields(_: object) -> dict[str, list]:
    import torch.distributed.tensor as torch_dt

    out: dict[str, list] = {"torch": [], "shardwise": []}
    layouts = ([0, 1], [1, 0], [-1, "R"], ["R", 0], ["P", 1], ["R", "R"], [0, 0])
    for lib, dt in (("torch", torch_dt), ("shardwise", sw)):
        mesh = dt.init_device_mesh("cpu", (2, 2))
        for layout in layouts:
            placements = [dt.Replicate() if p == "R" else dt.Partial() if p == "P" else dt.Shard(p) for p in layout]
            spec = dt.DTensor.from_local(torch.ones(3, 5), mesh, placements, run_check=False)._spec
            fields = [spec.num_shards, spec.num_shards_map, spec.sums, spec.is_replicated(), spec.is_sharded(),
                      spec.device_mesh is spec.mesh, tuple(spec.stride)]
            fields.append(_outcome(lambda: spec.dim_map)[:2] if layout == [0, 0] else spec.dim_map)
            out[lib].append(fields)
    return out


def test_spec_fields_torch_documents_answer_as_torch_s(dist):
    for result in dist.run(4, _spec_fields, None):
        for want, got in zip(result["torch"], result["shardwise"]):
            assert want[:-1] == got[:-1], (want, got)
            if isinstance(want[-1], tuple):  # [Shard(0), Shard(0)]: one axis per dim cannot say it
                assert got[-1][0] is want[-1][0] and got[-1][1].startswith(want[-1][1].split(",")[0]), (want, got)
            else:
                assert want[-1] == got[-1], (want, got)


def _partial_prod(_: object) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (2,))
    rank = torch.distributed.get_rank()
    local = torch.tensor([2.0, -3.0, 0.5]) + rank
    x = DTensor.from_local(local, mesh, [Partial("prod")])
    y = DTensor.from_local(local * 2, mesh, [Partial("prod")])
    from shardwise.debug import CommDebugMode

    with CommDebugMode() as comm:
        both = x * y  # a product of pending products: still pending, nothing sent
    return {"placement": x.placements, "same": Partial("prod") == Partial("product"), "value": x.full_tensor(),
            "mul": (both.placements, comm.get_total_counts(), both.full_tensor())}


def test_partial_prod_is_the_pending_product(dist):
    blocks = [torch.tensor([2.0, -3.0, 0.5]) + r for r in range(2)]
    for result in dist.run(2, _partial_prod, None):
        assert result["placement"] == (Partial("product"),) and result["same"]
        torch.testing.assert_close(result["value"], blocks[0] * blocks[1])
        placements, collectives, value = result["mul"]
        assert placements == (Partial("product"),) and collectives == 0
        torch.testing.assert_close(value, blocks[0] * blocks[1] * (blocks[0] * 2) * (blocks[1] * 2))


def _entry_points(_: object) -> dict[str, dict]:
    out = {}
    for lib, (dt, _, fsdp, exp) in _libraries().items():
        mesh = dt.init_device_mesh("cpu", (2,))
        sharded, plain = nn.Linear(4, 4), nn.Linear(4, 4)
        fsdp.fully_shard(sharded, mesh=mesh)
        x = dt.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [dt.Shard(0)])
        summed = exp.local_map(lambda t: t.sum(0), out_placements=None, in_placements=([dt.Shard(0)],))(x)
        out[lib] = {"state": (fsdp.fully_shard.state(sharded) is not None, fsdp.fully_shard.state(plain)),
                    "local_map": (type(summed).__name__, tuple(summed.placements), summed.to_local())}
    return out


def test_fully_shard_state_and_local_map_without_out_placements_as_torch(dist):
    for rank, result in enumerate(dist.run(2, _entry_points, None)):
        assert result["torch"]["state"] == result["shardwise"]["state"] == (True, None)
        want, got = result["torch"]["local_map"], result["shardwise"]["local_map"]
        assert got[:2] == ("DTensor", (Replicate(),)) and want[0] == got[0] and len(want[1]) == 1
        torch.testing.assert_close(got[2], torch.arange(8.0).reshape(4, 2)[2 * rank:2 * rank + 2].sum(0))
        torch.testing.assert_close(got[2], want[2])


def _scale_strategy(x, factor):
    """A strategy function as torch calls one: the op's arguments, placements per argument."""
    assert isinstance(factor, float) and x.ndim == 2
    return [([Shard(0)], [Shard(0), None]), ([Replicate()], [Replicate(), None])]


def _torch_scale_strategy(x, factor):
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    return [([S(0)], [S(0), None]), ([R()], [R(), None])]


def _torch_convention(_: object) -> dict[str, Any]:
    import torch.distributed.tensor as torch_dt
    from torch.distributed.tensor.experimental import register_sharding as torch_register

    from shardwise.debug import CommDebugMode
    from shardwise.experimental import register_sharding

    op = torch.ops.torch_contract_test.scale.default
    register_sharding(op)(_scale_strategy)
    torch_register(op)(_torch_scale_strategy)
    whole = torch.arange(12.0).reshape(6, 2)
    out = {}
    for lib, dt in (("torch", torch_dt), ("shardwise", sw)):
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(whole, mesh, [dt.Shard(0)])
        with CommDebugMode() as comm:
            y = op(x, 1.5)
        out[lib] = (str(y.placements), y.full_tensor(), comm.get_total_counts() if lib == "shardwise" else None)
    return out


def test_register_sharding_takes_torch_s_strategy_functions(dist):
    want = torch.arange(12.0).reshape(6, 2) * 1.5
    for result in dist.run(2, _torch_convention, None):
        assert result["shardwise"][0] == result["torch"][0] == "(Shard(dim=0),)", result
        assert result["shardwise"][2] == 0
        torch.testing.assert_close(result["shardwise"][1], want)
        torch.testing.assert_close(result["torch"][1], want)


def _computed_where_torch_refuses(_: object) -> dict[str, Any]:
    from shardwise.parallel import loss_parallel

    mesh = sw.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole, target = torch.randn(5, 6), torch.tensor([0, 5, 2, 3, 1])
    rows = sw.distribute_tensor(whole, mesh, [Shard(0)]).unbind(0)
    logits = sw.distribute_tensor(whole, mesh, [Shard(0)])
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits, sw.distribute_tensor(target, mesh, [Replicate()]))
    return {"unbind": [r.full_tensor() for r in rows], "loss": loss.full_tensor()}


def test_unbind_of_a_sharded_dim_and_loss_parallel_off_the_class_dim_compute_what_torch_refuses(dist):
    torch.manual_seed(0)
    whole, target = torch.randn(5, 6), torch.tensor([0, 5, 2, 3, 1])
    for result in dist.run(2, _computed_where_torch_refuses, None):
        assert len(result["unbind"]) == 5
        for got, want in zip(result["unbind"], whole.unbind(0)):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(result["loss"], torch.nn.functional.cross_entropy(whole, target))
