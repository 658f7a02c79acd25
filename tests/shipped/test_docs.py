"""README.md, docs/ and tests/README.md: every relative link leads to a file, every #anchor to a heading;
and the map of the tests names every module."""

from __future__ import annotations

import re
import subprocess

from tests.support.paths import ROOT

# written by other work in progress, linked as "see also" before they land
PENDING = {"docs/xds-behaviour.md", "docs/limits.md", "docs/performance.md", "docs/kubernetes.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            relative = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
            if relative in PENDING and not file.exists():
                continue
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_starts_with_contents_then_prerequisites_quick_start_and_envoy() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert headings[:5] == ["Contents", "Prerequisites", "Quick start", "Install", "Point your Envoy at it"]
    assert len((ROOT / "README.md").read_text().splitlines()) < 400


def test_no_tracker_references() -> None:
    """Readers of the project cannot see its issue tracker: docs, code and tests say what and why in
    words of their own (the changelog keeps dates and versions, not issue numbers)."""
    reference = re.compile(r"\b(issue|item)s? #?[0-9]+", re.I)
    found = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.suffix not in (".py", ".md", ".sh", ".yaml", ".toml") or parts[0].startswith(".") or parts[:2] == (
            "eds_server", "pb"
        ) or "node_modules" in parts or parts[0] in ("build", "dist"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if reference.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_map_of_the_tests_names_every_module() -> None:
    """So that a newcomer finds a module's tests from tests/README.md, a new module needs its line."""
    package = ROOT / "eds_server"
    text = (ROOT / "tests" / "README.md").read_text()
    modules = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and "pb" not in p.relative_to(package).parts]
    assert modules
    assert not [m for m in modules if f"`{m}`" not in text]


# a path in backquotes, optionally followed by ::a_test_or_function
NAMED_PATH = re.compile(r"`([A-Za-z0-9_./\-]+\.(?:py|md|sh|yaml|yml|json|toml|service|txt))(?:::(\w+))?`")
GENERATED = ("bench/results/",)  # written by a run, not kept in the repository


def test_every_path_the_docs_name_exists() -> None:
    """A path the docs give (in full, or from a folder they stand for, like `sources/docker.py`) is
    one the repository holds, and a `file.py::name` names a function or class it defines: docs
    that point at moved files send a reader nowhere."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
    missing = []
    for page in pages:
        for path, name in NAMED_PATH.findall(page.read_text()):
            if "X/" in path or path.startswith(GENERATED):
                continue  # a pattern, or an output
            hits = [f for f in files if f == path or f.endswith("/" + path)]
            if not hits:
                missing.append(f"{page.name}: {path}")
            elif name and not any(re.search(rf"(def|class) {name}\b", (ROOT / f).read_text()) for f in hits):
                missing.append(f"{page.name}: {path}::{name}")
    assert not missing, missing
