"""Property-based tests (hypothesis): parsers, encoding and the stream state machines against models.

Fast enough for every run. To hunt for bugs with more examples:
`EDS_HYPOTHESIS_SCALE=10 .venv/bin/python -m pytest tests/unit/test_properties.py`.

No example database is kept (`database=None`); hypothesis still caches a little in .hypothesis/,
which carries its own .gitignore.

The `test_regression_*` tests pin the bugs these properties found (all fixed), each with its minimal
example.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, event, given, note
from hypothesis import strategies as st

from eds_server import protowire, upstreams
from eds_server.encode import LB_METADATA_KEY, cluster_load_assignment, encode_group
from eds_server.encoded import Resource
from eds_server.model import Endpoint, Group, Health, Locality
from eds_server.sources.containers import SETTING_KEYS, DockerOptions, container_endpoints, groups_of
from eds_server.xds import wire
from eds_server.xds.common import EDS_TYPE_URL, ProtocolError, StaleNonce, SubscriptionLimits, response_version
from eds_server.xds.delta import DeltaRequest, DeltaResponse, DeltaStream
from eds_server.xds.sotw import Request, Response, SotwStream
from tests.support.sotw_checked import CheckedSotwStream
from tests.support.strategies import (
    CHARS,
    NAMES,
    TEXT,
    UINT32_MAX,
    examples,
    gen_files,
    ip_text,
    model_endpoints,
    pick,
    render,
    shorthand,
)


@examples(100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_upstreams_valid_files_parse_to_exactly_their_groups(data: st.DataObject) -> None:
    groups = data.draw(gen_files())
    text = render(data.draw, groups)
    note(text)
    assert upstreams.parse(text, "up.yaml") == {g.name: g.expected() for g in groups}


MUTATIONS = ("port", "weight", "health", "hostname", "unknown_key", "duplicate", "group_key")
HOSTNAMES = st.from_regex(r"[a-z][a-z0-9-]{0,8}(\.[a-z]{2,6}){0,2}", fullmatch=True)


@st.composite
def broken_files(draw: st.DrawFn) -> tuple[str, str, str]:
    """A valid file with one field made invalid: (text, path of the problem, text on its line)."""
    groups = draw(gen_files(min_groups=1, min_endpoints=1))
    rendered = {g.name: g.render() for g in groups}
    g = pick(draw, groups)
    spec = rendered[g.name]
    i = draw(st.integers(0, len(g.endpoints) - 1))
    gen = g.endpoints[i]
    ep, item = gen.endpoint, copy.deepcopy(gen.rendering)
    v6 = ":" in ep.address
    path = f"groups.{g.name}.endpoints[{i}]"
    kind = pick(draw, MUTATIONS)
    as_mapping = item if isinstance(item, dict) else {"address": gen.address_text, "port": ep.port}
    if kind == "port":
        bad = pick(draw, [0, 70000, "0", "70000", -1])
        if isinstance(item, str):
            item = marker = shorthand(gen.address_text, bad, v6)
        else:
            item["port"], path, marker = bad, path + ".port", "port"
    elif kind == "weight":
        item = as_mapping
        item["weight"], path, marker = pick(draw, [0, "0", -3, UINT32_MAX + 1]), path + ".weight", "weight"
    elif kind == "health":
        item = as_mapping
        item["health"], path, marker = pick(draw, ["ok", "up", "bogus", "1", 1]), path + ".health", "health"
    elif kind == "hostname":
        host = marker = draw(HOSTNAMES)
        if isinstance(item, str):
            item = shorthand(host, ep.port, False)
        else:
            item["address"], path = host, path + ".address"
    elif kind == "unknown_key":
        item = as_mapping
        key = marker = pick(draw, ["wieght", "adress", "tags", "zones", "Port"])
        item[key], path = 1, f"{path}.{key}"
    if kind == "group_key":
        marker = "endpionts"
        spec["endpionts"], path = [], f"groups.{g.name}.endpionts"
    elif kind == "duplicate":
        # another spelling of endpoint i (shorthand or mapping, any textual form of the IP), later on
        text = ip_text(draw, ipaddress.ip_address(ep.address))
        copy_ = shorthand(text, ep.port, v6) if draw(st.booleans()) else {"address": text, "port": ep.port}
        k = draw(st.integers(i + 1, len(g.endpoints)))
        spec["endpoints"].insert(k, copy_)
        path, marker = f"groups.{g.name}.endpoints[{k}]", text
    else:
        spec["endpoints"][i] = item
    return render(draw, groups, rendered), path, marker


@examples(100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(broken_files())
def test_upstreams_one_bad_field_is_one_problem_with_file_line_and_path(case: tuple[str, str, str]) -> None:
    text, path, marker = case
    note(text)
    with pytest.raises(upstreams.UpstreamsError) as e:
        upstreams.parse(text, "up.yaml")
    lines = text.splitlines()
    for p in e.value.problems:
        assert p.file == "up.yaml" and 1 <= p.line <= len(lines) and p.path.startswith("groups.")
        assert str(p).startswith(f"up.yaml:{p.line}: {p.path}: ")
    [p] = e.value.problems
    assert p.path == path
    assert marker in lines[p.line - 1], (p, lines[p.line - 1])


# YAML-shaped noise: the tokens of the format, structure and scalars of every kind
FRAGMENTS = [
    "groups:",
    "groups: ",
    "\n",
    "\n  ",
    "\n    ",
    "\n      ",
    "- ",
    "{",
    "}",
    "[",
    "]",
    ", ",
    ": ",
    "? ",
    "endpoints",
    "localities",
    "address",
    "port",
    "weight",
    "health",
    "priority",
    "region",
    "zone",
    "subzone",
    "hostname",
    "metadata",
    "web",
    "10.0.0.1",
    "::1",
    "[::1]:80",
    "10.0.0.1:80",
    "80",
    "0",
    "-1",
    "4294967296",
    "1e3",
    "1.5",
    "null",
    "~",
    "true",
    "yes",
    "draining",
    "'",
    '"',
    "&a ",
    "*a",
    "<<: ",
    "#",
    "---",
    "...",
    "%YAML 1.1\n",
    "|",
    ">",
    "\t",
    "2001-01-01",
    ".inf",
    "0x10",
    "0o7",
    "\\u00e9",
    "\\ud800",
]
YAMLISH = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=30).map("".join)


def _parse_only_raises_upstreams_error(text: str) -> None:
    try:
        upstreams.parse(text, "up.yaml")
    except upstreams.UpstreamsError as e:
        assert e.problems and all(p.file == "up.yaml" and p.line >= 1 for p in e.problems)


@examples(400)
@given(st.text() | YAMLISH)
def test_upstreams_arbitrary_text_only_raises_upstreams_error(text: str) -> None:
    _parse_only_raises_upstreams_error(text)


@st.composite
def damaged_files(draw: st.DrawFn) -> str:
    """Valid files with a few bytes inserted, deleted or replaced: noise that reaches deep into the parser."""
    text = render(draw, draw(gen_files(min_groups=1)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        action = pick(draw, ["insert", "delete", "replace"])
        if action == "insert":
            text = text[:i] + pick(draw, [*FRAGMENTS, "!!int ", "!!bool ", "!foo ", "*b", "&b "]) + text[i:]
        elif action == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 4)) :]
        else:
            text = text[:i] + draw(st.text(max_size=2)) + text[i + 1 :]
    return text


@examples(60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(damaged_files())
def test_upstreams_damaged_files_only_raise_upstreams_error(text: str) -> None:
    _parse_only_raises_upstreams_error(text)


@examples(100)
@given(st.binary(max_size=200))
def test_upstreams_arbitrary_bytes_only_raise_upstreams_error(data: bytes) -> None:
    with contextlib.suppress(upstreams.UpstreamsError):
        upstreams.parse_bytes(data, "up.yaml")


ENDPOINT = "groups:\n  web:\n    endpoints:\n      - "


@pytest.mark.parametrize(
    "text",
    [
        ENDPOINT + "{address: 10.0.0.1, port: !foo 80}\n",  # unknown tag: yaml ConstructorError
        ENDPOINT + "!foo 10.0.0.1:80\n",  # the same, shorthand
        ENDPOINT + "!!int x\n",  # ValueError from the constructor, outside any try (shorthand)
        ENDPOINT + "{address: 10.0.0.1, port: !!bool x}\n",  # KeyError
        ENDPOINT + "{address: 10.0.0.1, port: !!timestamp x}\n",  # AttributeError
        ENDPOINT + "{address: 10.0.0.1, port: 80, metadata: {a: !foo x}}\n",
        ENDPOINT + "{address: 10.0.0.1, port: 80, metadata: {a: &x [*x]}}\n",  # recursive alias
        ENDPOINT + "{address: 10.0.0.1, port: 80, metadata: {a: {<<: 1}}}\n",  # bad merge key
    ],
    ids=[
        "unknown-tag",
        "unknown-tag-shorthand",
        "bad-int-shorthand",
        "bad-bool",
        "bad-timestamp",
        "metadata-unknown-tag",
        "metadata-recursive-alias",
        "metadata-bad-merge",
    ],
)
def test_regression_yaml_construction_errors_escape_parse(text: str) -> None:
    with pytest.raises(upstreams.UpstreamsError):
        upstreams.parse(text, "up.yaml")


def test_regression_yaml_deep_nesting() -> None:
    with pytest.raises(upstreams.UpstreamsError):
        upstreams.parse("groups: " + "[" * 1000, "up.yaml")


@pytest.mark.parametrize(
    "text",
    [
        ENDPOINT + "{address: 10.0.0.1, port: 80, metadata: {a: %s}}\n" % ("9" * 400),  # struct.error
        'groups:\n  "\\ud800": {endpoints: [10.0.0.1:80]}\n',  # UnicodeEncodeError
        ENDPOINT + '{address: 10.0.0.1, port: 80, hostname: "\\udc00"}\n',
        ENDPOINT + '{address: 10.0.0.1, port: 80, metadata: {"\\udc00": 1}}\n',
    ],
    ids=["metadata-huge-int", "surrogate-group-name", "surrogate-hostname", "surrogate-metadata-key"],
)
def test_regression_unencodable_values_pass_validation(text: str) -> None:
    try:
        groups = upstreams.parse(text, "up.yaml")
    except upstreams.UpstreamsError:
        return  # refusing them is a fix too
    for g in groups.values():
        encode_group(g)


# -- 2. container labels ---------------------------------------------------------------------------
CONTAINER = "shop-web-1"
NETWORK, NETWORK_IP, EXPOSED = "shop_default", "172.20.0.5", 8080


def inspect(labels: dict[str, str]) -> dict[str, Any]:
    """A running container that would be fine without labels: one network, one exposed port."""
    return {
        "Id": "0123456789abcdef",
        "Name": "/" + CONTAINER,
        "State": {"Status": "running", "Running": True},
        "Config": {"Labels": labels, "ExposedPorts": {f"{EXPOSED}/tcp": {}}},
        "HostConfig": {"NetworkMode": "bridge"},
        "NetworkSettings": {"Networks": {NETWORK: {"IPAddress": NETWORK_IP}}, "Ports": {}},
    }


LABEL_GROUPS = st.from_regex(r"[a-z][a-z0-9_-]{0,6}(\.[a-z0-9]{1,3})?", fullmatch=True)
LABEL_KEYS = st.one_of(
    st.sampled_from([*SETTING_KEYS, "group", "metadata.x", "metadata.", "", "."]),
    st.builds(lambda g, k: f"{g}.{k}", LABEL_GROUPS, st.sampled_from([*SETTING_KEYS, "metadata.v", "bogus"])),
    st.text(max_size=12),
)
LABEL_VALUES = st.one_of(
    st.sampled_from(["", "80", "0", "65536", "1", "x", "10.0.0.9", "::1", "db.local", "shop_default", "default"]),
    st.text(CHARS, max_size=12),
)


def _label_named(warning: str, labels: dict[str, str]) -> bool:
    """The warning points at a label: by its key, or (network selection) by the value it asked for."""
    for key, value in labels.items():
        if not key.startswith("eds."):
            continue
        if re.search(f"label {re.escape(key)}[: ]", warning) or (
            key.endswith("network") and f"network {value!r}" in warning
        ):
            return True
    return False


@examples(300)
@given(
    st.dictionaries(LABEL_KEYS.map(lambda k: "eds." + k), LABEL_VALUES, max_size=6),
    st.one_of(st.none(), st.text(CHARS, max_size=10), st.lists(LABEL_GROUPS, min_size=1, max_size=3).map(",".join)),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
)
def test_containers_arbitrary_labels_never_raise(
    labels: dict[str, str], group: str | None, other: dict[str, str]
) -> None:
    if group is not None:
        labels["eds.group"] = group
    labels = {**other, **labels}
    c = container_endpoints(inspect(labels), DockerOptions())
    if c.warning is None:
        assert all(isinstance(ep, Endpoint) for ep in c.endpoints.values())
        return
    assert c.endpoints == {}
    assert c.warning.startswith(f"container {CONTAINER}: ") and c.warning.endswith("; skipped")
    assert _label_named(c.warning, labels), (c.warning, labels)


SETTINGS = st.fixed_dictionaries(
    {},
    optional={
        "port": st.integers(1, 65535).map(str),
        "weight": st.integers(1, UINT32_MAX).map(str),
        "priority": st.integers(0, 128).map(str),
        "region": TEXT,
        "zone": TEXT,
        "subzone": TEXT,
        "hostname": TEXT,
        "address": st.ip_addresses().map(str),
        "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
    },
)


def _flatten(settings_: dict[str, Any], prefix: str) -> dict[str, str]:
    out = {f"{prefix}{k}": v for k, v in settings_.items() if k != "metadata"}
    out.update({f"{prefix}metadata.{k}": v for k, v in settings_.get("metadata", {}).items()})
    return out


def _expected_endpoint(common: dict[str, Any], own: dict[str, Any]) -> Endpoint:
    s = {**common, **own, "metadata": {**common.get("metadata", {}), **own.get("metadata", {})}}
    return Endpoint(
        address=str(ipaddress.ip_address(s.get("address", NETWORK_IP))),
        port=int(s.get("port", EXPOSED)),
        weight=int(s["weight"]) if "weight" in s else None,
        health=Health.HEALTHY,
        priority=int(s.get("priority", 0)),
        locality=Locality(s.get("region", ""), s.get("zone", ""), s.get("subzone", "")),
        hostname=s.get("hostname", CONTAINER),
        metadata=s["metadata"],
    )


@examples(200)
@given(
    st.lists(
        LABEL_GROUPS.filter(lambda g: g not in SETTING_KEYS and not g.startswith("metadata")),
        min_size=1,
        max_size=3,
        unique=True,
    ),
    SETTINGS,
    st.data(),
)
def test_containers_valid_labels_give_the_expected_endpoints(
    groups: list[str], common: dict[str, Any], data: st.DataObject
) -> None:
    own = {g: data.draw(SETTINGS, label=f"own[{g}]") for g in groups}
    spacing = pick(data.draw, [",", ", ", " , "])
    labels = {"eds.group": spacing.join(groups), **_flatten(common, "eds.")}
    for g in groups:
        labels.update(_flatten(own[g], f"eds.{g}."))
    c = container_endpoints(inspect(labels), DockerOptions())
    assert c.warning is None, c.warning
    assert c.endpoints == {g: _expected_endpoint(common, own[g]) for g in groups}
    assert {name: list(grp.endpoints) for name, grp in groups_of([c]).items()} == {
        g: [ep] for g, ep in c.endpoints.items()
    }


def test_regression_group_label_named_by_its_common_key() -> None:
    c = container_endpoints(inspect({"eds.group": "web", "eds.web.port": "http"}), DockerOptions())
    assert c.warning is not None and "eds.web.port" in c.warning, c.warning


# -- 3. encoding ---------------------------------------------------------------------------------
@st.composite
def model_groups(draw: st.DrawFn) -> Group:
    eps = draw(st.lists(model_endpoints(), max_size=8, unique_by=lambda e: e.key))
    locs = [e.locality for e in eps] + [Locality("r", "z", "s")]
    weights = draw(st.dictionaries(st.sampled_from(locs), st.integers(1, UINT32_MAX), max_size=3))
    return Group(draw(NAMES), tuple(eps), weights)


def _cla(data: bytes) -> endpoint_pb2.ClusterLoadAssignment:
    return endpoint_pb2.ClusterLoadAssignment.FromString(data)


def _struct(metadata: Any) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(metadata)
    return s


def _reordered(value: Any) -> Any:
    """The same JSON value with every mapping's keys in reverse order."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


