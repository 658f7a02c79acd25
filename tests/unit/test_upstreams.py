"""The upstreams file: the documented shape, and every kind of bad input named by line and field."""

from __future__ import annotations

import textwrap

import pytest

from eds_server import upstreams
from eds_server.model import Endpoint, Health, Locality

DOCUMENTED = """\
groups:
  web:                       # = the Envoy cluster name, or its eds_cluster_config.service_name
    endpoints:
      - 10.0.0.5:8080        # shorthand host:port ([v6]:port for IPv6)
      - address: 10.0.0.6
        port: 8080
        weight: 3            # load_balancing_weight, >= 1
        health: draining     # healthy | unhealthy | draining | timeout | degraded | unknown
        region: eu-west-1    # locality: region, zone, subzone
        zone: eu-west-1a
        priority: 0
        hostname: web-2
        metadata: {version: v2}   # filter_metadata["envoy.lb"], for Envoy's subset load balancing
    localities:              # optional: per-locality load_balancing_weight (locality-weighted LB)
      - {region: eu-west-1, zone: eu-west-1a, weight: 2}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(upstreams.UpstreamsError) as e:
        upstreams.parse(textwrap.dedent(text), "upstreams.yaml")
    return [str(p) for p in e.value.problems]


def test_documented_shape() -> None:
    groups = upstreams.parse(DOCUMENTED)
    web = groups["web"]
    assert web.endpoints[0] == Endpoint("10.0.0.5", 8080)
    assert web.endpoints[1] == Endpoint(
        "10.0.0.6", 8080, weight=3, health=Health.DRAINING, priority=0,
        locality=Locality("eu-west-1", "eu-west-1a"), hostname="web-2", metadata={"version": "v2"},
    )  # fmt: skip
    assert web.locality_weights == {Locality("eu-west-1", "eu-west-1a"): 2}


def test_ipv6_and_empty_groups() -> None:
    groups = upstreams.parse(
        "groups:\n  a:\n    endpoints: ['[2001:DB8::1]:80', {address: '::1', port: 81}]\n"
        "  b:\n  c: {endpoints: []}\n"
    )
    assert [e.key for e in groups["a"].endpoints] == [("2001:db8::1", 80), ("::1", 81)]
    assert groups["b"].endpoints == groups["c"].endpoints == ()
    assert upstreams.parse("groups: {}") == upstreams.parse("groups:") == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("groups:\n  web:\n    endpoints:\n      - 10.0.0.1:99999\n",
         "upstreams.yaml:4: groups.web.endpoints[0]: '99999' is not a port (1-65535)"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 1}\n"
         "      - address: 10.0.0.2\n        port: 99999\n",
         "upstreams.yaml:6: groups.web.endpoints[1].port: 99999 is not a port (1-65535)"),
        ("groups:\n  web:\n    endpoints:\n      - backend.local:80\n",
         "upstreams.yaml:4: groups.web.endpoints[0]: 'backend.local' is not an IP address"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, weight: 0}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].weight: 0 is not a weight"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, health: ok}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].health: 'ok' is not a health status"),
        ("groups:\n  web:\n    endpoints:\n      - 10.0.0.1:80\n      - {address: 10.0.0.1, port: 80}\n",
         "upstreams.yaml:5: groups.web.endpoints[1]: duplicate endpoint 10.0.0.1:80"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, wieght: 2}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].wieght: unknown key"),
        ("groups:\n  web:\n    endpionts: []\n",
         "upstreams.yaml:3: groups.web.endpionts: unknown key"),
        ("grups: {}\n", "upstreams.yaml:1: grups: unknown key"),
        ("groups:\n  web: {}\n  web: {}\n", "upstreams.yaml:3: groups.web: duplicate key"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].port: missing"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, priority: 129}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].priority: 129 is not a priority (0-128)"),
        ("groups:\n  web:\n    endpoints: [10.0.0.1:80]\n    localities: [{region: r}]\n",
         "upstreams.yaml:4: groups.web.localities[0].weight: missing"),
        ("groups:\n  web:\n    endpoints: 10.0.0.1:80\n",
         "upstreams.yaml:3: groups.web.endpoints: must be a list"),
        ("groups:\n  web:\n    endpoints: [10.0.0.1:80\n",
         "upstreams.yaml:4: not valid YAML"),
        ("", "upstreams.yaml:1: file is empty"),
        ("groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, metadata: [1]}\n",
         "upstreams.yaml:4: groups.web.endpoints[0].metadata: must be a mapping"),
    ],
)
def test_each_problem_names_file_line_and_field(text: str, expected: str) -> None:
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems(
        "groups:\n  a:\n    endpoints: [example.com:80]\n  b:\n    endpoints: ['10.0.0.1:0']\n"
    )
    assert [p.split(":")[1] for p in found] == ["3", "5"]


def test_weight_sum_over_uint32_is_refused() -> None:
    big = 2**32 - 1
    found = problems(
        f"groups:\n  web:\n    endpoints:\n      - {{address: 10.0.0.1, port: 1, weight: {big}}}\n"
        f"      - {{address: 10.0.0.2, port: 1, weight: 1}}\n"
    )
    assert "add up to" in found[0]


def test_unreadable_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(upstreams.UpstreamsError, match="cannot read"):
        upstreams.load(str(tmp_path / "missing.yaml"))
