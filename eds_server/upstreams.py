"""The upstreams file: YAML text -> validated groups, or every problem with its line and field.

Parsing walks PyYAML's node graph rather than plain dicts so each problem can name its line, and
so duplicate keys (which PyYAML would silently collapse) are caught (yaml_nodes.py composes the
graph). A `Parser` remembers the groups and endpoints of its last parse by their source
text, so a re-read file re-validates only the groups, and within them the endpoints, whose text
changed. Anchors and aliases are refused: nothing in the file needs them, and an alias lets a
few hundred bytes expand into gigabytes. Reading is bounded too: regular files only, up to a size.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from bisect import bisect_right
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yaml

from . import envoy_checks, fields, yaml_nodes
from .fields import ENDPOINT_KEYS, MAX_NAME_LENGTH, MAX_UPSTREAMS_SIZE
from .health import spec as health_spec
from .health.spec import HealthSpec
from .model import Endpoint, Group, Locality, locality
from .yaml_nodes import LOADER, NodeWalker, Problem, YamlError, did_you_mean

T = TypeVar("T")

LOCALITY_KEYS = ("region", "zone", "subzone", "weight")
GROUP_KEYS = ("endpoints", "localities", "health_check")
TOP_KEYS = ("groups",)
NUMBER_KEYS = ("port", "weight", "priority")  # whole numbers, written as YAML integers in decimal
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_DIRECTIVE = re.compile(r"^%", re.MULTILINE)  # %TAG can change what the same text means: no reuse


class UpstreamsError(Exception):
    """The file is not usable; `problems` says why, one entry per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


# A node's source text with its column: equal keys mean equal values (no anchors, no %TAG)
_TextKey = tuple[int, str]


class _Walker(NodeWalker):
    def __init__(self, filename: str, text: str, groups: dict[Any, Group], endpoints: dict[_TextKey, Endpoint]) -> None:
        super().__init__(filename)
        self.text = text
        self._constructor = yaml.SafeLoader("")
        self.reuse = _DIRECTIVE.search(text) is None
        self.old_groups, self.old_endpoints = groups, endpoints  # from the last parse
        self.groups: dict[Any, Group] = {}  # from this parse: valid ones only
        self.endpoints: dict[_TextKey, Endpoint] = {}
        self.reused_groups = self.reused_endpoints = 0

    def key(self, node: yaml.Node) -> _TextKey:
        return (node.start_mark.column, self.text[node.start_mark.index : node.end_mark.index])

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
                hint = did_you_mean(key, allowed)
                self.problem(key_node, sub, f"unknown key (expected one of: {', '.join(allowed)}){hint}")
            else:
                out[key] = (key_node, value_node)
        return out

    def field(self, node: yaml.Node, path: str, check: Callable[[Any], Any], number: bool = False) -> Any:
        """The checked value; a `number` is also refused unless written as a plain decimal integer:
        `"2"` (text) and `0120` (YAML 1.1 octal: 80) say something else than they seem to."""
        if not isinstance(node, yaml.ScalarNode):
            self.problem(node, path, "must be a single value")
            return None
        if number and node.style in ("'", '"'):
            self.problem(
                node,
                path,
                f"{node.style}{node.value}{node.style} is quoted text, not a number: write it without quotes",
            )
            return None
        if number and node.tag.endswith(":int") and not _DECIMAL.fullmatch(node.value):
            self.problem(
                node,
                path,
                f"{node.value} is not a decimal number (a leading 0 is octal in YAML, "
                f"0x hexadecimal): write it in decimal digits",
            )
            return None
        try:
            return check(self.value(node))
        except ValueError as e:
            self.problem(node, path, str(e))
            return None