def _summary(cla: endpoint_pb2.ClusterLoadAssignment) -> tuple[str, list[Any]]:
    """The CLA as comparable data, independent of the order of localities and endpoints."""
    out = []
    for lle in cla.endpoints:
        eps = sorted(
            (
                e.endpoint.address.socket_address.address,
                e.endpoint.address.socket_address.port_value,
                e.endpoint.hostname,
                e.health_status,
                e.load_balancing_weight.value if e.HasField("load_balancing_weight") else None,
                e.metadata.filter_metadata[LB_METADATA_KEY].SerializeToString(deterministic=True)
                if e.HasField("metadata")
                else None,
            )
            for e in lle.lb_endpoints
        )
        weight = lle.load_balancing_weight.value if lle.HasField("load_balancing_weight") else None
        out.append((lle.priority, lle.locality.region, lle.locality.zone, lle.locality.sub_zone, weight, eps))
    return cla.cluster_name, sorted(out, key=repr)


def _expected_summary(g: Group) -> tuple[str, list[Any]]:
    buckets: dict[tuple[int, Locality], list[Any]] = {}
    for e in g.endpoints:
        md = _struct(e.metadata).SerializeToString(deterministic=True) if e.metadata else None
        buckets.setdefault((e.priority, e.locality), []).append(
            (e.address, e.port, e.hostname, int(e.health), e.weight, md)
        )
    out = [
        (prio, loc.region, loc.zone, loc.subzone, g.locality_weights.get(loc), sorted(eps))
        for (prio, loc), eps in buckets.items()
    ]
    return g.name, sorted(out, key=repr)


