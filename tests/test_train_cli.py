"""The trainer's command line: up-front checks, the checkpoint directory's run lock, --nproc
under a launcher, the printed layout, --help and the config sizes it shows.

Most checks run the CLI entry point in this process as the launching process (launching a
worker fails the test, see ``refusal_in_launcher``). The run lock is held by real separate
processes (one killed with SIGKILL to leave a stale lock); the real launched job that shows the
lock held by the launching process for its workers until the job ends is the command-line run of
tests/test_train.py.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.train import cli
from shardwise.train.config import ConfigError, JobConfig, params_label
from shardwise.train.models.llama import CONFIGS
from shardwise.train.plot import write_loss_plot
from shardwise.train.run_lock import DirectoryInUse, RunLock, hold_for_run, live_holder
from tests.helpers import cli_run, fake_checkpoint, refusal_in_launcher, require_extra

ROOT = Path(__file__).resolve().parents[1]
LAUNCHED = ["--nproc", "2"]  # a job the CLI would launch workers for (refusal_in_launcher fails the test then)
TINY = ["--config", "tiny", "--steps", "20", "--global-batch", "8", "--seq-len", "32", "--seed", "7",
        "--device", "cpu", "--log-every", "1000"]
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------------- output files
def _output_cases(tmp: Path) -> dict:
    (tmp / "file").write_text("")
    return {
        "plot in a missing dir": (["--plot", f"{tmp}/nodir/loss.png"],
                                  rf"--plot '{tmp}/nodir/loss.png': its directory '{tmp}/nodir' does not exist$"),
        "metrics in a missing dir": (["--metrics-file", f"{tmp}/nodir/m.json"],
                                     rf"--metrics-file '{tmp}/nodir/m.json': its directory '{tmp}/nodir' does not exist$"),
        "plot is a directory": (["--plot", str(tmp)], rf"--plot '{tmp}' is a directory; give a file name$"),
        "under a file": (["--metrics-file", f"{tmp}/file/m.json"], rf"its directory '{tmp}/file' is not a directory$"),
        "same file": (["--plot", f"{tmp}/x", "--metrics-file", f"{tmp}/x"],
                      rf"--plot and --metrics-file name the same file '{tmp}/x'$"),
    }


@pytest.mark.parametrize("name", ["plot in a missing dir", "metrics in a missing dir", "plot is a directory",
                                  "under a file", "same file"])
def test_output_files_are_checked_before_any_worker_starts(monkeypatch, capsys, tmp_path, name):
    argv, message = _output_cases(tmp_path)[name]
    err = refusal_in_launcher(monkeypatch, capsys, [*TINY, *LAUNCHED, *argv])
    assert re.search(message, err.strip()), err


@pytest.mark.e2e
def test_plot_into_a_missing_dir_from_the_shell_fails_before_training(tmp_path):
    start = time.monotonic()
    proc = cli_run([*TINY, "--steps", "2", "--plot", str(tmp_path / "nodir" / "loss.png")], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "its directory" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60


def test_under_a_launcher_only_rank_0_checks_the_files_it_writes(monkeypatch, tmp_path):
    """Rank 0 writes the plot: another host of a torchrun job need not have its directory."""
    argv = ["--nproc", "2", "--plot", str(tmp_path / "nodir" / "loss.png")]
    _as_rank_zero(monkeypatch, 2)
    with pytest.raises(ConfigError, match="its directory .* does not exist"):
        cli.job_from_argv(argv)
    monkeypatch.setenv("RANK", "1")
    assert cli.job_from_argv(argv).plot.endswith("loss.png")


@pytest.mark.extras
def test_a_failed_plot_write_is_not_chained_under_the_missing_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError: built-in plotter
    with pytest.raises(FileNotFoundError) as info:
        write_loss_plot(str(tmp_path / "nodir" / "loss.png"), [3.0, 2.0])
    assert info.value.__context__ is None, repr(info.value.__context__)
    assert write_loss_plot(str(tmp_path / "loss.png"), [3.0, 2.0]).endswith("(built-in plotter; install matplotlib "
                                                                            "for a labelled chart)")


@pytest.mark.extras
def test_the_plot_is_a_labelled_matplotlib_chart_when_matplotlib_is_installed(tmp_path):
    require_extra("matplotlib")
    path = tmp_path / "loss.png"
    assert write_loss_plot(str(path), [3.0, 2.0, 2.5]) == f"loss plot: {path}"  # no built-in plotter note
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- run lock
_HOLD = (
    "import importlib.util, sys, time\n"
    "spec = importlib.util.spec_from_file_location('run_lock', sys.argv[2])\n"
    "module = importlib.util.module_from_spec(spec); sys.modules['run_lock'] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True); time.sleep(120)\n"
)


def _holder_process(directory: Path) -> subprocess.Popen:
    """Another run, as far as the lock goes: a separate process holding ``directory``'s lock."""
    source = ROOT / "src" / "shardwise" / "train" / "run_lock.py"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory), str(source)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


