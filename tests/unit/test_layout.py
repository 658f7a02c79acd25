"""The formatter owns the layout: `ruff format --check` in `make lint` holds every file to it, and
this test holds the way out of it (`# fmt: skip`, `# fmt: off`) to none, so that a passing format
check says the code is formatted, not that it was told to look away."""

from __future__ import annotations

import re

from tests.support.paths import ROOT

MARKER = re.compile(r"#\s*fmt:\s*(skip|off)\b")
TREES = ("eds_server", "tests", "bench", "scripts")
# where a table's layout carries meaning, with the reason (said again beside the marker)
TABLES = {"tests/unit/test_refusals.py": "the refusals, one a line, read as a table"}


def markers() -> dict[str, int]:
    found: dict[str, int] = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if ".venv" in path.parts or path == ROOT / "tests/unit/test_layout.py":
                continue
            count = len(MARKER.findall(path.read_text()))
            if count:
                found[str(path.relative_to(ROOT))] = count
    return found


def test_no_code_is_kept_from_the_formatter() -> None:
    over = {path: n for path, n in markers().items() if n > (path in TABLES)}
    assert not over, f"'# fmt: skip' or '# fmt: off' (let ruff format lay it out): {over}"