@examples(100)
@given(model_groups(), st.randoms(use_true_random=False))
def test_encode_group_matches_generated_classes_and_is_canonical(g: Group, rnd: Any) -> None:
    fast = encode_group(g)
    assert _cla(fast) == _cla(bytes(cluster_load_assignment(g)))
    assert _summary(_cla(fast)) == _expected_summary(g)  # and both say what the group says
    shuffled = list(g.endpoints)
    rnd.shuffle(shuffled)
    same = Group(
        g.name,
        tuple(
            Endpoint(e.address, e.port, e.weight, e.health, e.priority, e.locality, e.hostname, _reordered(e.metadata))
            for e in shuffled
        ),
        dict(reversed(list(g.locality_weights.items()))),
    )
    assert encode_group(same) == fast


@examples(100)
@given(model_groups(), model_groups(), st.randoms(use_true_random=False))
def test_encode_group_reusing_endpoint_objects_matches_a_fresh_encoding(g: Group, h: Group, rnd: Any) -> None:
    """encode.py finds the endpoints of a group's last encoding by identity (the file's parser keeps
    unchanged ones): a next version mixing kept objects and new ones encodes as if all were new."""
    encode_group(g)
    kept = [e for e in g.endpoints if rnd.random() < 0.7]
    taken = {e.key for e in kept}
    mixed = Group(g.name, tuple(kept) + tuple(e for e in h.endpoints if e.key not in taken), h.locality_weights)
    reused = encode_group(mixed)
    anew = Group(mixed.name, tuple(dataclasses.replace(e) for e in mixed.endpoints), mixed.locality_weights)
    assert reused == encode_group(anew)
    assert _cla(reused) == _cla(bytes(cluster_load_assignment(mixed)))


