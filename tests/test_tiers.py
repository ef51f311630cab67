"""The test tiers hold (tests/conftest.py): one tier per test, no Python process started outside
``e2e``, and test modules share code through helper modules, never by importing each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TIERS, tier_markers

TESTS = Path(__file__).resolve().parent


def test_every_collected_test_has_exactly_one_tier(request):
    items = request.session.items
    assert request.node in items
    wrong = {item.nodeid: tier_markers(item) for item in items if len(tier_markers(item)) != 1}
    assert not wrong, f"tests without exactly one of {TIERS}: {wrong}"


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