@pytest.mark.e2e
@pytest.mark.parametrize("resume", [False, True], ids=["fresh run", "resuming run"])
def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused_and_touches_nothing(monkeypatch, capsys, tmp_path,
                                                                                 resume):
    ckpt = tmp_path / "ckpt"
    if resume:
        fake_checkpoint(str(ckpt), 4)  # a committed checkpoint the other run saved (same config and seed)
    saving = ckpt / "step-8.tmp-0123456789ab"  # the other run's save in progress
    saving.mkdir(parents=True)
    (saving / "part").write_bytes(b"x")
    holder = _holder_process(ckpt)
    try:
        err = refusal_in_launcher(monkeypatch, capsys, [*TINY, *LAUNCHED, "--checkpoint-dir", str(ckpt),
                                                        *(["--resume"] if resume else [])])
    finally:
        _stop(holder)
    expected = (rf"--checkpoint-dir '{ckpt}' is in use by another run \(pid {holder.pid} on host "
                rf"{re.escape(socket.gethostname())}, since .*\): two runs in one directory overwrite")
    assert re.search(expected, err), err
    assert (saving / "part").read_bytes() == b"x"


@pytest.mark.e2e
def test_the_lock_of_a_killed_run_does_not_block_the_next_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = _holder_process(ckpt)
    assert live_holder(str(ckpt)).pid == holder.pid
    with pytest.raises(DirectoryInUse, match=rf"pid {holder.pid} on host"):
        RunLock(str(ckpt)).acquire()
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up: the kernel drops the lock, the file stays
    holder.wait(timeout=30)
    assert (ckpt / ".lock").exists() and live_holder(str(ckpt)) is None
    cli.job_from_argv([*TINY, "--checkpoint-dir", str(ckpt)])  # validates
    with hold_for_run(str(ckpt)):
        mine = live_holder(str(ckpt))
        assert mine.pid == os.getpid() and mine.is_this_job()
        with hold_for_run(str(ckpt)):  # this job again (a worker of its launching process): no second lock
            pass
        assert live_holder(str(ckpt)).pid == os.getpid()
    assert live_holder(str(ckpt)) is None


# A real launched job holding its checkpoint directory until it ends (and printing its layout) is
# checked by tests/test_train.py::test_command_line_run_launches_reports_and_matches, which shares
# the job with the end-to-end command-line run.


# ---------------------------------------------------------------------- --nproc under a launcher
def _as_rank_zero(monkeypatch, world: int) -> None:
    """The environment torchrun gives rank 0 of a ``world``-process job."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world)),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("TORCHELASTIC_RUN_ID", "test")):
        monkeypatch.setenv(name, value)


def test_nproc_under_a_launcher_must_be_left_out_or_equal_the_world_size(monkeypatch, capsys):
    _as_rank_zero(monkeypatch, 1)  # torchrun -m shardwise.train --nproc 2: torchrun started one process
    monkeypatch.setattr(sys, "argv", ["shardwise.train", "--nproc", "2"])
    assert cli.worker() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--nproc 2 differs from the launcher's world size 1: under a launcher the launcher sets the number of " \
           "processes (torchrun: --nproc-per-node, before the program)" in err and "is best left out" in err, err
    _as_rank_zero(monkeypatch, 2)
    assert cli.job_from_argv([]).nproc == 2 and cli.job_from_argv(["--nproc", "2"]).nproc == 2
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cli.job_from_argv([]).nproc == 1 and cli.job_from_argv(["--nproc", "4"]).nproc == 4
    nproc_help = _option_help(cli.build_parser().format_help())["--nproc"]
    assert "local processes this command starts (default: 1)" in nproc_help
    assert "the launcher sets the world size, so leave --nproc out (it is accepted only if equal to it)" in nproc_help
    assert "ambiguous abbreviation of its own --nproc-per-node" in nproc_help


# ---------------------------------------------------------------------- layout and degrees
@pytest.mark.parametrize("kwargs,text", [
    (dict(nproc=4, dp_replicate=2), "HSDP dp_replicate=2 x dp_shard=2 (dp_shard inferred: --nproc 4 / "
                                    "(--dp-replicate 2 x --tp 1))"),
    (dict(nproc=4, dp_replicate=2, dp_shard=2), "HSDP dp_replicate=2 x dp_shard=2"),
    (dict(nproc=2, dp_replicate=2, dp_shard=1), "DDP dp_replicate=2"),
    (dict(nproc=4), "FSDP dp_shard=4 (dp_shard inferred: --nproc 4 / (--dp-replicate 1 x --tp 1))"),
    (dict(nproc=4, tp=4, sequence_parallel=True, loss_parallel=True), "TP tp=4 +SP +loss parallel"),
    (dict(nproc=8, dp_replicate=2, dp_shard=2, tp=2), "HSDP dp_replicate=2 x dp_shard=2 + TP tp=2"),
    (dict(nproc=1), "single process"),
])
def test_the_resolved_layout_is_described_in_words(kwargs, text):
    assert JobConfig(config="tiny", **kwargs).validate().describe_layout() == text


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "4", "--tp", "2", "--dp-shard", "4"],
     r"--dp-replicate 1 x --dp-shard 4 x --tp 2 = 8 must equal the number of processes 4 \(--nproc, or the "
     r"launcher's world size\); --dp-shard -1 \(the default\) infers it$"),
    (["--nproc", "4", "--tp", "3"],
     r"cannot infer --dp-shard: the number of processes 4 \(--nproc, or the launcher's world size\) is not "
     r"divisible by --dp-replicate 1 x --tp 3 = 3$"),
])
def test_degree_errors_name_only_flags_the_cli_has(monkeypatch, capsys, argv, message):
    err = refusal_in_launcher(monkeypatch, capsys, argv).strip()
    assert re.search(message, err), err
    assert not re.search(r"\b(cp|pp|ep|world_size)\b", err), err


# ---------------------------------------------------------------------- --help
def _option_help(text: str) -> dict[str, str]:
    """Option -> its help entry (whitespace joined), from ``format_help`` output."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^  (--[a-z-]+)", text, flags=re.M)]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return {opt: " ".join(text[s:e].split()) for (s, opt), e in zip(starts, ends)}


