"""Every code block of README.md and of the guides under docs/ runs as written.

The blocks and their ``<!-- readme-test: ... -->`` markers are read by
``scripts/readme_blocks.py`` (its docstring defines the markers; ``pages()`` lists the pages). Python blocks are saved as
``example.py`` in a fresh directory and started the way their first line tells the reader
(``torchrun --standalone --nproc-per-node N`` / ``python -m shardwise.launch --nproc N`` / ``python``); bash
blocks run from the repository root. ``pip install`` commands are not re-run here (this
environment is such an install; ``.ci/run`` runs them in a fresh virtual environment): their
torch pin must be the installed torch and their extras must exist. Everything runs with only
shardwise's declared dependencies importable (``tests/declared_deps.py``), as for a reader who
followed the README. Skipped blocks are few, give their reason, and get static checks. Under
``.ci/run`` the ``ci`` blocks are skipped too, once its README install step has run them as
written (``CI_BLOCKS_PASSED_ENV``).

A block's job is mostly start-up (a launcher importing torch while its workers wait for it,
single-process blocks using one core), so the selected blocks run two at a time in the
background, in page order, as soon as the first block test asks for its result
(``block_runs``); each block test then checks its own job's exit status and output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import readme_blocks  # noqa: E402

from tests.declared_deps import blocking_env  # noqa: E402

BLOCKS = readme_blocks.all_blocks()
README_BLOCKS = [b for b in BLOCKS if b.page == "README.md"]
RUNNABLE = [b for b in BLOCKS if b.kind not in ("skip", "text")]
MAX_SKIPS = 4  # each names the test that covers it instead
TIMEOUT_S = 240
CONCURRENT_BLOCKS = 2  # jobs at once: one's start-up overlaps the other's work on 2 cores
# Set by .ci/run once its README install step has run every 'ci' block exactly as written (in a
# clean virtual environment, full step counts); the suite then does not run them a second time.
CI_BLOCKS_PASSED_ENV = "SHARDWISE_README_CI_BLOCKS_PASSED"
LAUNCH_LINE = {
    "torchrun": "# {n} processes: torchrun --standalone --nproc-per-node {n} example.py",
    "launch": "# {n} processes: python -m shardwise.launch --nproc {n} example.py",
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID")}
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))  # `python` is this one
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return blocking_env(env)


def _key(block: readme_blocks.Block) -> tuple[str, int]:
    return block.page, block.line


def _block_id(block: readme_blocks.Block) -> str:
    """``README-line12-python``, ``docs/concepts-line40-torchrun``: the page, the line, the kind."""
    return f"{block.page.removesuffix('.md')}-line{block.line}-{block.kind}"


def _ran_by_ci(block: readme_blocks.Block) -> bool:
    """A 'ci' block that .ci/run's README install step already ran as written."""
    return block.ci and os.environ.get(CI_BLOCKS_PASSED_ENV) == "1"


def _text(stream: str | bytes | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _run(cmd: list[str], cwd: Path) -> tuple[int | None, str]:
    """Run one block's command; its exit status and output (a timeout is reported as status None)."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return None, f"(no exit after {TIMEOUT_S} s)\n{_text(exc.stdout)}{_text(exc.stderr)}"
    return proc.returncode, proc.stdout + proc.stderr


def _python_command(block: readme_blocks.Block) -> list[str]:
    if block.kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(block.nproc),
                "example.py"]
    if block.kind == "launch":
        return [sys.executable, "-m", "shardwise.launch", "--nproc", str(block.nproc), "example.py"]
    return [sys.executable, "example.py"]


# ------------------------------------------------------------------ pip commands (checked, not run)
def _commands(block: readme_blocks.Block) -> list[str]:
    """The block's shell commands: one per line, ``&&`` chains split, comments dropped."""
    out = []
    for line in block.tested_code().splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split("&&"))
    return out


def _check_pip(command: str) -> None:
    """``pip install torch==<installed> -e .`` or ``-e ".[<existing extras>]"``."""
    args = shlex.split(command)[2:]
    pins = [a for a in args if a.startswith("torch==")]
    installed = torch.__version__.split("+")[0]
    assert pins == [f"torch=={installed}"], f"{command!r}: pin torch to the tested version {installed}"
    target = args[args.index("-e") + 1]
    extras = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
    assert extras, f"{command!r}: install this project ('-e .' or '-e \".[extra]\"'), got {target!r}"
    known = _extras()
    missing = set((extras.group(1) or "").split(",")) - known - {""}
    assert not missing, f"{command!r}: pyproject.toml has no extra {sorted(missing)} (extras: {sorted(known)})"


