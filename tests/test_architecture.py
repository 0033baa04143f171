"""The architecture holds: import contracts (layers, no circles), module and function sizes.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter checks them on the
imports the code actually makes, lazy ones included. A failure names the import that breaks a
layer or closes a circle.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mutualrl"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_modules_stay_under_the_size_rule():
    long = {str(p.relative_to(SRC)): n for p in _sources()
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concept): {long}"


def test_functions_stay_under_the_size_rule():
    long = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name}() {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_package_root_holds_only_the_entry_points_and_shared_utilities():
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "provenance.py", "registry.py",
                     "storage.py"], loose
