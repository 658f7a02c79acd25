"""Every known bug of tests/support/mutants.py still goes back into today's code: most are exact
edits of a method's source, so a refactor (or the formatter) that changes that text would leave
`make test-mutants` failing only when someone runs it. Each is applied in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.mutants import MUTANTS
from tests.support.paths import ROOT


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_mutant_still_applies(name: str) -> None:
    code = f"from tests.support.mutants import apply; apply({name!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
