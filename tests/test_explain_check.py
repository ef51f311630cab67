"""shardwise.debug.explain (its summary per module and phase, and the full tree of per-op
layouts, strategies, collectives) and the collective check (SHARDWISE_CHECK_COLLECTIVES /
check_collectives): the summary's pure logic on hand-built records, the rest on real gloo groups
and the trainer's ``--explain``."""

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
from shardwise.debug import CommDebugMode, Detail, Explanation, explain
from shardwise.debug.check import CollectiveMismatch, check_collectives, checking
from shardwise.debug.explain import Boundary, CollectiveEntry, OpEntry
from shardwise.debug.explain_summary import Section, Traffic, summarize
from tests.helpers import require_extra


# ---------------------------------------------------------------------- the summary (pure)
def _recorded_step() -> Explanation:
    """A step as explain records it: three blocks of a list (the third sends more), a head with
    two uneven all_to_alls, the loss outside any module, backward, then an optimizer collective."""
    order = iter(range(1, 100))
    ops, loose = [], []

    def op(module: str, phase: str = "forward", *collectives: CollectiveEntry) -> None:
        ops.append(OpEntry("aten.mm", module, phase, ["f32[4,8]"], order=next(order), collectives=list(collectives)))

    def sent(kind: str, axis: str, nbytes: int, module: str, phase: str = "forward",
             per_peer: list[int] | None = None) -> CollectiveEntry:
        return CollectiveEntry(kind, axis, nbytes, module, phase, per_peer, next(order))

    for i, nbytes in enumerate([64, 64, 128]):
        op(f"Net.blocks.{i}.lin", "forward", sent("all_reduce", "tp", nbytes, f"Net.blocks.{i}.lin"))
    loose += [sent("all_to_all", "ep", 10, "Net.head", per_peer=[0, 10]),
              sent("all_to_all", "ep", 6, "Net.head", per_peer=[0, 6])]
    op("Global")  # the loss
    op("Global", "backward")  # its backward, then the model's
    for module in ["Net.head", "Net.blocks.2.lin", "Net.blocks.1.lin", "Net.blocks.0.lin"]:
        op(module, "backward")
    op("Global", "forward", sent("all_reduce", "tp", 4, "Global"))  # clipping's norm
    blocks = [f"Net.blocks.{i}{leaf}" for i in range(3) for leaf in ("", ".lin")]
    edges = [Boundary(m, "forward", ["f32[4,8](plain)"], ["f32[4,8](plain)"]) for m in blocks]
    return Explanation(0, ["Net", *blocks, "Net.head"], ops, loose, edges)


def test_the_summary_has_a_line_per_module_per_phase_in_step_order():
    forward, backward, optimizer = summarize(_recorded_step())
    assert [p.section for p in (forward, backward, optimizer)] == [Section.FORWARD, Section.BACKWARD,
                                                                   Section.OPTIMIZER]
    # Forward: blocks 0 and 1 say the same and fold; block 2 sends more; outside any module last.
    assert [(line.label, line.depth) for line in forward.lines] == [
        ("Net", 0), ("blocks.0-1 (x2, same)", 1), ("lin", 2), ("blocks.2", 1), ("lin", 2), ("head", 1),
        ("Global", 0)]
    assert forward.lines[2].traffic == (Traffic("all_reduce", "tp", 1, 64),)  # each block's
    assert forward.lines[2].edge() == "f32[4,8](plain) -> f32[4,8](plain)"
    assert forward.lines[5].traffic == (Traffic("all_to_all", "ep", 2, 16, (0, 16)),)  # bytes per peer, summed
    assert forward.ops == 4  # every block counted, the folded one too
    assert forward.traffic == (Traffic("all_reduce", "tp", 3, 256), Traffic("all_to_all", "ep", 2, 16, (0, 16)))
    # Backward: the loss's first, then the modules in reverse; all three blocks alike there.
    assert [line.label for line in backward.lines] == ["Global", "Net", "head", "blocks.0-2 (x3, same)", "lin"]
    assert backward.ops == 5 and backward.traffic == ()
    # After backward, outside any module: the optimizer section, last and one line.
    assert [line.label for line in optimizer.lines] == ["Global"]
    assert optimizer.ops == 1 and optimizer.traffic == (Traffic("all_reduce", "tp", 1, 4),)