class Parser:
    """Parses successive versions of one file, re-validating only what changed since the last.

    Two levels. An edit inside one endpoint written as a one-line flow mapping (`- {address: ...,
    port: ...}`), the last version having been valid, is spliced: only that endpoint's text is
    composed and checked, then its group's duplicate and weight checks run again; whatever else
    (or any problem) takes the full path. The full path composes the whole file but reuses the
    groups, and within changed groups the endpoints, whose source text it has seen before.
    Not thread-safe: one parse at a time (the file source parses in one worker thread)."""

    def __init__(self) -> None:
        self._groups: dict[Any, Group] = {}
        self._endpoints: dict[_TextKey, Endpoint] = {}
        self.reused_groups = self.reused_endpoints = 0  # in the last parse, for tests
        self.spliced = False  # the last parse took the splice path
        self._index = _Index("", {})

    def parse(self, text: str, filename: str = "<upstreams>") -> dict[str, Group]:
        spliced = self.splice(text, filename)
        return spliced if spliced is not None else self.parse_full(text, filename)

    def splice(self, text: str, filename: str) -> dict[str, Group] | None:
        """The splice path only (about a millisecond: cheap enough for the event loop); None where
        the full path is needed."""
        spliced = self._index.splice(text, filename)
        self.spliced = spliced is not None
        if spliced is not None:
            self.reused_groups = len(spliced) - 1
            self.reused_endpoints = len(spliced[self._index.changed].endpoints) - 1
        return spliced

    def parse_full(self, text: str, filename: str) -> dict[str, Group]:
        """The full path (see the class), for a text the splice path has declined."""
        self.spliced = False
        self._index = _Index("", {})
        w = _Walker(filename, text, self._groups, self._endpoints)
        try:
            groups, nodes = _parse(w, text, filename)
        finally:
            # only what this version holds is kept: memory follows the file's size
            self._groups, self._endpoints = w.groups, w.endpoints
            self.reused_groups, self.reused_endpoints = w.reused_groups, w.reused_endpoints
        if w.reuse:
            self._index = _Index(text, groups, nodes)
        return groups

    def parse_bytes(self, data: bytes, filename: str) -> dict[str, Group]:
        return self.parse(decode(data, filename), filename)


_SPLICE_REFUSED = re.compile(r"[\n\r#&*!%]")  # lines, comments, anchors, aliases, tags: the full path


def _common_suffix(a: str, b: str, step: int = 4096) -> int:
    """Length of the common suffix, comparing in C-speed chunks (no reversed copies)."""
    la, lb = len(a), len(b)
    n, i = min(la, lb), 0
    while i + step <= n and a[la - i - step : la - i] == b[lb - i - step : lb - i]:
        i += step
    while i < n and a[la - i - 1] == b[lb - i - 1]:
        i += 1
    return i


