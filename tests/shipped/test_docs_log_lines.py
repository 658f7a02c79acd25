"""Every log line the docs quote is one the code can print: a quote that begins as a log line of the
code does (`docker: `, `not starting: `, `shutdown: `, ...) must match one of the code's log formats
as a whole, the docs' `...` standing for any text. A line reworded in the code and not in the docs
(`docker: connected: 4 labelled containers` for `docker: following engine: ...`) fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import ROOT

LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
SOURCES = ("file", "docker", "swarm", "kubernetes", "registrations", "relay", "etcd")  # "NAME: ..." prefixes
PREFIX = re.compile(r"^(\d{4}-\d\d-\d\d[ T][\d:,.]+Z? )?(DEBUG|INFO|WARNING|ERROR) [\w.]+: ")  # a text line's head
PLACEHOLDER = re.compile(r"%(\([^)]*\))?[-#0 +]*\d*(\.\d+)?[sdrfgi%]")


def _text(node: ast.expr) -> str | None:
    """A format string (a constant, or an f-string with its values as %s), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "%s" for v in node.values)  # type: ignore[misc]
    return None


def log_formats() -> list[str]:
    found = []
    for path in sorted((ROOT / "eds_server").rglob("*.py")):
        if "pb" in path.relative_to(ROOT / "eds_server").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and node.args
                and (text := _text(node.args[0])) is not None
            ):
                found.append(text)
    return found


STAR = None  # a gap: any text


def _glob(fmt: str) -> list[str | None]:
    """A log format as characters and gaps (each placeholder a gap)."""
    out: list[str | None] = []
    pos = 0
    for m in PLACEHOLDER.finditer(fmt):
        out += list(fmt[pos : m.start()])
        out.append("%" if m.group() == "%%" else STAR)
        pos = m.end()
    return out + list(fmt[pos:])


def _quote_glob(quote: str) -> list[str | None]:
    """A quoted line as characters and gaps: the docs' `...` and `N` (a number left out) are gaps."""
    out: list[str | None] = []
    for i, part in enumerate(re.split(r"\.\.\.|\bN\b", quote)):
        if i:
            out.append(STAR)
        out += list(part)
    return out


def _meet(a: list[str | None], b: list[str | None]) -> bool:
    """Whether some text fits both patterns (a gap fits any text, the empty one too)."""
    seen: dict[tuple[int, int], bool] = {}
    stack = [(0, 0)]
    while stack:  # bounded: each (i, j) pair once
        i, j = stack.pop()
        if (i, j) in seen:
            continue
        seen[(i, j)] = True
        if i == len(a) and j == len(b):
            return True
        if i < len(a) and a[i] is STAR:
            stack.append((i + 1, j))
            if j < len(b):
                stack.append((i, j + 1))
        if j < len(b) and b[j] is STAR:
            stack.append((i, j + 1))
            if i < len(a):
                stack.append((i + 1, j))
        if i < len(a) and j < len(b) and a[i] is not STAR and a[i] == b[j]:
            stack.append((i + 1, j + 1))
    return False


def _literal(fmt: str) -> str:
    return PLACEHOLDER.sub("", fmt)


def heads(formats: list[str]) -> set[str]:
    """How the code's log lines begin: each format's text before its first placeholder (6 characters
    or more), and `SOURCE: ` for the formats that begin with the source's name."""
    out = {f"{s}: " for s in SOURCES}
    for fmt in formats:
        head = PLACEHOLDER.split(fmt, maxsplit=1)[0]
        if ":" in head or len(head) >= 12:  # "eds-server " alone would take every command for a log line
            out.add(head)
    return out


def quotes() -> list[tuple[str, str]]:
    """(page, quoted text): inline code spans, and double-quoted strings in code-block comments."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for page in pages:
        text = page.read_text()
        for block in re.findall(r"```.*?```", text, flags=re.S):
            for comment in re.findall(r"#\s(.*)", block):
                found += [(page.name, q) for q in re.findall(r'"([^"]{12,})"', comment)]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(page.name, q) for q in re.findall(r"`([^`\n]{12,})`", prose)]
        found += [
            (page.name, line)
            for block in re.findall(r"```\n(.*?)```", text, flags=re.S)
            for line in block.splitlines()
            if PREFIX.match(line)
        ]
    return found


def matches(quote: str, formats: list[str]) -> bool:
    line = _quote_glob(quote)
    return any(_meet(line, _glob(f)) for f in formats)


def test_the_code_has_log_formats_to_check_against() -> None:
    formats = log_formats()
    assert any(f.startswith("not starting") for f in formats) and "%s: following %s%s" in formats


def test_every_quoted_log_line_is_one_the_code_prints() -> None:
    formats = [f for f in log_formats() if len(_literal(f).strip()) >= 6]
    starts = heads(formats)
    unknown, checked = [], 0
    for page, quote in quotes():
        line = PREFIX.sub("", quote)
        if not any(line.startswith(h) for h in starts):
            continue  # not a log line (a flag, a file, an error text quoted in its own right)
        checked += 1
        if not matches(line, formats):
            unknown.append(f"{page}: {quote}")
    assert checked >= 8  # the docs quote this many log lines at least: the test is not vacuous
    assert not unknown, "quoted as log lines, printed by no log call:\n" + "\n".join(unknown)


def test_a_reworded_line_is_caught() -> None:
    formats = [f for f in log_formats() if len(_literal(f).strip()) >= 6]
    assert matches("docker: following engine: 4 labelled containers", formats)
    assert not matches("docker: connected: 4 labelled containers", formats)
    assert matches("shutdown: 4000 streams ended cleanly, 0 cut (--shutdown-timeout 5s)", formats)
    assert matches("kubernetes: ... the API server closed the watch: it went away ...; reconnecting in N s", formats)


def test_the_env_step_leaves_a_file_without_a_final_newline_whole(tmp_path: Path) -> None:
    """docs/docker.md's and docs/getting-started.md's `.env` line, run on a `.env` whose last line has no newline."""
    import subprocess

    for page in (ROOT / "docs" / "docker.md", ROOT / "docs" / "getting-started.md"):
        [command] = [
            line.split("   #")[0].strip()
            for line in page.read_text().splitlines()
            if line.strip().startswith("grep -q '^DOCKER_GID=' .env")
        ]
        sock = tmp_path / "docker.sock"
        sock.write_text("")
        (tmp_path / ".env").write_text("COMPOSE_PROJECT_NAME=eds-demo")
        for _ in range(2):  # the second run adds nothing
            subprocess.run(
                ["bash", "-c", command.replace("/var/run/docker.sock", str(sock))], cwd=tmp_path, check=True, timeout=30
            )
        lines = (tmp_path / ".env").read_text().splitlines()
        gid = sock.stat().st_gid
        assert [line for line in lines if line] == ["COMPOSE_PROJECT_NAME=eds-demo", f"DOCKER_GID={gid}"], page
