"""shardwise.debug.explain (per-op layouts, strategies, collectives) and the collective check
(SHARDWISE_CHECK_COLLECTIVES / check_collectives), on real gloo groups."""

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard, comm
from shardwise.debug import CommDebugMode, Explanation, explain
from shardwise.debug.check import CollectiveMismatch, check_collectives, checking
from tests.helpers import require_extra


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _explain_tp_mlp():
    from shardwise.tensor import dtensor
    from shardwise.dispatch import dispatcher
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference, model = _mlp(), _mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(8, 16)
    model(x)  # every call below is a dispatch-cache hit: explain must still see the strategy
    with CommDebugMode() as comms, explain() as ex:
        out = model(x)
        out.sum().backward()
    reference(x).sum().backward()
    values_ok = torch.allclose(out, reference(x), atol=1e-5) and torch.allclose(
        model[0].weight.grad.full_tensor(), reference[0].weight.grad, atol=1e-5)
    with explain():
        try:
            with explain():
                pass
            nested = "no error"
        except RuntimeError as err:
            nested = str(err)
    restored = dtensor.dispatch is dispatcher.dispatch and not comm.recording()
    comm_records = [(r.kind, r.axis_name, r.bytes_sent, r.module, r.phase.value) for r in comms.records]
    return {"json": ex.to_json(), "text": ex.render(rich=False), "str": str(ex), "values_ok": values_ok,
            "comm_records": comm_records, "nested": nested, "restored": restored, "rank": dist.get_rank()}


@pytest.mark.extras
def test_explain_a_tp_mlp(dist):
    results = dist.run(4, _explain_tp_mlp)
    for rank, r in enumerate(results):
        assert r["values_ok"] and r["restored"] and "do not nest" in r["nested"]
        ex = Explanation.from_json(r["json"])
        assert ex.to_json() == r["json"] and json.loads(r["json"])["rank"] == rank  # round trip
        assert r["text"] == ex.render(rich=False) and r["str"] == ex.render()
        forward = [(o.module, o.op, o.inputs, o.outputs) for o in ex.ops if o.phase == "forward" and o.depth == 0]
        assert forward == [
            ("Sequential.0", "aten.t", ["f32[32@tp,16]"], ["f32[16,32@tp]"]),
            ("Sequential.0", "aten.addmm", ["f32[32@tp]", "f32[8,16]", "f32[16,32@tp]"], ["f32[8,32@tp]"]),
            ("Sequential.2", "aten.t", ["f32[16,32@tp]"], ["f32[32@tp,16]"]),
            ("Sequential.2", "aten.addmm", ["f32[16]", "f32[8,32@tp]", "f32[32@tp,16]"], ["f32[8,16]{P(sum)@tp}"]),
        ], forward
        addmm = [o for o in ex.ops if o.op == "aten.addmm"][1]
        # Row-wise: the chosen layout moves nothing; the bias becomes a partial sum locally.
        assert addmm.kind == "run" and addmm.chosen.cost_bytes == 0
        assert addmm.chosen.inputs == ["f32[16]{P(sum)@tp}", "f32[8,32@tp]", "f32[32@tp,16]"]
        assert addmm.chosen.outputs == ["f32[8,16]{P(sum)@tp}"]
        costs = [a.cost_bytes for a in addmm.alternatives]
        assert len(costs) == 2 and costs == sorted(costs) and costs[0] > 0
        # The only collective: RowwiseParallel's output hook sums the partial output (8x16 f32 on
        # 4 ranks: reduce-scatter + all-gather, (128 + 2 * 32) * 4 bytes), filed under its module.
        collectives = [(c.kind, c.axis, c.bytes, c.module, c.phase) for c in ex.all_collectives()]
        assert collectives == [("all_reduce", "tp", 768, "Sequential.2", "forward")]
        assert collectives == r["comm_records"]  # the same as CommDebugMode's, bytes included
        assert any(o.phase == "backward" and o.op == "aten.mm" for o in ex.ops)
        lines = r["text"].splitlines()
        assert lines[0] == f"explain (rank {rank}): {len(ex.ops)} ops, 1 collectives, 768 B sent"
        assert "  Sequential" in lines and "    Sequential.2" in lines
        assert "      all_reduce on tp: 768 B (outside any op)" in lines