def _first_difference(a: str, b: str, step: int = 4096) -> int:
    """Length of the common prefix, comparing in C-speed chunks."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : i + step] == b[i : i + step]:
        i += step
    end = min(i + step, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


class _Index:
    """Where each one-line flow-mapping endpoint of a valid version lies, for splicing."""

    def __init__(self, text: str, groups: dict[str, Group], nodes: dict[str, yaml.Node] | None = None) -> None:
        self.text, self.groups = text, groups
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.where: list[tuple[str, int]] = []  # (group, index in its endpoints)
        self.changed = ""  # the group the last splice changed
        for name, node in (nodes or {}).items():
            seq = _endpoints_node(node)
            if seq is None or name not in groups or len(seq.value) != len(groups[name].endpoints):
                continue
            for i, item in enumerate(seq.value):
                start, end = item.start_mark.index, item.end_mark.index
                if isinstance(item, yaml.MappingNode) and item.flow_style and "\n" not in text[start:end]:
                    self.starts.append(start)
                    self.ends.append(end)
                    self.where.append((name, i))

    def splice(self, text: str, filename: str) -> dict[str, Group] | None:
        """The new version's groups if it differs from the last inside one indexed endpoint and
        that endpoint is valid; None: take the full path."""
        old = self.text
        if not self.starts:
            return None
        p = _first_difference(old, text)
        if p == len(old) == len(text):
            self.changed = next(iter(self.groups))
            return self.groups
        q = _common_suffix(old, text)
        q = min(q, len(old) - p, len(text) - p)
        k = bisect_right(self.starts, p) - 1
        if k < 0 or len(old) - q > self.ends[k]:
            return None
        start, delta = self.starts[k], len(text) - len(old)
        item = text[start : self.ends[k] + delta]
        if not (item.startswith("{") and item.endswith("}")) or _SPLICE_REFUSED.search(item):
            return None
        try:
            node = yaml.compose(item, Loader=LOADER)
        except (yaml.YAMLError, RecursionError):
            return None
        if not isinstance(node, yaml.MappingNode) or node.end_mark.index != len(item):
            return None
        name, i = self.where[k]
        w = _Walker(filename, item, {}, {})
        ep = _endpoint_spec(w, node, f"groups.{name}.endpoints[{i}]")
        if ep is None or w.problems:
            return None  # the full path names the problem with its line
        group = self.groups[name]
        if group.endpoints[i].check is not None:
            ep = dataclasses.replace(ep, check=group.endpoints[i].check)
        endpoints = list(group.endpoints)
        endpoints[i] = ep
        if ep.key != group.endpoints[i].key and any(e.key == ep.key for e in endpoints if e is not ep):
            return None  # a duplicate: the full path says which
        spliced = Group(name, tuple(endpoints), group.locality_weights)
        if envoy_checks.problems(spliced):
            return None  # e.g. weights past Envoy's limit: the full path reports it at the group
        groups = dict(self.groups)
        groups[name] = spliced
        self.text, self.groups, self.changed = text, groups, name
        self.ends[k] += delta
        if delta:
            self.starts[k + 1 :] = [s + delta for s in self.starts[k + 1 :]]
            self.ends[k + 1 :] = [e + delta for e in self.ends[k + 1 :]]
        return groups


def _endpoints_node(node: yaml.Node) -> yaml.SequenceNode | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "endpoints" and isinstance(value, yaml.SequenceNode):
            return value
    return None


def parse(text: str, filename: str = "<upstreams>") -> dict[str, Group]:
    """Parse and validate a whole upstreams file; raise UpstreamsError listing every problem."""
    return Parser().parse(text, filename)


def _parse(w: _Walker, text: str, filename: str) -> tuple[dict[str, Group], dict[str, yaml.Node]]:
    """The groups, and each group's node (for the splice index)."""
    try:
        root = yaml_nodes.compose(text, filename)
    except YamlError as e:
        raise UpstreamsError(e.problems) from None
    if root is None:
        raise UpstreamsError([Problem(filename, 1, "", "file is empty (write `groups: {}` to serve no groups)")])
    top = w.mapping(root, "", TOP_KEYS)
    groups: dict[str, Group] = {}
    nodes: dict[str, yaml.Node] = {}
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
                        nodes[name] = node
    if w.problems:
        raise UpstreamsError(w.sorted_problems())
    return groups, nodes


def _group(w: _Walker, name: str, key_node: yaml.Node, node: yaml.Node) -> Group | None:
    path = f"groups.{name}"
    if not name.strip() or len(name) > MAX_NAME_LENGTH or name != name.strip() or not fields.is_unicode(name):
        w.problem(key_node, path, f"group names must be 1-{MAX_NAME_LENGTH} characters, no outer spaces")
        return None
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
        w.problem(
            key_node,
            path,
            f"empty (null): write `{name}: {{endpoints: []}}` for a group with no endpoints, or remove it",
        )
        return None
    if isinstance(node, yaml.SequenceNode):
        w.problem(node, path, f"must be a mapping, not a list: did you mean `{name}: {{endpoints: [...]}}`?")
        return None
    if not w.reuse:
        return _group_spec(w, name, node, path)
    key = (name, w.key(node))
    group, reused = _kept_or_new(w, w.old_groups, w.groups, key, lambda: _group_spec(w, name, node, path))
    w.reused_groups += reused
    return group


