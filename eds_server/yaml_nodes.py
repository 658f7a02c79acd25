"""YAML files read as PyYAML node graphs, so every problem can name its line: shared by the
upstreams file (upstreams.py) and the authorization file (security.py).

Composing uses libyaml's C loader when PyYAML has it (its nodes carry line marks too; ~20x faster
than the pure Python one). Anchors and aliases are refused before anything is composed: neither
file needs them, and an alias lets a few hundred bytes expand into gigabytes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import yaml

# libyaml's loader when this PyYAML was built with it; the pure-Python one otherwise (same nodes)
LIBYAML: bool = bool(getattr(yaml, "__with_libyaml__", False))
LOADER: Any = yaml.CSafeLoader if LIBYAML else yaml.SafeLoader

# Words people write for a group's endpoints, and for other keys, that difflib would not match
_MEANT = {
    "hosts": "endpoints",
    "addresses": "endpoints",
    "backends": "endpoints",
    "servers": "endpoints",
    "members": "endpoints",
    "targets": "endpoints",
    "ip": "address",
    "host": "address",
    "addr": "address",
}


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int  # 1-based
    path: str  # e.g. groups.web.endpoints[1].port
    message: str
    column: int = 0  # 1-based, where it helps (YAML syntax errors); 0: not given

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        line = f":{self.line}" if self.line else ""  # 0: about the whole file (e.g. it cannot be read)
        column = f":{self.column}" if self.line and self.column else ""
        return f"{self.file}{line}{column}: {where}{self.message}"


class YamlError(Exception):
    """The text is not YAML this project reads (a syntax error, an anchor or alias): one Problem.
    Each file's reader turns it into its own error."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def line(node: yaml.Node | None) -> int:
    """The node's 1-based line; 1 without a node (a problem of the whole document)."""
    return node.start_mark.line + 1 if node is not None else 1


class NodeWalker:
    """Collects the problems found while walking one file's nodes, each at its node's line."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []

    def problem(self, node: yaml.Node | None, path: str, message: str) -> None:
        self.problems.append(Problem(self.filename, line(node), path, message))

    def sorted_problems(self) -> list[Problem]:
        return sorted(self.problems, key=lambda p: p.line)


def did_you_mean(key: str, allowed: tuple[str, ...]) -> str:
    """`; did you mean `endpoints`?` for a near miss (or a usual other word) of one allowed key, else ''."""
    meant = _MEANT.get(key.lower())
    if meant not in allowed:
        close = difflib.get_close_matches(key.lower(), allowed, n=1, cutoff=0.6)
        meant = close[0] if close else None
    return f"; did you mean `{meant}`?" if meant else ""


def compose(text: str, filename: str) -> yaml.Node | None:
    """The YAML node graph (None for an empty file); YamlError, with the line, if not YAML or if
    it uses anchors or aliases."""
    if "&" in text or "*" in text:  # a cheap test first: these characters are rare in the file
        _refuse_anchors(text, filename)  # before composing: an alias bomb is never built
    try:
        return yaml.compose(text, Loader=LOADER)
    except RecursionError:
        raise YamlError([Problem(filename, 1, "", "not valid YAML: nested too deeply")]) from None
    except yaml.YAMLError as e:
        raise YamlError([syntax_problem(e, filename)]) from None


def syntax_problem(e: yaml.YAMLError, filename: str) -> Problem:
    """PyYAML's error as one line with the line and column where it was found, and what was being
    read when it started (`while scanning a quoted scalar` ... `found unexpected end of stream`)."""
    mark = getattr(e, "problem_mark", None)
    line = mark.line + 1 if mark is not None else 1
    column = mark.column + 1 if mark is not None else 0
    reason = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    context_mark = getattr(e, "context_mark", None)
    if context and context_mark is not None and context_mark.line != (mark.line if mark is not None else -1):
        context += f" (from line {context_mark.line + 1})"
    return Problem(filename, line, "", f"not valid YAML: {reason}" + (f", {context}" if context else ""), column)


def _refuse_anchors(text: str, filename: str) -> None:
    """YamlError at the first anchor or alias (libyaml's scanner: tokens, nothing expanded).
    Text that does not scan is left for the composer to report."""
    tokens = yaml.scan(text, Loader=LOADER)
    while True:
        try:
            token = next(tokens, None)
        except yaml.YAMLError:
            return
        if token is None:
            return
        if isinstance(token, yaml.AnchorToken | yaml.AliasToken):
            what = "anchor" if isinstance(token, yaml.AnchorToken) else "alias"
            raise YamlError(
                [
                    Problem(
                        filename,
                        token.start_mark.line + 1,
                        "",
                        f"YAML {what} {token.value!r}: anchors and aliases are not allowed in the upstreams file "
                        "(write the values out)",
                    )
                ]
            )