# -- 4. the stream state machines ------------------------------------------------------------------
STREAM_NAMES = ("a", "b", "c")


class View:
    """A store stand-in whose versions are its contents (as the store's are a hash of them)."""

    withholds = False

    def __init__(self, ready: bool) -> None:
        self.ready = ready
        self.bodies: dict[str, bytes] = {}

    def get(self, name: str) -> Resource:
        body = self.bodies.get(name, b"empty:" + name.encode())
        return Resource(name, body.decode(), body, Group(name))

    def version(self, name: str) -> str:
        return self.get(name).version


# Operations, interpreted against the model (an op that does not apply at that point is a no-op):
#   ("set", name, k) / ("remove", name): store changes;  ("ready",): the store becomes ready;
#   ("sub", names, unsubscribe, empty_nonce): a subscription change (SotW: `names` is the new list);
#   ("ack" | "nack", change): an answer to the response in flight, with a subscription change or None;
#   ("stale", which, change): a request with an older (or unknown) nonce;
#   ("poll",): the transport asks for the next response (most ops are followed by one anyway)
SUB_NAMES = st.lists(st.sampled_from(STREAM_NAMES), max_size=4).map(tuple)
CHANGE = st.none() | st.tuples(SUB_NAMES, SUB_NAMES)
SET = st.tuples(st.just("set"), st.sampled_from(STREAM_NAMES), st.integers(0, 2))
REMOVE = st.tuples(st.just("remove"), st.sampled_from(STREAM_NAMES))
SUB = st.tuples(st.just("sub"), SUB_NAMES, SUB_NAMES, st.booleans())
ACK = st.tuples(st.just("ack"), CHANGE)
NACK = st.tuples(st.just("nack"), CHANGE)
STALE = st.tuples(st.just("stale"), st.integers(0, 5), CHANGE)
POLL = st.just(("poll",))
OP_KINDS = {
    "set": SET,
    "remove": REMOVE,
    "ready": st.just(("ready",)),
    "sub": SUB,
    "ack": ACK,
    "nack": NACK,
    "stale": STALE,
    "poll": POLL,
}
# repeated kinds weigh the choice: an answer needs a response polled first
WEIGHTED_KINDS = ["set", "set", "remove", "ready", "sub", "sub", "ack", "ack", "nack", "nack", "stale"] + ["poll"] * 4
OPS = st.sampled_from(WEIGHTED_KINDS).flatmap(OP_KINDS.__getitem__)
# and, as the transport does after each request or change, most ops are followed by a poll
OP_LISTS = st.lists(st.tuples(OPS, st.sampled_from([True, True, False])), min_size=10, max_size=60)
# first request: names, and what the client says it has: nothing, the current, stale or unknown versions
FIRST = st.tuples(SUB_NAMES, st.sampled_from(["", "current", "stale", "junk"]))