def test_help_shows_every_meaningful_default():
    parser = cli.build_parser()
    entries = _option_help(parser.format_help())
    shown = 0
    for action in parser._actions:
        if not action.option_strings or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            continue
        entry = entries[action.option_strings[0]]
        assert f"(default: {action.default})" in entry, entry
        shown += 1
    assert "(default: the family's default, debug for llama)" in entries["--config"]
    assert shown == 21, shown  # family, dp degrees, cp, tp, pp, ep, pp schedule, steps, batch, seq len, lr, ..., compile backend, expert imbalance, max restarts
    assert "(default: None)" not in parser.format_help() and "(default: False)" not in parser.format_help()


def test_collective_timeout_flag_is_validated(monkeypatch, capsys):
    assert cli.job_from_argv(["--collective-timeout", "5"]).collective_timeout == 5.0
    assert JobConfig().collective_timeout == 120.0
    for bad in ("0", "-1", "nan", "inf"):
        err = refusal_in_launcher(monkeypatch, capsys, ["--collective-timeout", bad])
        assert "--collective-timeout must be a positive number of seconds" in err, err
    assert "naming the ranks that did not arrive" in _option_help(cli.build_parser().format_help())["--collective-timeout"]


# ---------------------------------------------------------------------- config sizes
def test_help_shows_each_config_with_its_computed_size():
    config_help = _option_help(cli.build_parser().format_help())["--config"]
    for name, args in CONFIGS.items():
        assert f"{name} ({params_label(args.num_params())} params: " in config_help, config_help
    assert params_label(CONFIGS["debug"].num_params()) == "3.28M" and params_label(8_030_261_248) == "8.03B"


_SIZE_CLAIM = re.compile(r"(\d+(?:\.\d+)?)\s*([MB])\s*param", re.I)


@pytest.mark.parametrize("doc", ["src/shardwise/train/models/llama/args.py", "src/shardwise/train/cli.py", "README.md",
                                 *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_no_written_parameter_count_disagrees_with_num_params(doc):
    """Sizes written by hand (``about 40M parameters``) must be one of the configs' real sizes
    (any family's: the guides quote MoE configs too)."""
    from shardwise.train.spec import family_names, get_family

    families = [get_family(name) for name in family_names()]
    sizes = [f.num_params(args) for f in families for args in f.configs.values()]
    assert all(args.num_params() in sizes for args in CONFIGS.values())
    for number, unit in _SIZE_CLAIM.findall((ROOT / doc).read_text()):
        claim = float(number) * (1e9 if unit.upper() == "B" else 1e6)
        decimals = len(number.partition(".")[2])
        tolerance = 0.5 * 10 ** -decimals * (1e9 if unit.upper() == "B" else 1e6)
        assert any(abs(size - claim) <= tolerance for size in sizes), f"{doc}: '{number}{unit} params' is no config's size {sizes}"


def test_a_family_without_config_runs_its_default_config():
    from shardwise.train import cli

    assert cli.job_from_argv([]).config == "debug"  # llama's, as before
    assert cli.job_from_argv(["--family", "moe"]).config == "debug_moe"
    assert cli.job_from_argv(["--family", "moe", "--config", "tiny_moe"]).config == "tiny_moe"
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        cli.job_from_argv(["--family", "nope"])


@pytest.mark.parametrize("argv,hint", [
    (["--dp_shard", "2"], "(did you mean --dp-shard?)"),
    (["--sequence-paralel"], "(did you mean --sequence-parallel?)"),
    (["--dp_shard", "2", "--tp_", "2"], "(did you mean: --dp-shard for --dp_shard, --tp for --tp_?)"),
])
def test_a_flag_typo_is_one_line_naming_the_closest_flag(monkeypatch, capsys, argv, hint):
    err = refusal_in_launcher(monkeypatch, capsys, argv)
    assert "unrecognized arguments" in err and hint in err and err.rstrip().endswith("(see --help)"), err


def test_an_unknown_flag_with_no_close_one_gets_no_guess(monkeypatch, capsys):
    err = refusal_in_launcher(monkeypatch, capsys, ["--frobnicate", "3"])
    assert "did you mean" not in err and "--frobnicate" in err, err
