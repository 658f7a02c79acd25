"""Hypothesis strategies shared by the property tests: upstreams files (what was generated, and the
YAML it was rendered as), model endpoints, and the examples budget (EDS_HYPOTHESIS_SCALE multiplies it)."""

from __future__ import annotations

import copy
import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from hypothesis import settings
from hypothesis import strategies as st

from eds_server import fields
from eds_server.model import Endpoint, Group, Health, Locality

SCALE = float(os.environ.get("EDS_HYPOTHESIS_SCALE", "1"))  # below 1 for a quick look (make test-fast)
Draw = Callable[[st.SearchStrategy[Any]], Any]


def examples(n: int, **kwargs: Any) -> settings:
    return settings(max_examples=max(1, round(n * SCALE)), deadline=None, database=None, **kwargs)


def pick(draw: Draw, options: Sequence[Any]) -> Any:
    """One of `options` (cheaper than a new sampled_from each time: st.integers is cached)."""
    return options[draw(st.integers(0, len(options) - 1))]


# -- shared strategies ---------------------------------------------------------------------------
# codec="utf-8": no lone surrogates (a known bug of their own, see test_regression_unencodable_*).
# No NEL/LS/PS either: PyYAML's emitter writes them raw into quoted scalars, where its own reader then
# folds them (a PyYAML bug that would fail the round trip before eds_server is involved).
CHARS = st.characters(codec="utf-8", exclude_characters="\x85\u2028\u2029")
TEXT = st.text(CHARS, max_size=10)
NAMES = st.text(CHARS, min_size=1, max_size=20).filter(lambda s: s == s.strip() and s != "<<")
JSON_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
)
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=4
)
# `<<` is YAML's merge key; the parser refuses it even quoted (a top-level metadata key only)
METADATA = st.dictionaries(TEXT.filter(lambda k: k != "<<"), JSON_VALUES, max_size=2)
LOCALITIES = st.builds(Locality, TEXT, TEXT, TEXT)
UINT32_MAX = fields.UINT32_MAX


def ip_text(draw: st.DrawFn, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The address as a person might write it: any textual form that names the same IP."""
    return str(pick(draw, [str(ip), ip.exploded, str(ip).upper(), ip.exploded.upper()]))


@st.composite
def model_endpoints(draw: st.DrawFn) -> Endpoint:
    ip = draw(st.ip_addresses())
    return Endpoint(
        address=str(ip),
        port=draw(st.integers(1, 65535)),
        weight=draw(st.none() | st.integers(1, 2**28)),  # <= 8 of these per locality stay under uint32
        health=draw(st.sampled_from(Health)),
        priority=draw(st.integers(0, 128)),
        locality=draw(LOCALITIES | st.just(Locality())),
        hostname=draw(TEXT),
        metadata=draw(METADATA),
    )


# -- 1. the upstreams file -------------------------------------------------------------------------
@dataclass
class GenEndpoint:
    endpoint: Endpoint
    rendering: Any  # "addr:port" shorthand or a mapping, as written in the file
    address_text: str  # how the address was written (brackets excluded)


@dataclass
class GenGroup:
    name: str
    endpoints: list[GenEndpoint]
    weights: dict[Locality, int]
    localities: list[dict[str, Any]]
    empty_form: Any  # how a group with nothing in it is written

    def expected(self) -> Group:
        return Group(self.name, tuple(e.endpoint for e in self.endpoints), self.weights)

    def render(self) -> Any:
        if not self.endpoints and not self.localities:
            return copy.deepcopy(self.empty_form)
        out: dict[str, Any] = {"endpoints": [e.rendering for e in self.endpoints]}
        if self.localities:
            out["localities"] = self.localities
        return out


def shorthand(address_text: str, port: Any, v6: bool) -> str:
    return f"[{address_text}]:{port}" if v6 else f"{address_text}:{port}"


def _number(draw: st.DrawFn, n: int) -> Any:
    return n  # `port: "80"` (quoted) is refused in the file: a number is written as one


def _text_value(draw: st.DrawFn, s: str) -> Any:
    """Text as written: an int where YAML would read the same digits back (`zone: 1`)."""
    if s.isascii() and s.isdigit() and str(int(s)) == s and draw(st.booleans()):
        return int(s)
    return s


@st.composite
def gen_endpoints(draw: st.DrawFn) -> GenEndpoint:
    ep = draw(model_endpoints())
    ip = ipaddress.ip_address(ep.address)
    text = ip_text(draw, ip)
    v6 = ip.version == 6
    if draw(st.booleans()):
        ep = Endpoint(ep.address, ep.port)
        return GenEndpoint(ep, shorthand(text, ep.port, v6), text)
    explicit = draw(st.booleans())  # write defaults out
    spec: dict[str, Any] = {
        "address": f"[{text}]" if v6 and draw(st.booleans()) else text,
        "port": _number(draw, ep.port),
    }
    if ep.weight is not None:
        spec["weight"] = _number(draw, ep.weight)
    if ep.health != Health.UNKNOWN or explicit:
        spec["health"] = pick(draw, [str.lower, str.upper, str.capitalize])(ep.health.name)
    if ep.priority or explicit:
        spec["priority"] = _number(draw, ep.priority)
    for key, value in [
        ("region", ep.locality.region),
        ("zone", ep.locality.zone),
        ("subzone", ep.locality.subzone),
        ("hostname", ep.hostname),
    ]:
        if value or explicit:
            spec[key] = _text_value(draw, value)
    if ep.metadata or explicit:
        spec["metadata"] = ep.metadata
    return GenEndpoint(ep, spec, text)


@st.composite
def gen_groups(draw: st.DrawFn, name: str, min_endpoints: int = 0) -> GenGroup:
    eps = draw(st.lists(gen_endpoints(), min_size=min_endpoints, max_size=4, unique_by=lambda g: g.endpoint.key))
    weights = draw(st.dictionaries(LOCALITIES, st.integers(1, UINT32_MAX), max_size=3))
    localities = []
    for loc, w in weights.items():
        item: dict[str, Any] = {
            k: v
            for k, v in [("region", loc.region), ("zone", loc.zone), ("subzone", loc.subzone)]
            if v or draw(st.booleans())
        }
        item["weight"] = _number(draw, w)
        localities.append(item)
    empty = pick(draw, [{}, {"endpoints": []}, {"localities": []}])  # `web:` and `endpoints:` (null) are refused
    return GenGroup(name, eps, weights, localities, empty)


@st.composite
def gen_files(draw: st.DrawFn, min_groups: int = 0, min_endpoints: int = 0) -> list[GenGroup]:
    names = draw(st.lists(NAMES, min_size=min_groups, max_size=3, unique=True))
    return [draw(gen_groups(n, min_endpoints)) for n in names]


def render(draw: Draw, groups: list[GenGroup], rendered: dict[str, Any] | None = None) -> str:
    body = rendered if rendered is not None else {g.name: g.render() for g in groups}
    doc = {"groups": body if body else pick(draw, [None, {}])}
    return yaml.safe_dump(
        doc,
        sort_keys=False,
        width=4096,
        allow_unicode=draw(st.booleans()),
        default_flow_style=pick(draw, [False, None, True]),
    )