@dataclass
class Client:
    """What a well-behaved Envoy knows, and what the server must have done by the end."""

    view: View
    kind: str  # "sotw" | "delta"
    subscribed: dict[str, None] = field(default_factory=dict)
    accepted: dict[str, str] = field(default_factory=dict)  # name -> version ACKed (or claimed at start)
    in_flight: Response | DeltaResponse | None = None
    nonces: list[str] = field(default_factory=list)
    answered: int = 0  # responses ACKed or NACKed
    blocked: dict[str, str] = field(default_factory=dict)  # name -> NACKed version, until content changes
    nacked: dict[str, set[str]] = field(default_factory=dict)  # name -> every version NACKed
    # name -> version NACKed as part of a response of several: sent again once, alone
    suspect: dict[str, str] = field(default_factory=dict)

    def answer(self, ok: bool) -> None:
        assert self.in_flight is not None
        bundle = len(self.in_flight.resources) > 1
        for r in self.in_flight.resources:
            if r.name not in self.subscribed:
                event(f"{self.kind}: answered a response with an unsubscribed name")
                continue  # a client ignores what it no longer asks for
            self.suspect.pop(r.name, None)
            if ok:
                self.accepted[r.name] = r.version
            elif bundle:
                self.suspect[r.name] = r.version
            else:
                self.blocked[r.name] = r.version
                self.nacked.setdefault(r.name, set()).add(r.version)
        self.in_flight = None
        self.answered += 1
        event(f"{self.kind}: {'ACK' if ok else 'NACK'}")

    def unsubscribe(self, name: str) -> None:
        self.subscribed.pop(name, None)
        self.accepted.pop(name, None)
        self.blocked.pop(name, None)
        self.nacked.pop(name, None)
        self.suspect.pop(name, None)

    def content_changed(self, name: str, before: str) -> None:
        if self.view.version(name) != before:
            self.blocked.pop(name, None)
            self.suspect.pop(name, None)

    def check_response(self, r: Response | DeltaResponse | None, was_in_flight: bool, following: int) -> None:
        if r is None:
            return
        assert not was_in_flight, "two responses in flight"
        names = [x.name for x in r.resources]
        assert r.resources or not self.nonces, "an empty response after the first"
        assert len(set(names)) == len(names)
        assert set(names) <= set(self.subscribed), (names, list(self.subscribed))
        for x in r.resources:
            assert x.version == self.view.version(x.name)  # current content, never an old one
            assert self.blocked.get(x.name) != x.version, f"NACKed {x.name}@{x.version} sent again"
            if self.suspect.get(x.name) == x.version:
                assert len(r.resources) == 1, "a suspect of a rejected bundle is resent alone"
                self.suspect.pop(x.name)
                event(f"{self.kind}: suspect resent alone")
        version = r.version_info if isinstance(r, Response) else r.system_version_info
        expected = response_version(r.resources, digest=following > 1) if r.resources else ""
        assert version == expected
        assert r.nonce not in self.nonces
        self.nonces.append(r.nonce)
        self.in_flight = r

    def check_converged(self) -> None:
        for name in self.subscribed:
            current = self.view.version(name)
            if current in self.nacked.get(name, ()):
                continue
            assert self.accepted.get(name) == current, (name, self.accepted, current)


def _stale_nonce(client: Client, which: int) -> str:
    old = [n for n in client.nonces if n != (client.nonces[-1] if client.nonces else None)]
    return old[which % len(old)] if old and which < 4 else f"x{which}"


def _claimed(view: View, names: tuple[str, ...], how: str) -> dict[str, str]:
    if how == "current":
        return {n: view.version(n) for n in names}
    if how == "stale":
        return {n: f"{n}=9" for n in names}
    return {}