def test_the_summary_renders_columns_and_a_total_per_section():
    text = _recorded_step().render(rich=False)
    lines = text.splitlines()
    assert lines[0].startswith("explain (rank 0): 10 ops, 6 collectives, 276 B sent (a line per module")
    titles = [line for line in lines if not line.startswith(" ")]
    assert titles[1:] == ["forward:", "backward:", "optimizer (after backward: gradient clipping, the step):"]
    assert re.search(r"^      lin +1  all_reduce@tp x1 64 B +f32\[4,8\]\(plain\) -> f32\[4,8\]\(plain\)$", text, re.M)
    assert re.search(r"^    head +0  all_to_all@ep x2 16 B \(per peer 0 B / 16 B\)$", text, re.M), text
    assert sum(line.startswith("  total ") for line in lines) == 3
    assert re.search(r"^  total +4  all_reduce@tp x3 256 B; all_to_all@ep x2 16 B", text, re.M)
    assert re.search(r"^  total +5  no collectives$", text, re.M)
    assert _recorded_step().render(rich=False, detail=Detail.FULL).splitlines()[1] == "Global"  # the tree


def test_a_backward_without_dtensor_ops_still_has_its_section():
    """Pipeline stage 0 runs its backward on plain tensors and issues nothing then: the backward
    boundaries place it, so clipping's all_reduce afterwards is the optimizer's."""
    ex = Explanation(0, ["Net"], [], [CollectiveEntry("all_reduce", "pp", 4, "Global", "forward", None, 3)],
                     [Boundary("Net", "forward", ["f32[2,8](plain)"], ["f32[2,8](plain)"], 1),
                      Boundary("Net", "backward", ["f32[2,8](plain)"], [], 2)])
    forward, backward, optimizer = summarize(ex)
    assert [line.label for line in backward.lines] == ["Net"] and backward.lines[0].edge() == "f32[2,8](plain) -> -"
    assert forward.traffic == () and optimizer.traffic == (Traffic("all_reduce", "pp", 1, 4),)


def test_detail_is_an_enum_and_old_records_still_summarize():
    with pytest.raises(TypeError, match=r"Detail.SUMMARY or Detail.FULL, not 'full'"):
        explain(detail="full")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="detail must be a shardwise.debug.Detail"):
        _recorded_step().render(detail="summary")  # type: ignore[arg-type]
    assert [d.value for d in Detail] == ["summary", "full"]
    ex = _recorded_step()
    assert Explanation.from_json(ex.to_json()) == ex  # boundaries and order travel
    old = json.loads(ex.to_json())  # written before boundaries and order: everything counts as forward
    del old["boundaries"]
    for record in [*old["ops"], *old["collectives"], *[c for o in old["ops"] for c in o["collectives"]]]:
        del record["order"]
    parts = summarize(Explanation.from_json(old))
    assert [p.section for p in parts] == [Section.FORWARD, Section.BACKWARD]
    assert parts[0].ops == 5 and parts[0].lines[1].edge() == ""


@pytest.mark.extras
def test_the_summary_draws_one_rich_table():
    require_extra("rich")
    text = _recorded_step().render(rich=True)
    assert text != _recorded_step().render(rich=False) and "─" * 20 in text
    assert re.search(r"^ +lin +1 +all_reduce@tp x1 64 B +f32\[4,8\]\(plain\) -> f32\[4,8\]\(plain\)$", text, re.M)
    assert re.search(r"^optimizer: +\(after backward: gradient clipping, the step\)$", text, re.M), text
    assert sum(line.lstrip().startswith("total ") for line in text.splitlines()) == 3


# ---------------------------------------------------------------------- on gloo ranks
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
    with explain(detail=Detail.FULL) as full:
        model(x)
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
    return {"json": ex.to_json(), "text": ex.render(rich=False, detail=Detail.FULL), "str": str(ex),
            "summary": ex.render(rich=False), "full_str": (str(full), full.render(detail=Detail.FULL)),
            "values_ok": values_ok,
            "comm_records": comm_records, "nested": nested, "restored": restored, "rank": dist.get_rank()}


@pytest.mark.extras
def test_explain_a_tp_mlp(dist):
    results = dist.run(4, _explain_tp_mlp)
    for rank, r in enumerate(results):
        assert r["values_ok"] and r["restored"] and "do not nest" in r["nested"]
        ex = Explanation.from_json(r["json"])
        assert ex.to_json() == r["json"] and json.loads(r["json"])["rank"] == rank  # round trip
        assert r["text"] == ex.render(rich=False, detail=Detail.FULL) and r["str"] == ex.render()
        assert r["summary"] == ex.render(rich=False, detail=Detail.SUMMARY) and r["full_str"][0] == r["full_str"][1]
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
        # The summary: each layer's line, with its collectives and the layouts its caller sees.
        summary = [re.sub(r"(?<=\S) {2,}", "  ", line) for line in r["summary"].splitlines()]  # columns as 2 spaces
        assert summary[2:5] == ["forward:", "  Sequential  0  -  f32[8,16](plain) -> f32[8,16](plain)",
                                "    0  2  -  f32[8,16](plain) -> f32[8,8](plain)"], summary
        assert "    2  2  all_reduce@tp x1 768 B  f32[8,8](plain) -> f32[8,16](plain)" in summary, summary