def _extras() -> set[str]:
    """The extras pyproject.toml declares (the installed metadata's on Python 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:
        return set(metadata.metadata("shardwise").get_all("Provides-Extra") or [])
    with open(REPO / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


# ------------------------------------------------------------------ the blocks themselves
def _block_command(block: readme_blocks.Block, tmp: Path) -> tuple[list[str], Path]:
    """The command that runs ``block`` as a reader would, and its working directory: a python
    block is saved as ``tmp/example.py``; a bash block's commands, ``pip install`` left out
    (checked by the test instead), run from the repository root."""
    if block.lang == "python":
        (tmp / "example.py").write_text(block.tested_code())
        return _python_command(block), tmp
    rest = [c for c in _commands(block) if not c.startswith("pip install")]
    return ["bash", "-euo", "pipefail", "-c", " && ".join(rest)], REPO


def _runnable(block: readme_blocks.Block) -> bool:
    if block.lang == "python":
        return True
    return block.kind == "bash" and block.lang == "bash" and any(
        not c.startswith("pip install") for c in _commands(block))


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """The jobs of the selected block tests, queued in page order, ``CONCURRENT_BLOCKS`` at a
    time: (page, block line) -> (command, future of (exit status, output)). A block that cannot
    run is not queued; its test fails on its own."""
    selected = {_key(item.callspec.params["block"]) for item in request.session.items
                if item.module.__name__ == __name__ and item.originalname == "test_readme_block_runs"}
    runs: dict[tuple[str, int], tuple[list[str], Future]] = {}
    with ThreadPoolExecutor(max_workers=CONCURRENT_BLOCKS, thread_name_prefix="readme-block") as pool:
        for block in RUNNABLE:
            if _key(block) in selected and _runnable(block) and not _ran_by_ci(block):
                cmd, cwd = _block_command(block, tmp_path_factory.mktemp(f"line{block.line}"))
                runs[_key(block)] = (cmd, pool.submit(_run, cmd, cwd))
        yield runs
        for _, future in runs.values():
            future.cancel()  # after a failed test under -x: queued jobs do not start


@pytest.mark.e2e
@pytest.mark.parametrize("block", RUNNABLE, ids=[_block_id(b) for b in RUNNABLE])
def test_readme_block_runs(block, block_runs):
    if block.lang != "python":
        assert block.kind == "bash" and block.lang == "bash", f"{block.name}: a {block.lang or 'plain'} block cannot run"
        commands = _commands(block)
        for command in commands:
            if command.startswith("pip install"):
                _check_pip(command)
        assert [c for c in commands if not c.startswith("pip install")], f"{block.name}: nothing to run"
    if _ran_by_ci(block):
        pytest.skip(f"{block.name}: .ci/run's README install step ran it as written ({CI_BLOCKS_PASSED_ENV}=1)")
    cmd, future = block_runs[_key(block)]
    status, out = future.result()
    assert status == 0, f"{block.name}\n$ {shlex.join(cmd)}\nexit {status}:\n{out[-5000:]}"


def test_blocks_are_marked_and_few_are_skipped():
    """readme_blocks.all_blocks() raised already for an unmarked block; skips stay rare and explained."""
    skips = [b for b in BLOCKS if b.kind == "skip"]
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} skipped blocks: {[b.name for b in skips]}"
    assert all(b.reason for b in BLOCKS if b.kind in ("skip", "text"))
    assert {b.lang for b in RUNNABLE} <= {"python", "bash"}, [b.name for b in RUNNABLE]
    assert all(b.kind in ("bash",) for b in RUNNABLE if b.lang == "bash")


def test_python_blocks_say_how_to_start_them():
    for block in RUNNABLE:
        if block.kind in LAUNCH_LINE:
            first = block.code.splitlines()[0]
            assert first == LAUNCH_LINE[block.kind].format(n=block.nproc), f"{block.name}: first line {first!r}"


def test_pip_commands_install_this_project_with_the_tested_torch():
    pips = [c for b in BLOCKS if b.lang == "bash" for c in _commands(b) if c.startswith("pip install")]
    assert len(pips) >= 2, pips  # the quick start and the test command
    for command in pips:
        _check_pip(command)


def test_ci_runs_the_readme_commands():
    """.ci/run runs the front page's 'ci' blocks in a clean install, then the README's test command."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "readme_blocks.py --ci-dir" in ci
    ci_blocks = [b for b in BLOCKS if b.ci]
    assert all(b.page == "README.md" for b in ci_blocks), [b.name for b in ci_blocks]
    assert any("shardwise.train" in b.code for b in ci_blocks) and any("shardwise.demo" in b.code for b in ci_blocks)
    suite = next(b for b in README_BLOCKS if "python -m pytest" in b.code)
    assert suite.code.strip() in ci, f".ci/run must run the README's test command {suite.code.strip()!r}"
    # The suite skips the 'ci' blocks only after .ci/run ran them: the variable is exported
    # after the loop over the blocks, before the test command.
    exported = ci.index(f"export {CI_BLOCKS_PASSED_ENV}=1")
    assert ci.index('for block in "$WORK"/blocks/*.sh') < exported < ci.index(suite.code.strip())