def _kept_or_new(
    w: _Walker, old: Mapping[Any, Any], new: dict[Any, Any], key: Any, build: Callable[[], T]
) -> tuple[T, bool]:
    """The last parse's object for the same source text (its checks depend on nothing else), and
    True; or a new one, kept for the next parse if it came without a problem, and False."""
    found: T | None = old.get(key) or new.get(key)
    if found is not None:
        new[key] = found
        return found, True
    n_problems = len(w.problems)
    made = build()
    if made is not None and len(w.problems) == n_problems:  # e.g. an unknown key still gives an Endpoint
        new[key] = made
    return made, False


def _group_spec(w: _Walker, name: str, node: yaml.Node, path: str) -> Group | None:
    spec = w.mapping(node, path, GROUP_KEYS)
    if spec is None:
        return None
    endpoints: list[Endpoint] = []
    if "endpoints" in spec:
        ep_node = spec["endpoints"][1]
        if not isinstance(ep_node, yaml.SequenceNode):
            if isinstance(ep_node, yaml.ScalarNode) and ep_node.tag.endswith(":null"):
                w.problem(ep_node, f"{path}.endpoints", "empty (null): write `endpoints: []` for no endpoints")
            else:
                w.problem(ep_node, f"{path}.endpoints", "must be a list")
        else:
            seen: dict[tuple[str, int], int] = {}
            for i, item in enumerate(ep_node.value):
                ep_path = f"{path}.endpoints[{i}]"
                ep = _endpoint(w, item, ep_path)
                if ep is None:
                    continue
                if ep.key in seen:
                    shown = fields.address_port(ep.address, ep.port)
                    w.problem(item, ep_path, f"duplicate endpoint {shown} (also endpoints[{seen[ep.key]}])")
                    continue
                seen[ep.key] = i
                endpoints.append(ep)
    weights: dict[Locality, int] = {}
    if "localities" in spec:
        weights = _localities(w, spec["localities"][1], f"{path}.localities")
    if "health_check" in spec:
        check = _health_check(w, spec["health_check"][1], f"{path}.health_check")
        if check is not None:
            endpoints = [dataclasses.replace(ep, check=check) for ep in endpoints]
    group = Group(name, tuple(endpoints), weights)
    _check_weight_sums(w, node, path, group)
    return group


def _health_check(w: _Walker, node: yaml.Node, path: str) -> HealthSpec | None:
    """`health_check: {http: /health, interval: 1s, ...}`: every problem named at its own line."""
    n_problems = len(w.problems)
    spec = w.mapping(node, path, health_spec.KEYS)
    if spec is None:
        return None
    values: dict[str, Any] = {}
    for key, (_, value_node) in spec.items():
        try:
            values[key] = health_spec.check_field(key, w.value(value_node))
        except ValueError as e:
            w.problem(value_node, f"{path}.{key}", str(e))
    if len(w.problems) > n_problems:
        return None
    try:
        return health_spec.build(values)
    except health_spec.SpecError as e:
        where = spec[e.field][1] if e.field in spec else node
        w.problem(where, f"{path}.{e.field}", str(e))
        return None


def _endpoint(w: _Walker, node: yaml.Node, path: str) -> Endpoint | None:
    """One endpoint; the last parse's when its text is the same (its checks depend on nothing else)."""
    if not w.reuse:
        return _endpoint_spec(w, node, path)
    ep, reused = _kept_or_new(w, w.old_endpoints, w.endpoints, w.key(node), lambda: _endpoint_spec(w, node, path))
    w.reused_endpoints += reused
    return ep


