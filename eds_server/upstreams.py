"""The upstreams file: YAML text -> validated groups, or every problem with its line and field.

Parsing walks PyYAML's node graph rather than plain dicts so each problem can name its line, and
so duplicate keys (which PyYAML would silently collapse) are caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from . import envoy_limits, fields
from .model import Endpoint, Group, Locality

ENDPOINT_KEYS = (
    "address", "port", "weight", "health", "priority",
    "region", "zone", "subzone", "hostname", "metadata",
)  # fmt: skip
LOCALITY_KEYS = ("region", "zone", "subzone", "weight")
GROUP_KEYS = ("endpoints", "localities")
TOP_KEYS = ("groups",)
MAX_NAME_LENGTH = 1024


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int  # 1-based
    path: str  # e.g. groups.web.endpoints[1].port
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        line = f":{self.line}" if self.line else ""  # 0: about the whole file (e.g. it cannot be read)
        return f"{self.file}{line}: {where}{self.message}"


class UpstreamsError(Exception):
    """The file is not usable; `problems` says why, one entry per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


class _Walker:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []
        self._constructor = yaml.SafeLoader("")

    def problem(self, node: yaml.Node | None, path: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.problems.append(Problem(self.filename, line, path, message))

    def value(self, node: yaml.Node) -> Any:
        """The node as a Python value; ValueError for whatever YAML cannot make of it (bad tags,
        recursive aliases, merge keys, values of the wrong kind for their tag)."""
        try:
            return self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
            reason = getattr(e, "problem", None) or str(e) or type(e).__name__
            raise ValueError(f"not a value: {reason}") from None

    def mapping(
        self, node: yaml.Node, path: str, allowed: tuple[str, ...] | None
    ) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """Key -> (key node, value node); reports non-mappings, duplicate and unknown keys."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, path, "must be a mapping")
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or key == "<<":
                self.problem(key_node, path, "keys must be plain strings")
                continue
            sub = f"{path}.{key}" if path else key
            if key in out:
                self.problem(key_node, sub, "duplicate key")
            elif allowed is not None and key not in allowed:
                self.problem(key_node, sub, f"unknown key (expected one of: {', '.join(allowed)})")
            else:
                out[key] = (key_node, value_node)
        return out

    def field(self, node: yaml.Node, path: str, check: Callable[[Any], Any]) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self.problem(node, path, "must be a single value")
            return None
        try:
            return check(self.value(node))
        except ValueError as e:
            self.problem(node, path, str(e))
            return None


def compose(text: str, filename: str) -> yaml.Node | None:
    """The YAML node graph (None for an empty file); UpstreamsError, with the line, if not YAML."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise UpstreamsError([Problem(filename, 1, "", "not valid YAML: nested too deeply")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        reason = getattr(e, "problem", None) or str(e)
        raise UpstreamsError([Problem(filename, line, "", f"not valid YAML: {reason}")]) from None


def parse(text: str, filename: str = "<upstreams>") -> dict[str, Group]:
    """Parse and validate a whole upstreams file; raise UpstreamsError listing every problem."""
    w = _Walker(filename)
    root = compose(text, filename)
    if root is None:
        raise UpstreamsError(
            [Problem(filename, 1, "", "file is empty (write `groups: {}` to serve no groups)")]
        )
    top = w.mapping(root, "", TOP_KEYS)
    groups: dict[str, Group] = {}
    if top is not None:
        if "groups" not in top:
            w.problem(root, "groups", "missing (the file must have a top-level `groups:` mapping)")
        else:
            groups_node = top["groups"][1]
            if isinstance(groups_node, yaml.ScalarNode) and groups_node.tag.endswith(":null"):
                pass  # `groups:` with nothing under it: no groups
            else:
                for name, (key_node, node) in (w.mapping(groups_node, "groups", None) or {}).items():
                    group = _group(w, name, key_node, node)
                    if group is not None:
                        groups[name] = group
    if w.problems:
        raise UpstreamsError(sorted(w.problems, key=lambda p: p.line))
    return groups


def _group(w: _Walker, name: str, key_node: yaml.Node, node: yaml.Node) -> Group | None:
    path = f"groups.{name}"
    if not name.strip() or len(name) > MAX_NAME_LENGTH or name != name.strip() or not fields.is_unicode(name):
        w.problem(key_node, path, f"group names must be 1-{MAX_NAME_LENGTH} characters, no outer spaces")
        return None
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
        return Group(name)
    spec = w.mapping(node, path, GROUP_KEYS)
    if spec is None:
        return None
    endpoints: list[Endpoint] = []
    if "endpoints" in spec:
        ep_node = spec["endpoints"][1]
        if not isinstance(ep_node, yaml.SequenceNode):
            if not (isinstance(ep_node, yaml.ScalarNode) and ep_node.tag.endswith(":null")):
                w.problem(ep_node, f"{path}.endpoints", "must be a list")
        else:
            seen: dict[tuple[str, int], int] = {}
            for i, item in enumerate(ep_node.value):
                ep_path = f"{path}.endpoints[{i}]"
                ep = _endpoint(w, item, ep_path)
                if ep is None:
                    continue
                if ep.key in seen:
                    w.problem(
                        item, ep_path,
                        f"duplicate endpoint {_show(ep)} (also endpoints[{seen[ep.key]}])",
                    )  # fmt: skip
                    continue
                seen[ep.key] = i
                endpoints.append(ep)
    weights: dict[Locality, int] = {}
    if "localities" in spec:
        weights = _localities(w, spec["localities"][1], f"{path}.localities")
    group = Group(name, tuple(endpoints), weights)
    _check_weight_sums(w, node, path, group)
    return group


def _show(ep: Endpoint) -> str:
    return f"[{ep.address}]:{ep.port}" if ":" in ep.address else f"{ep.address}:{ep.port}"


def _endpoint(w: _Walker, node: yaml.Node, path: str) -> Endpoint | None:
    if isinstance(node, yaml.ScalarNode):
        try:
            value = w.value(node)
            if not isinstance(value, str):
                raise ValueError(f"{value!r} is not ADDRESS:PORT or a mapping")
            address, port = fields.host_port(value)
        except ValueError as e:
            w.problem(node, path, str(e))
            return None
        return Endpoint(address, port)
    spec = w.mapping(node, path, ENDPOINT_KEYS)
    if spec is None:
        return None
    n_problems = len(w.problems)
    for required in ("address", "port"):
        if required not in spec:
            w.problem(node, f"{path}.{required}", "missing")
    values: dict[str, Any] = {}
    for key, (_, value_node) in spec.items():
        if key == "metadata":
            values[key] = _metadata(w, value_node, f"{path}.metadata")
        else:
            values[key] = w.field(value_node, f"{path}.{key}", fields.ENDPOINT_CHECKS[key])
    if len(w.problems) > n_problems:
        return None
    return Endpoint.from_fields(values)


def _metadata(w: _Walker, node: yaml.Node, path: str) -> dict[str, Any]:
    if w.mapping(node, path, None) is None:
        return {}
    try:
        return fields.metadata(w.value(node))
    except ValueError as e:
        w.problem(node, path, str(e))
        return {}


def _localities(w: _Walker, node: yaml.Node, path: str) -> dict[Locality, int]:
    out: dict[Locality, int] = {}
    if not isinstance(node, yaml.SequenceNode):
        w.problem(node, path, "must be a list")
        return out
    for i, item in enumerate(node.value):
        item_path = f"{path}[{i}]"
        spec = w.mapping(item, item_path, LOCALITY_KEYS)
        if spec is None:
            continue
        if "weight" not in spec:
            w.problem(item, f"{item_path}.weight", "missing")
            continue
        parts = {
            k: w.field(spec[k][1], f"{item_path}.{k}", fields.text) if k in spec else ""
            for k in ("region", "zone", "subzone")
        }
        weight = w.field(spec["weight"][1], f"{item_path}.weight", fields.weight)
        if weight is None or None in parts.values():
            continue
        loc = Locality(parts["region"], parts["zone"], parts["subzone"])
        if loc in out:
            w.problem(item, item_path, "duplicate locality")
            continue
        out[loc] = weight
    return out


def _check_weight_sums(w: _Walker, node: yaml.Node, path: str, group: Group) -> None:
    """What Envoy rejects in the whole group (weight sums per priority), reported at the group."""
    for problem in envoy_limits.problems(group):
        w.problem(node, path, problem)


def parse_bytes(data: bytes, filename: str) -> dict[str, Group]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UpstreamsError([Problem(filename, line, "", f"not UTF-8 text: {e.reason}")]) from None
    return parse(text, filename)


def load(path: str) -> dict[str, Group]:
    """Read and parse a file; an unreadable file is one Problem too."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UpstreamsError([Problem(path, 0, "", f"cannot read: {e.strerror or e}")]) from None
    return parse_bytes(data, path)
