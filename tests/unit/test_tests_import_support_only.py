"""Tests share helpers through tests/support only: a test module importing another one runs that
module's fixtures and collection-time code too, and hides a helper where nobody looks for it."""

from __future__ import annotations

import ast

from tests.support.paths import ROOT


def test_tests_import_helpers_only_from_support() -> None:
    tests = ROOT / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("tests.") and not name.startswith("tests.support"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, found