def _endpoint_spec(w: _Walker, node: yaml.Node, path: str) -> Endpoint | None:
    if isinstance(node, yaml.ScalarNode):
        try:
            value = w.value(node)
            if not isinstance(value, str):
                raise ValueError(f"{fields.show(value)} is not ADDRESS:PORT or a mapping")
            address, port = fields.host_port(value)
        except ValueError as e:
            w.problem(node, path, str(e))
            return None
        return Endpoint(address, port)
    spaced = _spaced_address(node)
    if spaced is not None:
        w.problem(
            node,
            path,
            f"`{spaced[0]}: {spaced[1]}` reads as a mapping in YAML (the space after the colon): "
            f"write {spaced[0]}:{spaced[1]}",
        )
        return None
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
            values[key] = w.field(value_node, f"{path}.{key}", fields.ENDPOINT_CHECKS[key], key in NUMBER_KEYS)
    if len(w.problems) > n_problems:
        return None
    return Endpoint.from_fields(values)


def _spaced_address(node: yaml.Node) -> tuple[str, str] | None:
    """`- 10.0.0.2: 80`: a one-entry mapping from an IP to a port, meant as `10.0.0.2:80`."""
    if not isinstance(node, yaml.MappingNode) or len(node.value) != 1:
        return None
    key, value = node.value[0]
    if not (isinstance(key, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode)) or key.value in ENDPOINT_KEYS:
        return None
    try:
        fields.ip(key.value)
    except ValueError:
        return None
    return key.value, value.value


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
        weight = w.field(spec["weight"][1], f"{item_path}.weight", fields.weight, number=True)
        if weight is None or None in parts.values():
            continue
        loc = locality(parts["region"], parts["zone"], parts["subzone"])
        if loc in out:
            w.problem(item, item_path, "duplicate locality")
            continue
        out[loc] = weight
    return out


def _check_weight_sums(w: _Walker, node: yaml.Node, path: str, group: Group) -> None:
    """What Envoy rejects in the whole group (weight sums per priority), reported at the group."""
    for problem in envoy_checks.problems(group):
        w.problem(node, path, problem)


def decode(data: bytes, filename: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UpstreamsError([Problem(filename, line, "", f"not UTF-8 text: {e.reason}")]) from None


def parse_bytes(data: bytes, filename: str) -> dict[str, Group]:
    return parse(decode(data, filename), filename)


def read(path: str, max_size: int = MAX_UPSTREAMS_SIZE) -> bytes:
    """The file's bytes: a regular file (symlinks followed) of at most `max_size` bytes.

    A FIFO would block the reader, a device such as /dev/zero never ends: both are refused after
    a non-blocking open, before anything is read. FileNotFoundError passes through (the source
    treats it as transient); every other problem is an UpstreamsError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UpstreamsError([Problem(path, 0, "", f"cannot read: {e.strerror or e}")]) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UpstreamsError([Problem(path, 0, "", "cannot read: Is a directory")])
        if not stat.S_ISREG(st.st_mode):
            raise UpstreamsError([Problem(path, 0, "", "not a regular file (a FIFO or a device)")])
        chunks, size = [], 0
        while size <= max_size:  # bounded: stops past the limit even if the file grows meanwhile
            chunk = os.read(fd, min(1 << 20, max_size + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise UpstreamsError([Problem(path, 0, "", f"cannot read: {e.strerror or e}")]) from None
    finally:
        os.close(fd)
    if size > max_size:
        raise UpstreamsError(
            [Problem(path, 0, "", f"larger than {max_size} bytes (raise the limit with --max-upstreams-size)")]
        )
    return b"".join(chunks)


def read_required(path: str, max_size: int = MAX_UPSTREAMS_SIZE) -> bytes:
    """`read`, with a missing file one Problem too (where the file must be there: a first load)."""
    try:
        return read(path, max_size)
    except FileNotFoundError as e:
        raise UpstreamsError([Problem(path, 0, "", f"cannot read: {e.strerror or e}")]) from None


def load(path: str, max_size: int = MAX_UPSTREAMS_SIZE) -> dict[str, Group]:
    """Read and parse a file; an unreadable file is one Problem too."""
    return parse_bytes(read_required(path, max_size), path)