# ---------------------------------------------------------------------- the check
def _diverge():
    """Four ranks, checking on: a matching program runs and counts as before; then rank 1
    skips a full_tensor the others issue."""
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    with check_collectives():
        assert checking()
        with CommDebugMode() as comms:
            full = x.full_tensor()  # the check's own exchange is not counted
        assert comms.get_comm_counts() == {"all_gather": 1} and torch.equal(full, torch.arange(32.0).reshape(8, 4))
        try:
            if dist.get_rank() != 1:
                x.redistribute(mesh, [Replicate()])  # rank 1 skips this one
            (x * 2).full_tensor()
        finally:
            assert checking()
    raise AssertionError("no mismatch raised")


def _diverge_and_time():
    began = time.monotonic()
    try:
        _diverge()
    except CollectiveMismatch as err:
        took = time.monotonic() - began
        if took > 10 or comm.pre_issue_check() is not None:  # off again after the block
            raise AssertionError(f"took {took:.1f} s or the check stayed on") from err
        raise


def test_the_check_turns_a_diverging_program_into_one_error_on_every_rank(dist):
    messages = dist.run_expect_error(4, _diverge_and_time, exc_type=CollectiveMismatch, timeout=30,
                                     match=r"disagree at their collective #\d+ on this group")
    assert len(set(messages)) == 1, messages  # the same error on every rank
    lines = messages[0].splitlines()[1:]
    seq = re.search(r"#(\d+)", messages[0]).group(1)
    site = r"at test_explain_check\.py:(\d+) in _diverge"
    shown = [re.fullmatch(rf"  rank {r}: all_gather #{seq} over mesh axis 'tp' of f32\[8,4\] {site}(   <- differs from rank 0)?",
                          line) for r, line in enumerate(lines)]
    assert all(shown) and len(shown) == 4, lines
    assert [bool(m.group(2)) for m in shown] == [False, True, False, False]  # rank 1 parted
    assert int(shown[1].group(1)) == int(shown[0].group(1)) + 1  # the full_tensor line after the skipped one


def test_the_check_is_off_by_default_and_on_from_the_environment(monkeypatch):
    """Off: no pre-issue check on comm's issuing path. The variable turns it on
    (``shardwise/__init__.py`` calls enable_from_env at import when it is set)."""
    from shardwise.debug import check

    assert not checking() and comm.pre_issue_check() is None
    for value, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv(check.CHECK_ENV, value)
        check.enable_from_env()
        assert checking() is on
        check_collectives(False)
    assert comm.pre_issue_check() is None