def _uneven_exchange() -> list:
    """What a recorder sees of an all_to_all with counts per peer, and of an all_reduce."""
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    me = dist.get_rank()
    seen: list = []

    class Recorder:
        def record(self, kind: str, mesh: sw.DeviceMesh, axis: int, bytes_sent: int) -> None:
            seen.append((kind, bytes_sent, comm.per_peer_bytes()))

    recorder = Recorder()
    comm.add_recorder(recorder)
    try:
        send = [0, 3] if me == 0 else [5, 0]  # rank 0 sends 3 floats to rank 1, rank 1 sends 5 back
        got = comm.all_to_all_counts(torch.full((sum(send),), float(me)), send, [0, 5] if me == 0 else [3, 0], mesh, 0)
        comm.all_reduce(torch.ones(2), mesh, 0, "sum")
    finally:
        comm.remove_recorder(recorder)
    return [seen, got.tolist()]


def test_recorders_see_the_bytes_per_peer_of_an_uneven_all_to_all(dist):
    (seen0, got0), (seen1, got1) = dist.run(2, _uneven_exchange)
    assert got0 == [1.0] * 5 and got1 == [0.0] * 3
    assert seen0[0] == ("all_to_all", 12, [0, 12]) and seen1[0] == ("all_to_all", 20, [20, 0])
    assert seen0[1][2] is None and seen1[1][2] is None  # an all_reduce: no counts per peer


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
    """One tp=2 job trained on each rank without --explain, then with ``--explain`` and with
    ``--explain full``, each printed as plain text (rich unimportable) and with rich when it is
    installed (else None)."""
    import io

    from shardwise.train import cli
    from shardwise.train.trainer import Runtime, train

    def run(extra: list[str]) -> tuple[list[float], str]:
        job = cli.job_from_argv(argv + extra)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            return train(job, Runtime.create(job)).losses, out.getvalue()

    runs: dict = {"off": run([])}
    with _without_rich():
        runs["plain"], runs["plain full"] = run(["--explain"]), run(["--explain", "full"])
    rich = importlib.util.find_spec("rich") is not None
    runs["rich"], runs["rich full"] = (run(["--explain"]), run(["--explain", "full"])) if rich else (None, None)
    return runs


@pytest.fixture(scope="module")
def explained_runs(dist) -> list[dict]:
    """Every rank's ``_train_explained`` result, shared by the plain and the rich tests."""
    return dist.run(2, _train_explained, _EXPLAIN_ARGV)


def _explained(runs: list[dict], printer: str) -> str:
    """Rank 0's printed explanation (up to the next progress line); checks what every rank
    printed and trained."""
    for rank, r in enumerate(runs):
        (plain_losses, plain_out), (losses, out) = r["off"], r[printer]
        assert losses == plain_losses and len(losses) == 2  # explaining changes nothing, and training goes on
        assert "explain (rank" not in plain_out
        assert rank == 0 or "explain (rank" not in out  # rank 0 only
    out = runs[0][printer][1]
    assert out.count("explain (rank 0): ") == 1  # the first step only
    shown = out[out.index("explain (rank 0): "):]
    return shown[:shown.index("\nstep ")] if "\nstep " in shown else shown


# tiny --tp 2's full tree: its line count, as it was before the summary became the default
# (the same for the rich tree plus one line: rich's last branch line).
_FULL_TREE_LINES = 1436


def _check_summary(text: str) -> None:
    """What tiny --tp 2's summary must say, whichever printer drew it."""
    lines = text.splitlines()
    assert len(lines) <= 80, f"{len(lines)} lines:\n{text}"
    titles = [i for i, line in enumerate(lines) if re.match(r"(forward|backward|optimizer)\b", line)]
    assert [lines[i].split()[0].rstrip(":") for i in titles] == ["forward", "backward", "optimizer"], text
    forward = "\n".join(lines[titles[0]:titles[1]])
    assert re.search(r"^ +layers\.0-1 \(x2, same\) ", forward, re.M), text  # the two blocks fold
    for module, sent in [("tok_embeddings", "all_reduce"), ("wo", "all_reduce"), ("w2", "all_reduce"),
                         ("output", "all_gather")]:  # row-wise outputs are summed, the logits gathered
        assert re.search(rf"^ +{module} +\d+ +{sent}@tp x1 \d+\.\d KiB +\S+\[", forward, re.M), (module, text)
    assert re.search(r"^ +wq +4 +- +f32\[4,16,64\] -> f32\[4,16,32\]\(plain\)$", forward, re.M), text
    optimizer = lines[titles[2]:]
    assert any(re.match(r"^ +Global +\d+ +all_reduce@tp x16 64 B$", line) for line in optimizer), text