class Harness:
    """Drives one stream through `ops`, checking every response against the client model `c`."""

    def __init__(self, view: View, stream: SotwStream | DeltaStream, kind: str) -> None:
        self.view, self.s, self.c = view, stream, Client(view, kind)

    def run(self, ops: list[Any]) -> None:
        for op, then_poll in ops:
            note(repr(op))
            if op[0] in ("set", "remove"):
                before = self.view.version(op[1])
                if op[0] == "set":
                    self.view.bodies[op[1]] = f"{op[1]}={op[2]}".encode()
                else:
                    self.view.bodies.pop(op[1], None)
                self.c.content_changed(op[1], before)
                self.s.changed({op[1]})
            elif op[0] == "ready":
                self.ready()
            elif op[0] != "poll":
                self.request(op)
            if then_poll or op[0] == "poll":
                self.poll()
        self.finish()

    def ready(self) -> None:
        if not self.view.ready:
            self.view.ready = True
            self.s.changed(None)  # as the store announces becoming ready

    def poll(self) -> None:
        self.c.check_response(self.s.poll(), self.c.in_flight is not None, len(self.s.subscribed))

    def request(self, op: Any) -> None:
        raise NotImplementedError

    def ack(self, nonce: str) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Envoy keeps ACKing what it gets until nothing is due; then it has every subscribed version."""
        c = self.c
        self.ready()
        for _ in range(2 * len(STREAM_NAMES) + 4):
            if c.in_flight is not None:
                nonce = c.in_flight.nonce
                c.answer(True)
                self.ack(nonce)
            self.poll()
            if c.in_flight is None:
                break
        assert c.in_flight is None, "still sending after every response was ACKed"
        c.check_converged()


class SotwHarness(Harness):
    s: SotwStream

    def __init__(self, view: View, first: tuple[tuple[str, ...], str]) -> None:
        super().__init__(view, CheckedSotwStream(view), "sotw")
        names, how = first
        claimed = _claimed(view, tuple(dict.fromkeys(names)), how)
        version = response_version(Resource(n, v, b"", Group(n)) for n, v in claimed.items())
        version = {"": "", "junk": "junk"}.get(how, version)  # what Envoy says it has, on reconnecting
        self.s.receive(Request(version_info=version, has_node=True, resource_names=names, type_url=EDS_TYPE_URL))
        self.c.subscribed = dict.fromkeys(names)
        self.c.accepted = dict(claimed)
        self.claimed = claimed

    def send(self, names: tuple[str, ...], nonce: str, error: str | None = None) -> None:
        events = self.s.receive(
            Request(
                version_info="v", resource_names=names, response_nonce=nonce, type_url=EDS_TYPE_URL, error_message=error
            )
        )
        assert not any(isinstance(e, StaleNonce) for e in events)
        for gone in [n for n in self.c.subscribed if n not in names]:
            self.c.unsubscribe(gone)
        self.c.subscribed = dict.fromkeys(names)
        assert self.s.subscribed == self.c.subscribed

    def request(self, op: Any) -> None:
        c = self.c
        names = tuple(c.subscribed) if op[-1] is None or op[0] == "sub" else op[-1][0]
        if op[0] == "sub":
            names = op[1]
            # a client that has not yet seen the first response still sends an empty nonce
            empty_ok = c.answered == 0 and len(c.nonces) <= 1
            nonce = "" if (op[3] and empty_ok) or not c.nonces else c.nonces[-1]
            if nonce == "" and c.nonces:
                # written before the first response was seen: stale
                event("sotw: subscription change with an empty nonce, response in flight")
                self.stale(names, "")
                return
            if c.in_flight is not None and nonce == c.in_flight.nonce:
                c.answer(True)  # the latest nonce on a SotW request ACKs
            self.send(names, nonce)
        elif op[0] in ("ack", "nack") and c.in_flight is not None:
            nonce, ok = c.in_flight.nonce, op[0] == "ack"
            c.answer(ok)
            self.send(names, nonce, None if ok else "rejected")
        elif op[0] == "stale":
            self.stale(names, _stale_nonce(c, op[1]))

    def stale(self, names: tuple[str, ...], nonce: str) -> None:
        """A request the server ignores: no response, no subscription change.

        While a response is in flight, this is a client that had not seen it yet: its answer to it
        will carry its current names. It did send these names, though: it no longer asks for the
        others, so it ignores them in that response, and if it asks for them again they are new to it
        (the server must send them again). With nothing in flight, no well-behaved client sends an old
        nonce (nor would it get an answer): a bogus request that changes nothing."""
        before = dict(self.s.subscribed)
        assert self.s.receive(Request(resource_names=names, response_nonce=nonce)) == [StaleNonce(nonce)]
        assert self.s.subscribed == before
        if self.c.in_flight is None:
            return
        for gone in [n for n in self.c.subscribed if n not in names]:
            self.c.unsubscribe(gone)
        self.c.subscribed = dict.fromkeys(names)

    def ack(self, nonce: str) -> None:
        self.send(tuple(self.c.subscribed), nonce)


class DeltaHarness(Harness):
    s: DeltaStream

    def __init__(self, view: View, first: tuple[tuple[str, ...], str]) -> None:
        super().__init__(view, DeltaStream(view), "delta")
        names, how = first
        claimed = _claimed(view, names, how) if how != "junk" else dict.fromkeys(names, "junk")
        self.s.receive(
            DeltaRequest(has_node=True, type_url=EDS_TYPE_URL, subscribe=(*names, "*"), initial_versions=claimed)
        )
        self.c.subscribed = dict.fromkeys(names)
        self.c.accepted = dict(claimed)

    def send(self, nonce: str, change: Any, error: str | None = None) -> list[Any]:
        sub, unsub = change or ((), ())
        events = self.s.receive(
            DeltaRequest(
                type_url=EDS_TYPE_URL, subscribe=sub, unsubscribe=unsub, response_nonce=nonce, error_message=error
            )
        )
        for name in sub:  # subscribes first, then unsubscribes
            self.c.subscribed[name] = None
            self.c.blocked.pop(name, None)  # subscribed again: provided again
            self.c.suspect.pop(name, None)
            self.c.nacked.pop(name, None)
        for name in unsub:
            if name in self.c.subscribed:
                self.c.unsubscribe(name)
        assert self.s.subscribed == self.c.subscribed
        return events

    def request(self, op: Any) -> None:
        c = self.c
        if op[0] == "sub":
            assert not any(isinstance(e, StaleNonce) for e in self.send("", (op[1], op[2])))
        elif op[0] in ("ack", "nack") and c.in_flight is not None:
            nonce, ok = c.in_flight.nonce, op[0] == "ack"
            c.answer(ok)
            self.send(nonce, op[1], None if ok else "rejected")
        elif op[0] == "stale":
            nonce = _stale_nonce(c, op[1])
            if c.in_flight is None or nonce != c.in_flight.nonce:
                assert StaleNonce(nonce) in self.send(nonce, op[2])  # subscriptions still count

    def ack(self, nonce: str) -> None:
        self.send(nonce, None)


STREAM_SETTINGS = examples(200, suppress_health_check=[HealthCheck.too_slow])


@STREAM_SETTINGS
@given(st.booleans(), FIRST, OP_LISTS)
def test_sotw_stream_against_a_client_model(ready: bool, first: Any, ops: list[Any]) -> None:
    SotwHarness(View(ready), first).run(ops)


@STREAM_SETTINGS
@given(st.booleans(), FIRST, OP_LISTS)
def test_delta_stream_against_a_client_model(ready: bool, first: Any, ops: list[Any]) -> None:
    DeltaHarness(View(ready), first).run(ops)


def test_regression_sotw_nack_of_an_unsubscribed_name() -> None:
    """Found by test_sotw_stream_against_a_client_model. The nonce decides whether a request counts:
    one with no nonce after a response is stale: the name stays subscribed. But the client dropped `a` before it saw r1,
    so it ignored `a` there (the NACK is not about `a`), and `a` listed again is new to it: sent again."""
    view = View(True)
    s = SotwStream(view)
    s.receive(Request(has_node=True, resource_names=("a",), type_url=EDS_TYPE_URL))
    r1 = s.poll()
    assert r1 is not None
    assert s.receive(Request(resource_names=())) == [StaleNonce("")]  # written before r1 was seen
    s.receive(Request(resource_names=("a",), response_nonce=r1.nonce, error_message="rejected"))  # and again
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["a"], "subscribed to `a` again, never answered"
    assert not s.nacked


def test_regression_sotw_resume_claim_outlives_resubscribing() -> None:
    """Found by test_sotw_stream_against_a_client_model: added names are to be answered even if unchanged,
    but not while the version_info of the first request is still waiting for the store to be ready."""
    view = View(False)
    view.bodies["a"] = b"a-1"
    s = SotwStream(view)
    s.receive(Request(version_info="a-1", has_node=True, resource_names=("a",), type_url=EDS_TYPE_URL))
    s.receive(Request(resource_names=()))  # no nonce: nothing was sent yet
    s.receive(Request(resource_names=("a",)))
    view.ready = True
    s.changed(None)
    assert s.poll() is not None, "`a` was asked for again, and never answered"


ANY_NAMES = st.lists(st.sampled_from(["a", "b", "*", "", "x" * 11]) | st.text(max_size=12), max_size=7).map(tuple)
ANY_NONCE = st.sampled_from(["", "1", "2", "3"]) | st.text(max_size=4)
CDS_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ANY_TYPE = st.sampled_from(["", EDS_TYPE_URL, CDS_TYPE_URL]) | st.text(max_size=5)
ANY_ERROR = st.none() | st.text(max_size=5)
LIMITS = SubscriptionLimits(max_names=5, max_name_length=10)


@examples(200)
@given(
    st.lists(
        st.builds(Request, st.text(max_size=5), st.booleans(), ANY_NAMES, ANY_TYPE, ANY_NONCE, ANY_ERROR)
        | st.sampled_from(["poll", "change", "all"]),
        max_size=12,
    )
)
def test_sotw_receive_only_raises_protocol_error(steps: list[Any]) -> None:
    drive(CheckedSotwStream(View(True), LIMITS), steps)


def drive(s: SotwStream | DeltaStream, steps: list[Any]) -> None:
    """Polls, store changes and requests in turn, until a request ends the stream."""
    for step in steps:
        if step == "poll":
            s.poll()
        elif step in ("change", "all"):
            s.changed(None if step == "all" else {"a"})
        else:
            try:
                s.receive(step)
            except ProtocolError:
                return  # the stream ends


@examples(200)
@given(
    st.lists(
        st.builds(
            DeltaRequest,
            st.booleans(),
            ANY_TYPE,
            ANY_NAMES,
            ANY_NAMES,
            st.dictionaries(st.text(max_size=11), st.text(max_size=3), max_size=3),
            ANY_NONCE,
            ANY_ERROR,
        )
        | st.sampled_from(["poll", "change", "all"]),
        max_size=12,
    )
)
def test_delta_receive_only_raises_protocol_error(steps: list[Any]) -> None:
    drive(DeltaStream(View(True), LIMITS), steps)


# -- 5. reading requests -----------------------------------------------------------------------------
# The gRPC codec turns ValueError (malformed protobuf, or text that is not UTF-8) into INVALID_ARGUMENT;
# anything else would escape it.
@examples(300)
@given(st.binary(max_size=64), st.integers(0, 70), st.booleans())
def test_read_varint_on_anything(data: bytes, pos: int, view: bool) -> None:
    try:
        value, end = protowire.read_varint(memoryview(data) if view else data, pos)
    except ValueError:
        return
    assert pos < end <= len(data) and 0 <= value < 2**70


@examples(100)
@given(st.integers(0, 2**64 - 1), st.binary(max_size=4))
def test_varint_round_trip(n: int, tail: bytes) -> None:
    encoded = protowire.varint(n)
    assert protowire.read_varint(encoded + tail, 0) == (n, len(encoded))


@examples(300)
@given(st.binary(max_size=64), st.sets(st.integers(0, 20), max_size=4))
def test_fields_and_string_fields_on_anything(data: bytes, wanted: set[int]) -> None:
    try:
        for _, value in protowire.fields(data):
            assert isinstance(value, int) or (isinstance(value, memoryview) and len(value) <= len(data))
    except ValueError:
        pass
    try:
        found = protowire.string_fields(data, wanted)
    except ValueError:
        return
    assert set(found) <= wanted and all(isinstance(v, str) for v in found.values())


WIRE_FIELDS = st.lists(
    st.tuples(st.integers(1, 20), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1), TEXT), max_size=8
)


@examples(200)
@given(WIRE_FIELDS, st.sets(st.integers(1, 20), max_size=4))
def test_string_fields_finds_the_last_of_each_wanted_field(fields_: list[Any], wanted: set[int]) -> None:
    data, expected = b"", {}
    for number, wire_type, n, text in fields_:
        key = protowire.varint(number << 3 | wire_type)
        if wire_type == 0:
            data += key + protowire.varint(n)
        elif wire_type == 1:
            data += key + n.to_bytes(8, "little")
        elif wire_type == 5:
            data += key + (n & 0xFFFFFFFF).to_bytes(4, "little")
        else:
            data += protowire.length_delimited(number, text.encode())
            if number in wanted:
                expected[number] = text
    assert protowire.string_fields(data, wanted) == expected
    assert protowire.string_fields(memoryview(data), wanted) == expected
    ordered = sorted(fields_, key=lambda f: f[0])  # as every serializer writes them
    if wanted and all(number not in wanted or wire_type == 2 for number, wire_type, _, _ in ordered):
        data = b"".join(
            protowire.length_delimited(number, text.encode()) if wire_type == 2 else b""
            for number, wire_type, _, text in ordered
        )
        last = {number: text for number, wire_type, _, text in ordered if wire_type == 2 and number in wanted}
        assert protowire.string_fields(data, wanted, in_order=True) == last


ANY_TEXT = st.text(CHARS, max_size=8)
ERRORS = st.none() | st.tuples(st.integers(0, 16), ANY_TEXT)
NODES = st.builds(base_pb2.Node, id=ANY_TEXT, cluster=ANY_TEXT, user_agent_name=ANY_TEXT)


def _with_node_and_error(draw: st.DrawFn, req: Any) -> Any:
    """What both kinds of request may carry: a Node (only the first must), a NACK's error."""
    if draw(st.booleans()):
        req.node.CopyFrom(draw(NODES))
    error = draw(ERRORS)
    if error is not None:
        req.error_detail.code, req.error_detail.message = error
    return req