@pytest.mark.e2e
@pytest.mark.parametrize("value,on", [("1", True), ("0", False)])
def test_the_environment_variable_is_read_when_shardwise_is_imported(value, on):
    """A fresh process that imports only ``shardwise.comm`` has the check on exactly when the
    variable says so (its package's ``__init__`` runs first and reads it)."""
    code = "import shardwise.comm as c; print(c.pre_issue_check() is not None)"
    env = {**os.environ, "SHARDWISE_CHECK_COLLECTIVES": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(on)


# ---------------------------------------------------------------------- the trainer's --explain
# ``print(ex)`` draws with rich when it is installed (an optional extra), plain text otherwise. Each
# printer is asserted on its own run, whatever is installed: the plain one with rich made
# unimportable in the worker, the rich one when rich is there (.ci/run installs it for that test).
_EXPLAIN_ARGV = ["--config", "tiny", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--tp", "2",
                 "--log-every", "1000", "--device", "cpu"]


@contextlib.contextmanager
def _without_rich():
    """``import rich`` fails inside (as without the extra); rich's modules come back after."""
    saved = {name: module for name, module in sys.modules.items() if name == "rich" or name.startswith("rich.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["rich"] = None  # the import system's "not installed"
    try:
        yield
    finally:
        del sys.modules["rich"]
        sys.modules.update(saved)


def _train_explained(argv: list[str]) -> dict:
    """One tp=2 job trained three times on each rank: without --explain, with it printing plain
    text (rich unimportable), and with rich when it is installed (else None)."""
    import io

    from shardwise.train import cli
    from shardwise.train.trainer import Runtime, train

    def run(extra: list[str]) -> tuple[list[float], str]:
        job = cli.job_from_argv(argv + extra)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            return train(job, Runtime.create(job)).losses, out.getvalue()

    runs = {"off": run([])}
    with _without_rich():
        runs["plain"] = run(["--explain"])
    runs["rich"] = run(["--explain"]) if importlib.util.find_spec("rich") is not None else None
    return runs


@pytest.fixture(scope="module")
def explained_runs(dist) -> list[dict]:
    """Every rank's ``_train_explained`` result, shared by the plain and the rich test."""
    return dist.run(2, _train_explained, _EXPLAIN_ARGV)


def _explained_tree(runs: list[dict], printer: str) -> str:
    """Rank 0's printed explanation; checks what every rank printed and trained."""
    for rank, r in enumerate(runs):
        (plain_losses, plain_out), (losses, out) = r["off"], r[printer]
        assert losses == plain_losses and len(losses) == 2  # explaining changes nothing, and training goes on
        assert "explain (rank" not in plain_out
        assert rank == 0 or "explain (rank" not in out  # rank 0 only
    out = runs[0][printer][1]
    assert out.count("explain (rank 0): ") == 1  # the first step only
    return out[out.index("explain (rank 0): "):]


@pytest.mark.e2e
@pytest.mark.extras
def test_the_trainers_explain_prints_the_first_step_and_continues(explained_runs):
    tree = _explained_tree(explained_runs, "plain")
    assert re.search(r"^  Transformer\n", tree, re.M)
    assert re.search(r"^        Transformer\.layers\.0\.attention\.wq\n          aten\.\w+", tree, re.M), tree[:3000]
    assert re.search(r"all_reduce on tp: \d+", tree) and "(backward)" in tree


@pytest.mark.e2e
@pytest.mark.extras
def test_the_trainers_explain_draws_with_rich_when_it_is_installed(explained_runs):
    require_extra("rich")
    assert all(r["rich"] is not None for r in explained_runs), "rich is installed here but not in the workers"
    tree = _explained_tree(explained_runs, "rich")
    assert "\n  Transformer\n" not in tree  # not the plain printer
    assert re.search(r"^(?:[│ ] {3})*[├└]── Transformer\.layers\.0\.attention\.wq$", tree, re.M), tree[:3000]
    assert re.search(r"[├└]── aten\.\w+", tree) and re.search(r"[├└]── all_reduce on tp: \d+", tree)
    assert "(backward)" in tree


# ---------------------------------------------------------------------- the timeout's history
# Last in the file: the timed-out groups end the 2-rank pool (the harness starts a fresh one).
def _part_ways():
    """Two ranks agree on one all_reduce, then part: rank 0 waits in an all_reduce on the mesh
    axis, rank 1 in a barrier of the whole world (another group: no check could pair them)."""
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = comm.all_reduce(torch.ones(4), mesh, 0, "sum")
    comm.set_collective_timeout(2)
    if dist.get_rank() == 0:
        comm.all_reduce(x, mesh, 0, "sum")
    else:
        comm.barrier()


def test_a_timed_out_collective_names_each_ranks_last_collectives(dist):
    messages = dist.run_expect_error(2, _part_ways, exc_type=comm.CollectiveTimeout, timeout=60)
    for rank, message in enumerate(messages):
        history = re.search(r"; last collectives issued: rank 0: (.*); rank 1: (.*)$", message)
        assert history, message
        rank0, rank1 = (h.split(", ") for h in history.groups())
        # Where they parted: the same all_reduce, then rank 0 a second one, rank 1 the barrier.
        assert re.fullmatch(r"all_reduce #(\d+) on 'tp'", rank0[-2]) and rank0[-2] == rank1[-2], message
        assert re.fullmatch(r"all_reduce #\d+ on 'tp'", rank0[-1]) and re.fullmatch(r"barrier #\d+ on all ranks", rank1[-1])
        stuck = "rank 1 is waiting on barrier" if rank == 0 else "rank 0 is waiting on all_reduce"
        assert stuck in message, message
