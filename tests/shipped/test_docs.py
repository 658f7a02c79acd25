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


def test_the_readme_is_a_newcomers_page() -> None:
    """What it is, the two commands (the demo, and the test command CI runs), the picture, the
    features, Envoy's side, then links: one short page, the rest in docs/."""
    text = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings == ["Quick start", "Features", "Point your Envoy at it", "Documentation"]
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make demo" in quick_start and "make test " in quick_start and "](docs/status-page.png)" in quick_start
    assert "make test " in (ROOT / ".ci" / "run").read_text()  # the README's test command is CI's
    assert "retry_back_off" in text and "Health checks" in text
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", text))
    assert linked == {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}  # every page
    assert len(text.splitlines()) <= 140


def test_no_tracker_references() -> None:
    """Readers of the project cannot see its issue tracker: docs, code and tests say what and why in
    words of their own (the changelog keeps dates and versions, not issue numbers)."""
    reference = re.compile(r"\b(issue|item)s? #?[0-9]+", re.I)
    found = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if (
            path.suffix not in (".py", ".md", ".sh", ".yaml", ".toml")
            or parts[0].startswith(".")
            or parts[:2] == ("eds_server", "pb")
            or "node_modules" in parts
            or parts[0] in ("build", "dist")
        ):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if reference.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_map_of_the_tests_names_every_module() -> None:
    """So that a newcomer finds a module's tests from tests/README.md, a new module needs its line."""
    package = ROOT / "eds_server"
    text = (ROOT / "tests" / "README.md").read_text()
    modules = [
        p.relative_to(package).as_posix()
        for p in sorted(package.rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py") and "pb" not in p.relative_to(package).parts
    ]
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


# a dotted name in backquotes: `Class.attribute`, `module.name`, `support.waiting.wait_for`
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
FOREIGN = {"grpc", "Server._protocol_factory"}  # other libraries' names that share one of ours
NOT_CODE = {"py", "md", "sh", "yaml", "yml", "json", "toml", "txt", "io", "service", "html", "png"}  # files, hosts


def _defines(text: str, name: str) -> bool:
    """A def, a class, an assignment or annotation (a field), at any depth, or `self.name =`."""
    return bool(re.search(rf"^\s*(?:(?:async )?def|class) {name}\b|^\s*{name}\s*[:=]|self\.{name}\s*[:=]", text, re.M))


def test_every_code_name_the_docs_cite_exists() -> None:
    """`EdsService.framed`, `upstreams.parse_bytes`, `support.waiting.wait_for`: a class of ours or a
    module of ours (found by the end of its path) must define the name after it. Names of other
    libraries (`grpc.aio`, `yaml.CSafeLoader`) resolve to nothing of ours and are left alone."""
    sources = [p for p in sorted((ROOT / "eds_server").rglob("*.py")) if "pb" not in p.relative_to(ROOT).parts]
    sources += sorted((ROOT / "tests").rglob("*.py"))
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sources}
    classes: dict[str, list[str]] = {}
    for path, text in texts.items():
        if path.startswith("eds_server/"):
            for name in re.findall(r"^class (\w+)", text, re.M):
                classes.setdefault(name, []).append(path)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
    missing, checked = [], 0
    for page in pages:
        for dotted in set(DOTTED.findall(page.read_text())):
            parts = dotted.split(".")
            if dotted in FOREIGN or parts[0] in FOREIGN or parts[-1] in NOT_CODE:
                continue
            if parts[0] in classes:
                where, name = classes[parts[0]], parts[1]
            else:
                where, name = [], ""
                for cut in range(len(parts) - 1, 0, -1):  # the longest module path first
                    suffix = "/".join(parts[:cut]) + ".py"
                    where = [p for p in texts if p == suffix or p.endswith("/" + suffix)]
                    if where:
                        name = parts[cut]
                        break
            if not where:
                continue  # not ours
            checked += 1
            if not any(_defines(texts[p], name) for p in where):
                missing.append(f"{page.name}: {dotted}")
    assert checked >= 5  # the check finds our names at all
    assert not missing, missing


def test_the_design_map_names_every_module() -> None:
    """docs/design.md's map is where a newcomer learns what each module holds: a new module needs
    its mention there, by its path below eds_server/ or its file name."""
    package = ROOT / "eds_server"
    text = (ROOT / "docs" / "design.md").read_text()
    modules = [
        p.relative_to(package).as_posix()
        for p in sorted(package.rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py") and "pb" not in p.relative_to(package).parts
    ]
    assert modules
    assert not [m for m in modules if f"`{m}`" not in text and f"`{m.rsplit('/', 1)[-1]}`" not in text]


def test_the_design_page_is_a_map() -> None:
    """docs/design.md leads a newcomer along the code: its layers, a change out to Envoy and Envoy's
    answer back as hops of `file.py::function` (each resolved by test_every_path_the_docs_name_exists),
    where each kind of part lives, and the test that holds the import arrows."""
    text = (ROOT / "docs" / "design.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for heading in (
        "Layers",
        "A change, from the upstreams file to bytes on the wire",
        "An ACK or NACK, back to the state it changes",
        "Where each kind of part lives",
    ):
        assert heading in sections, heading
    out, back = (
        sections["A change, from the upstreams file to bytes on the wire"],
        sections["An ACK or NACK, back to the state it changes"],
    )
    assert len(re.findall(r"`[\w/]+\.py::\w+`", out)) >= 10 and "`sources/upstreams_file.py::" in out
    assert "`xds/common.py::_settle`" in back and len(re.findall(r"`[\w/]+\.py::\w+`", back)) >= 8
    assert "tests/unit/test_import_direction.py::test_imports_point_down_the_layers" in sections["Layers"]


NAMED_FOLDER = re.compile(r"`([A-Za-z0-9_][A-Za-z0-9_./\-]*/)`")


def test_every_folder_the_docs_name_exists() -> None:
    """`e2e/kubernetes/`, `transport/h2/`: a folder the docs send a reader to holds tracked files (in
    full from the root, or as the end of a path, as the docs name them in context)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
    missing = []
    for page in pages:
        for folder in set(NAMED_FOLDER.findall(page.read_text())):
            if not any(f.startswith(folder) or f"/{folder}" in f for f in files):
                missing.append(f"{page.name}: {folder}")
    assert not missing, missing
