"""transport/h2/private.py lists every private name of grpclib, h2, hpack, hyperframe and aiohttp
the package touches; these tests read the source (ast) and fail on a touch the table misses, on
an entry nothing touches any more, and on a touch outside the package.

A touch: `x._name` on anything but self, where some library defines `_name`; `self._name` or
`super()._name`, and `def _name`, in a class whose library base classes define `_name`; a
keyword argument `_name=` some library defines; an import of `_name` from one of the libraries.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import textwrap
from collections import defaultdict
from functools import cache
from pathlib import Path

from eds_server.transport.h2 import private

LIBRARIES = ("grpclib", "h2", "hpack", "hyperframe", "aiohttp")
PACKAGE = Path(__file__).resolve().parents[3] / "eds_server"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def library_names(library: str) -> frozenset[str]:
    """Every private name the library's source defines or uses."""
    spec = importlib.util.find_spec(library)
    assert spec is not None and spec.submodule_search_locations
    names = set()
    for path in Path(next(iter(spec.submodule_search_locations))).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return frozenset(n for n in names if _private(n))


def all_library_names() -> frozenset[str]:
    return frozenset().union(*map(library_names, LIBRARIES))


def inherited_names(cls: type) -> set[str]:
    """Private names the library classes among `cls`'s bases define or use."""
    out: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in LIBRARIES:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                out.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                out.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
                out.add(node.target.id)
    return out


def touches(path: Path, module: str) -> dict[str, list[int]]:
    """The private library names `path` touches, with their lines."""
    loaded = importlib.import_module(module)
    known = all_library_names()
    found: dict[str, list[int]] = defaultdict(list)

    def visit(node: ast.AST, inherited: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            here = inherited
            if isinstance(child, ast.ClassDef):
                cls = getattr(loaded, child.name, None)
                here = inherited_names(cls) if isinstance(cls, type) else set()
                names += [
                    f.name
                    for f in child.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name in here
                ]
            elif isinstance(child, ast.Attribute) and _private(child.attr):
                value = child.value
                own = (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
                    isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
                )
                if child.attr in (inherited if own else known):
                    names.append(child.attr)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] in LIBRARIES:
                names += [a.name for a in child.names if _private(a.name)]
            elif isinstance(child, ast.keyword) and child.arg is not None and child.arg in known:
                names.append(child.arg)
            for name in names:
                found[name].append(getattr(child, "lineno", 0))
            visit(child, here)

    visit(ast.parse(path.read_text(), str(path)), set())
    return found


def package_touches() -> dict[tuple[str, str], list[int]]:
    """(name, module) -> lines, for transport/h2/."""
    out = {}
    for path in sorted((PACKAGE / "transport" / "h2").glob("*.py")):
        module = path.stem
        dotted = "eds_server.transport.h2" + ("" if module == "__init__" else f".{module}")
        for name, lines in touches(path, dotted).items():
            out[(name, module)] = lines
    return out


def test_every_touch_is_in_the_table() -> None:
    table = private.by_name()
    missing = sorted(
        f"transport/h2/{module}.py:{lines[0]} {name}"
        for (name, module), lines in package_touches().items()
        if name not in table or module not in table[name].where
    )
    assert not missing, "private touches not in transport/h2/private.py:\n" + "\n".join(missing)


def test_every_entry_is_still_touched_where_it_says() -> None:
    """Each name is touched in one of the entry's modules at least, and each module touches one of
    the entry's names at least."""
    found = package_touches()
    stale = [
        f"{name} in none of {touch.where}"
        for touch in private.TOUCHES
        for name in touch.names
        if not any((name, module) in found for module in touch.where)
    ]
    stale += [
        f"none of {touch.names} in {module}"
        for touch in private.TOUCHES
        for module in touch.where
        if not any((name, module) in found for name in touch.names)
    ]
    assert not stale, f"entries of transport/h2/private.py no longer true (remove or correct them): {stale}"


def test_each_entry_names_its_own_librarys_private_names_and_a_figure() -> None:
    for touch in private.TOUCHES:
        assert touch.library in LIBRARIES
        assert set(touch.names) <= library_names(touch.library), touch
        assert touch.why and touch.figure, touch
    names = [name for touch in private.TOUCHES for name in touch.names]
    assert len(names) == len(set(names)), "a name in two entries"


def test_no_touch_outside_the_package() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[:2] == ("transport", "h2") or rel.parts[0] == "pb" or rel.name == "__main__.py":
            continue
        module = "eds_server." + ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        found += [f"eds_server/{rel}:{lines[0]} {name}" for name, lines in touches(path, module).items()]
    assert not found, f"private names of {', '.join(LIBRARIES)} touched outside transport/h2/: {found}"


def test_the_walk_sees_each_kind_of_touch() -> None:
    """One of each kind, from the package as it is: attribute, override, keyword, inherited."""
    found = package_touches()
    assert ("_stream", "fast_writer") in found  # stream._stream
    assert ("_receive_frame", "fast_connection") in found  # def _receive_frame in an H2Connection
    assert ("_keepalive_time", "base") in found  # Configuration(_keepalive_time=...)
    assert ("_server", "fast_server") in found  # self._server in a grpclib Server
    assert ("_peer_budgets", "fast_protocol") not in found  # ours
