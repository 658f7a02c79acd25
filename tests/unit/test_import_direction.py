"""Arrows point down: no import cycle among eds_server's modules, and no module imports a layer above
its own (docs/design.md, "Layers"). Read from the source with `ast`, nothing imported: an import
inside a function counts, and so does one under `if TYPE_CHECKING:` (a module that names another
in its types knows of it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "eds_server"

# Top to bottom, as docs/design.md lists them. A module may import its own layer and those below;
# a name ending in "." is a package and everything in it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "cli", "demo", "options."),  # the commands, and serve's options made into Settings
    ("workers",),  # --workers N: runs Apps in processes of its own
    ("startup",),  # an App started or refused, logging: what the commands and the workers share
    ("app", "settings"),  # assembles one server, from its settings
    ("admin", "status_page", "registration_api", "transport."),  # the ports Envoy and operators use
    ("metrics",),  # an observer of the streams, read by the admin port
    ("sources.", "health.checker", "health.probes", "health.keepalive"),  # the producers of groups; health checks' IO
    (
        "store",
        "source_merge",
        "encoded",
        "subscriptions",
        "xds.",
        "observe",
        "encode",
        "decode",
        "serving_state",
        "heap",
    ),  # serving, without IO
    (
        "model",
        "fields",
        "upstreams",
        "yaml_nodes",
        "security",
        "envoy_checks",
        "protowire",
        "ratelimit",
        "events",
        "ports",
        "worker_process",
        "gc_settings",
        "health",
        "health.spec",
        "health.tracker",
    ),
    # ^ plain data, file formats, small helpers
)

# Known arrows that point up, each with why it is still there. Remove a line when its arrow goes.
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset[str]] = set()

# Inside transport/h2/, the fast path's modules, each importing only those after it (and the
# path-independent ones: base, guard, headers, limits): server on protocol, reader and writer;
# the h2 connection subclass at the bottom.
FAST_PATH = (
    "transport.h2.fast_server",
    "transport.h2.fast_protocol",
    "transport.h2.fast_reader",
    "transport.h2.direct",
    "transport.h2.fast_writer",
    "transport.h2.fast_connection",
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if rel.parts[0] == "pb":  # generated: imports nothing of ours
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours a dotted name lies in (`store.Store` -> `store`), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str) -> set[str]:
    """Every module of ours `name` imports, at its top or anywhere below."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name.removeprefix("eds_server.") for a in node.names if a.name.startswith("eds_server.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            elif (node.module or "").startswith("eds_server"):
                base = (node.module or "").removeprefix("eds_server").lstrip(".")
            else:
                continue
            # `from . import store` names the module store; `from .store import Store`, the module store
            names = [
                f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in MODULES else base
                for a in node.names
            ]
        else:
            continue
        found.update(m for m in map(_resolve, names) if m is not None and m != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> int:
    for i, members in enumerate(LAYERS):
        if any(name == m or (m.endswith(".") and (name + ".").startswith(m)) for m in members):
            return i
    raise AssertionError(f"eds_server/{name}: in no layer of LAYERS (add it where it belongs, and to docs/design.md)")


def cycles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(GRAPH[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    component.add(u)
                    if u == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_walk_sees_top_level_deferred_and_type_only_imports() -> None:
    assert "encoded" in GRAPH["xds.common"]  # from ..encoded import ...
    assert "app" in GRAPH["startup"]  # inside a function, and under TYPE_CHECKING
    assert "admin" in GRAPH["app"]  # from . import admin, security
    assert "cli" in GRAPH["__main__"]


def test_no_import_cycles() -> None:
    found = [sorted(c) for c in cycles() if c not in KNOWN_CYCLES]
    assert not found, f"import cycles among eds_server's modules: {found}"


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if layer(target) < layer(name) and (name, target) not in KNOWN_UPWARD
    )
    assert not upward, "\n".join(f"eds_server/{a} imports {b}, a layer above it" for a, b in upward)


def test_the_fast_path_modules_point_one_way() -> None:
    upward = [(a, b) for i, a in enumerate(FAST_PATH) for b in GRAPH[a] if b in FAST_PATH[: i + 1]]
    assert not upward, f"fast-path modules importing one above them (FAST_PATH): {upward}"
    assert set(FAST_PATH) == {name for name in MODULES if name.startswith(("transport.h2.fast", "transport.h2.direct"))}


def test_the_known_exceptions_are_still_there() -> None:
    """An exception whose arrow is gone is removed from the list, so the list stays true."""
    assert not [(a, b) for a, b in KNOWN_UPWARD if b not in GRAPH[a]]
    assert not [c for c in KNOWN_CYCLES if c not in cycles()]


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer(name)


def test_sources_reach_the_store_only_through_the_aggregator() -> None:
    """Sources are providers: each publishes to a Feed (docs/design.md). Only the aggregator, which
    the App owns, names the Store; a source may name the store's plain types (Resource, Relayed)."""
    naming = sorted(
        name
        for name in MODULES
        if name.startswith("sources.") and name != "sources.aggregator"
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").endswith("store")
        and any(a.name == "Store" for a in node.names)
    )
    assert not naming, f"sources that import the Store itself: {naming}"
