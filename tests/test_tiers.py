"""The test tiers hold (tests/conftest.py): one tier per test, no Python process started outside
``e2e``, and test modules share code through helper modules, never by importing each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COLLECTED, SLOW_TESTS, TIERS, tier_markers

TESTS = Path(__file__).resolve().parent


def test_every_collected_test_has_exactly_one_tier(request):
    items = request.session.items
    assert request.node in items
    wrong = {item.nodeid: tier_markers(item) for item in items if len(tier_markers(item)) != 1}
    assert not wrong, f"tests without exactly one of {TIERS}: {wrong}"
    slow = [item.nodeid for item in items if item.get_closest_marker("slow") and tier_markers(item) != ["dist"]]
    assert not slow, f"'slow' keeps dist tests out of the developer tier; these are not dist: {slow}"
    for item in items:  # the developer tier: unit tests and dist tests not marked slow
        dev = tier_markers(item) == ["unit"] or tier_markers(item) == ["dist"] and not item.get_closest_marker("slow")
        assert bool(item.get_closest_marker("dev")) == dev, item.nodeid


def test_every_slow_entry_names_a_collected_test(request):
    """A renamed test must not leave the developer tier's exclusions stale (checked for the modules
    collected in this session)."""
    collected = set(request.config.stash[COLLECTED])
    modules = {nodeid.split("::")[0] for nodeid in collected}
    stale = [entry for entry in SLOW_TESTS if entry.split("::")[0] in modules
             and not any(n == entry or n.startswith(entry + "[") for n in collected)]
    assert not stale, f"SLOW_TESTS entries that name no test: {stale}"


def test_a_unit_test_cannot_start_a_python_process(request):
    assert tier_markers(request.node) == ["unit"]
    with pytest.raises(AssertionError, match=r"a 'unit' test started a Python process .* mark it @pytest.mark.e2e"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert subprocess.run(["true"]).returncode == 0  # other programs are not refused


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_test_modules_do_not_import_each_other():
    """Shared code lives in helper modules (tests/helpers.py, toy_net.py, op_check.py, ...)."""
    offenders = {}
    for path in sorted(TESTS.glob("*.py")):
        imported = [m for m in _imported_modules(path) if any(part.startswith("test_") for part in m.split("."))]
        if imported:
            offenders[path.name] = sorted(imported)
    assert not offenders, f"test modules importing test modules (move the shared code to tests/helpers.py): {offenders}"