@pytest.mark.e2e
@pytest.mark.extras
def test_the_trainers_explain_prints_a_summary_of_the_first_step_and_continues(explained_runs):
    _check_summary(_explained(explained_runs, "plain"))


@pytest.mark.e2e
@pytest.mark.extras
def test_the_trainers_explain_full_prints_every_op_as_before(explained_runs):
    tree = _explained(explained_runs, "plain full")
    assert len(tree.splitlines()) == _FULL_TREE_LINES, len(tree.splitlines())
    assert tree.startswith("explain (rank 0): 446 ops, 27 collectives, 192.1 KiB sent\nGlobal\n"), tree[:200]
    assert re.search(r"^  Transformer\n", tree, re.M)
    assert re.search(r"^        Transformer\.layers\.0\.attention\.wq\n          aten\.\w+", tree, re.M), tree[:3000]
    assert re.search(r"all_reduce on tp: \d+", tree) and "(backward)" in tree


@pytest.mark.e2e
@pytest.mark.extras
def test_the_trainers_explain_draws_with_rich_when_it_is_installed(explained_runs):
    require_extra("rich")
    assert all(r["rich"] is not None for r in explained_runs), "rich is installed here but not in the workers"
    summary = _explained(explained_runs, "rich")
    assert "─" * 40 in summary and "\n  module " not in summary  # rich's table, not the plain printer
    _check_summary(summary)
    tree = _explained(explained_runs, "rich full")
    assert len(tree.splitlines()) == _FULL_TREE_LINES + 1 and "\n  Transformer\n" not in tree  # not the plain printer
    assert re.search(r"^(?:[│ ] {3})*[├└]── Transformer\.layers\.0\.attention\.wq$", tree, re.M), tree[:3000]
    assert re.search(r"[├└]── aten\.\w+", tree) and re.search(r"[├└]── all_reduce on tp: \d+", tree)
    assert "(backward)" in tree


def test_explain_takes_full_or_nothing_on_the_command_line(capsys):
    from shardwise.train import cli

    base = ["--config", "tiny", "--device", "cpu"]
    assert cli.job_from_argv(base).explain is None
    assert cli.job_from_argv(base + ["--explain"]).explain is Detail.SUMMARY
    assert cli.job_from_argv(base + ["--explain", "--tp", "1"]).explain is Detail.SUMMARY
    job = cli.job_from_argv(base + ["--explain", "full"])
    assert job.explain is Detail.FULL and json.loads(json.dumps(job.as_dict()))["explain"] == "full"
    with pytest.raises(SystemExit):
        cli.job_from_argv(base + ["--explain", "ops"])
    assert "argument --explain: takes no value (a line per module) or 'full' (every op), not 'ops'" in capsys.readouterr().err


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
    """The first rank to time out closes its connections, so the other may see its own wait end
    as a lost peer before its timeout fires (gloo; the closer the two timeouts, the likelier on a
    loaded machine): at least one rank reports the timeout with both histories, and any other
    reports the lost peer."""
    messages = dist.run_expect_error(2, _part_ways, exc_type=(comm.CollectiveTimeout, comm.PeerLost), timeout=60)
    timed_out = {rank: m for rank, m in enumerate(messages) if "a peer closed its connection" not in m}
    assert timed_out, messages
    for rank, message in timed_out.items():
        history = re.search(r"; last collectives issued: rank 0: (.*); rank 1: (.*)$", message)
        assert history, message
        rank0, rank1 = (h.split(", ") for h in history.groups())
        # Where they parted: the same all_reduce, then rank 0 a second one, rank 1 the barrier.
        assert re.fullmatch(r"all_reduce #(\d+) on 'tp'", rank0[-2]) and rank0[-2] == rank1[-2], message
        assert re.fullmatch(r"all_reduce #\d+ on 'tp'", rank0[-1]) and re.fullmatch(r"barrier #\d+ on all ranks", rank1[-1])
        stuck = "rank 1 is waiting on barrier" if rank == 0 else "rank 0 is waiting on all_reduce"
        assert stuck in message, message