@st.composite
def sotw_requests(draw: st.DrawFn) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(
        version_info=draw(ANY_TEXT),
        resource_names=draw(st.lists(ANY_TEXT, max_size=4)),
        type_url=draw(ANY_TYPE),
        response_nonce=draw(ANY_TEXT),
    )
    return _with_node_and_error(draw, req)


@st.composite
def delta_requests(draw: st.DrawFn) -> discovery_pb2.DeltaDiscoveryRequest:
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=draw(ANY_TYPE),
        response_nonce=draw(ANY_TEXT),
        resource_names_subscribe=draw(st.lists(ANY_TEXT, max_size=4)),
        resource_names_unsubscribe=draw(st.lists(ANY_TEXT, max_size=4)),
        initial_resource_versions=draw(st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=3)),
    )
    return _with_node_and_error(draw, req)


def _check_common(req: Any, decoded: Any, node: memoryview | None) -> None:
    assert decoded.type_url == req.type_url and decoded.response_nonce == req.response_nonce
    assert decoded.error_message == (req.error_detail.message if req.HasField("error_detail") else None)
    raw_node = req.node.SerializeToString() if req.HasField("node") else b""
    assert (bytes(node) if node is not None else b"") == raw_node and decoded.has_node == req.HasField("node")
    if node is not None:
        found = protowire.string_fields(node, {1, 2})
        assert (found.get(1, ""), found.get(2, "")) == (req.node.id, req.node.cluster)