_ENTRY = re.compile(r"^( *)([\w./]+/|[\w.]+\.(?:py|json))(?=\s|$)")
_DESCRIPTION_COLUMN = 24  # a line indented this far continues the description above it


def _layout_entries(code: str) -> list[tuple[str, str]]:
    """(path, description) per entry of the layout tree: a path opens each line, nested by indentation."""
    entries, stack = [], []  # stack: (indent, folder) of the enclosing folders
    for line in code.splitlines():
        match = _ENTRY.match(line)
        if match is None or len(match.group(1)) >= _DESCRIPTION_COLUMN:
            if entries:  # a continuation line: part of the last entry's description
                entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([folder for _, folder in stack] + [name.rstrip("/")])
        entries.append((path, line[match.end():].strip()))
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
    return entries


def test_layout_block_matches_the_tree():
    """Every entry of the code layout (docs/architecture.md) exists at the path its nesting gives;
    every package of the library has an entry; a file a folder's description names is in that folder."""
    layout = next(b for b in BLOCKS if b.code.startswith("src/shardwise/"))
    entries = _layout_entries(layout.code)
    missing = [path for path, _ in entries if not (REPO / path).exists()]
    assert not missing, f"docs/architecture.md's code layout names paths that do not exist: {missing}"
    listed = {path for path, _ in entries}
    packages = sorted(str(p.parent.relative_to(REPO)) for p in (REPO / "src" / "shardwise").rglob("__init__.py"))
    unlisted = [p for p in packages if p not in listed and p != "src/shardwise"]
    assert not unlisted, f"docs/architecture.md's code layout does not show these packages: {unlisted}"
    for path, description in entries:
        if (REPO / path).is_dir():
            here = {f.name for f in (REPO / path).rglob("*.py")}
            strays = [n for n in re.findall(r"\b[\w]+\.py\b", description) if n not in here]
            assert not strays, f"docs/architecture.md's layout: {path}/ describes files it does not hold: {strays}"


def test_benchmark_commands_name_existing_scripts_and_flags():
    block = next(b for b in BLOCKS if b.code.startswith("python benchmarks/"))
    for command in _commands(block):
        _, script, *flags = shlex.split(command)
        source = (REPO / script).read_text()
        for flag in (f for f in flags if f.startswith("-")):  # options, not their values
            assert f'"{flag}"' in source, f"{command!r}: {script} has no option {flag}"


def test_the_trace_of_a_matmul_names_existing_functions():
    """docs/trace.md (scripts/trace_matmul.py's output, explained) names only functions that exist."""
    import ast

    text = (REPO / "docs" / "trace.md").read_text()
    named = set(re.findall(r"\b([\w/]+\.py):([\w.]+)", text))
    assert len(named) > 20, "docs/trace.md should list the functions the trace visits"
    missing = []
    for path, qualname in sorted(named):
        source = REPO / "src" / "shardwise" / path
        if not source.exists():
            missing.append(f"{path} (no such file)")
            continue
        defined = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.add(node.name)
                defined |= {f"{node.name}.{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
        if qualname not in defined:
            missing.append(f"{path}:{qualname}")
    assert not missing, f"docs/trace.md names functions that do not exist (rerun scripts/trace_matmul.py): {missing}"


def test_the_collective_timeout_defaults_are_the_documented_ones():
    """docs/failures.md's table gives each default once: the trainer's flag and the library's."""
    from shardwise.comm.timeout import DEFAULT_COLLECTIVE_TIMEOUT_S
    from shardwise.train.config import JobConfig

    rows = dict(re.findall(r"^\| (the trainer|everything else)\b.*\| (\d+) s \|$", (REPO / "docs" / "failures.md").read_text(), re.M))
    assert rows == {"the trainer": f"{JobConfig().collective_timeout:.0f}", "everything else": f"{DEFAULT_COLLECTIVE_TIMEOUT_S:.0f}"}, rows