@examples(150)
@given(sotw_requests(), delta_requests())
def test_request_decoders_read_what_envoy_writes(sotw: Any, delta: Any) -> None:
    decoded, node = wire.sotw_request(sotw.SerializeToString())
    _check_common(sotw, decoded, node)
    assert (decoded.version_info, list(decoded.resource_names)) == (sotw.version_info, list(sotw.resource_names))
    decoded_delta, node = wire.delta_request(delta.SerializeToString())
    _check_common(delta, decoded_delta, node)
    assert list(decoded_delta.subscribe) == list(delta.resource_names_subscribe)
    assert list(decoded_delta.unsubscribe) == list(delta.resource_names_unsubscribe)
    assert dict(decoded_delta.initial_versions) == dict(delta.initial_resource_versions)


def _decode_or_value_error(data: bytes) -> None:
    for decode in (wire.sotw_request, wire.delta_request):
        with contextlib.suppress(ValueError):
            decode(data)


@examples(300)
@given(st.binary(max_size=80))
def test_request_decoders_raise_only_value_error_on_anything(data: bytes) -> None:
    _decode_or_value_error(data)


@examples(300)
@given(sotw_requests() | delta_requests(), st.data())
def test_request_decoders_raise_only_value_error_on_damaged_requests(req: Any, data: st.DataObject) -> None:
    """Near misses reach further than random bytes: real requests, cut short or with bytes changed."""
    raw = bytearray(req.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        action = pick(data.draw, ["set", "cut", "insert"])
        if action == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=3))
    _decode_or_value_error(bytes(raw))
