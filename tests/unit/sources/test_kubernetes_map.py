"""Services + EndpointSlices -> endpoints, from API JSON (recorded shapes, no API server)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from eds_server.health.spec import HealthSpec
from eds_server.model import Health, Locality
from eds_server.sources.kubernetes_map import (
    ClusterView,
    groups_of,
    health_of,
    opted_in,
    service_endpoints,
    slice_service,
    trim_service,
    trim_slice,
)
from tests.support.paths import DATA

DATA = DATA / "kubernetes"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


def service(**annotations: str) -> dict[str, Any]:
    svc = load("service")
    svc["metadata"]["annotations"] = annotations
    return svc


def by_address(svc: dict[str, Any], *slices: dict[str, Any], group: str = "web") -> dict[str, Any]:
    out = service_endpoints(svc, slices, "eds")
    return {ep.address: ep for g, ep in out.pairs if g == group}


@pytest.mark.parametrize(
    ("conditions", "health"),
    [
        ({"ready": True, "serving": True, "terminating": False}, Health.HEALTHY),
        ({}, Health.HEALTHY),  # nil ready/serving mean true, nil terminating false (API docs)
        ({"ready": False, "serving": True, "terminating": True}, Health.DRAINING),
        ({"terminating": True}, Health.DRAINING),  # serving nil: true
        ({"ready": False, "serving": False, "terminating": True}, None),
        ({"ready": False, "serving": False, "terminating": False}, None),
        ({"ready": False, "serving": True, "terminating": False}, None),  # not ready: Kubernetes sends nothing
        ({"ready": True, "serving": False}, Health.HEALTHY),  # publishNotReadyAddresses
    ],
)
def test_conditions(conditions: dict[str, Any], health: Health | None) -> None:
    assert health_of(conditions) == health


def test_recorded_service_and_slices() -> None:
    svc = load("service")
    out = service_endpoints(svc, [load("slice-ipv4"), load("slice-ipv6")], "eds")
    web = {ep.address: ep for g, ep in out.pairs if g == "web"}
    assert set(web) == {"127.0.0.2", "127.0.0.3", "127.0.0.6", "fd00::a"}  # .4 not ready, .5 gone
    ready = web["127.0.0.2"]
    assert (ready.port, ready.health, ready.weight, ready.priority) == (8080, Health.HEALTHY, 5, 0)
    assert ready.locality == Locality(zone="zone-a")
    assert ready.hostname == "web-0"  # the target Pod's name
    assert ready.metadata == {"version": "v2"}
    assert web["127.0.0.3"].health == Health.DRAINING
    assert web["127.0.0.6"].hostname == "web-custom"  # the endpoint's own hostname wins
    assert web["127.0.0.6"].locality == Locality()
    assert web["fd00::a"].port == 8080
    canary = {ep.address: ep for g, ep in out.pairs if g == "web-canary"}
    assert set(canary) == set(web)
    assert {ep.priority for ep in canary.values()} == {1}  # eds.web-canary.priority
    assert out.warnings == {}


def test_port_by_number_and_default() -> None:
    assert by_address(service(**{"eds.group": "web", "eds.port": "9090"}), load("slice-ipv4"))["127.0.0.2"].port == 9090
    assert by_address(service(**{"eds.group": "web", "eds.port": "80"}), load("slice-ipv4"))["127.0.0.2"].port == 8080
    single = service(**{"eds.group": "web"})
    single["spec"]["ports"] = [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]
    assert by_address(single, load("slice-ipv4"))["127.0.0.2"].port == 8080
    unnamed = service(**{"eds.group": "web"})
    unnamed["spec"]["ports"] = [{"protocol": "TCP", "port": 80, "targetPort": 8080}]
    slice_ = load("slice-ipv4")
    slice_["ports"] = [{"name": "", "protocol": "TCP", "port": 8080}]
    assert by_address(unnamed, slice_)["127.0.0.2"].port == 8080


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"eds.group": "web"}, "has several ports (http, metrics): set annotation eds.port"),
        ({"eds.group": "web", "eds.port": "grpc"}, "annotation eds.port: 'grpc' is not one of its ports"),
        ({"eds.group": "web", "eds.port": "http", "eds.weight": "0"}, "annotation eds.weight: '0' is not a weight"),
        ({"eds.group": "web", "eds.port": "http", "eds.priority": "x"}, "annotation eds.priority: 'x'"),
        ({"eds.group": "web", "eds.port": "http", "eds.network": "a"}, "unknown annotation eds.network"),
        ({"eds.group": " , "}, "annotation eds.group is empty"),
    ],
)
def test_invalid_annotations_skip_the_service_with_one_warning(annotations: dict[str, str], message: str) -> None:
    out = service_endpoints(service(**annotations), [load("slice-ipv4")], "eds")
    assert out.pairs == []
    assert list(out.warnings) == ["Service shop/web"]
    warning = out.warnings["Service shop/web"]
    assert warning.startswith("Service shop/web: ") and message in warning and warning.endswith("skipped")


def test_fqdn_slice_skipped_with_a_warning() -> None:
    out = service_endpoints(load("service"), [load("slice-fqdn"), load("slice-ipv4")], "eds")
    assert {ep.address for _, ep in out.pairs} == {"127.0.0.2", "127.0.0.3", "127.0.0.6"}
    assert out.warnings == {
        "EndpointSlice shop/web-external": "EndpointSlice shop/web-external: addressType FQDN is not served "
        "(Envoy needs IP addresses in EDS); skipped"
    }


def test_slice_without_the_port_yet_gives_nothing() -> None:
    slice_ = load("slice-ipv4")
    slice_["ports"] = None  # the controller writes ports: null for a Service whose Pods have none
    assert by_address(load("service"), slice_) == {}


def test_endpoint_in_two_slices_keeps_its_healthiest_form() -> None:
    a, b = load("slice-ipv4"), load("slice-ipv4")
    a["metadata"]["name"] = "web-a"
    a["endpoints"] = [
        {"addresses": ["127.0.0.9"], "conditions": {"ready": False, "serving": True, "terminating": True}}
    ]
    b["metadata"]["name"] = "web-b"
    b["endpoints"] = [{"addresses": ["127.0.0.9"], "conditions": {"ready": True}}]
    assert by_address(load("service"), a, b)["127.0.0.9"].health == Health.HEALTHY


def test_prefix_and_opt_in() -> None:
    svc = service(**{"example.com/eds.group": "api", "example.com/eds.port": "http", "eds.group": "ignored"})
    assert opted_in(svc, "example.com/eds") and opted_in(svc, "eds")
    assert not opted_in(service(), "eds")
    out = service_endpoints(svc, [load("slice-ipv4")], "example.com/eds")
    assert {g for g, _ in out.pairs} == {"api"}


def test_several_services_merge_into_one_group() -> None:
    a = service_endpoints(load("service"), [load("slice-ipv4")], "eds")
    other = load("service")
    other["metadata"]["name"] = "web-eu"
    slice_ = load("slice-ipv4")
    slice_["endpoints"] = [{"addresses": ["127.0.0.20"], "conditions": {"ready": True}}]
    b = service_endpoints(other, [slice_], "eds")
    groups = groups_of([a, b])
    assert {ep.address for ep in groups["web"].endpoints} == {"127.0.0.2", "127.0.0.3", "127.0.0.6", "127.0.0.20"}


def test_trimmed_objects_map_the_same() -> None:
    svc, slices = load("service"), [load("slice-ipv4"), load("slice-ipv6"), load("slice-fqdn")]
    full = service_endpoints(svc, slices, "eds")
    trimmed_svc = trim_service(svc, "eds")
    assert "kubectl.kubernetes.io/last-applied-configuration" not in trimmed_svc["metadata"]["annotations"]
    trimmed = service_endpoints(trimmed_svc, [trim_slice(s) for s in slices], "eds")
    assert trimmed.pairs == full.pairs and trimmed.warnings == full.warnings
    assert [slice_service(trim_slice(s)) for s in slices] == ["shop/web"] * 3


def test_bad_input_never_raises() -> None:
    """Odd but API-valid or truncated objects give warnings or nothing, never an exception."""
    svc = load("service")
    for broken in (
        {},
        {"metadata": None},
        {"endpoints": [{"addresses": []}], "addressType": "IPv4"},
        {
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": ["not-an-ip"], "conditions": {}}],
        },
    ):
        out = service_endpoints(svc, [copy.deepcopy(broken)], "eds")
        assert out.pairs == []
    bad_ip = service_endpoints(svc, [broken], "eds")
    assert any("are not IPs" in w for w in bad_ip.warnings.values())
    assert service_endpoints({}, [], "eds").warnings  # no annotations at all: one warning


def test_recorded_from_kube_apiserver_1_36() -> None:
    """Objects as kube-apiserver v1.36.2 and its EndpointSlice controller wrote them (managedFields and
    all): web-0 ready, web-1 deleted with a grace period (terminating, serving), web-2 not ready."""
    svc = load("recorded-service")
    slices = load("recorded-endpointslices")["items"]
    out = service_endpoints(svc, slices, "eds")
    assert out.warnings == {}
    web = {ep.address: ep for _, ep in out.pairs}
    assert {a: (ep.health, ep.hostname, ep.port, ep.weight) for a, ep in web.items()} == {
        "192.0.2.2": (Health.HEALTHY, "web-0", 8080, 5),
        "192.0.2.3": (Health.DRAINING, "web-1", 8080, 5),
    }
    assert {ep.locality for ep in web.values()} == {Locality(zone="zone-a")}
    assert [slice_service(s) for s in slices] == ["shop/web"]


def test_the_cluster_view_maps_objects_to_groups_without_an_api_server() -> None:
    """The mapper alone: listings and events in, groups and warnings out; only touched Services are mapped again."""
    view = ClusterView("eds")
    view.replace("services", None, [load("service")])
    view.replace("endpointslices", None, [load("slice-ipv4")])
    groups, warnings = view.groups()
    assert sorted(ep.address for ep in groups["web"].endpoints) == ["127.0.0.2", "127.0.0.3", "127.0.0.6"]
    assert warnings == {} and not view.dirty
    assert view.groups()[0] == groups  # nothing touched: the same groups, nothing mapped again
    view.apply("endpointslices", "DELETED", load("slice-ipv4"))
    assert view.dirty == set(view.services)  # the one Service it belonged to
    assert "web" not in view.groups()[0]  # no endpoints left: no group (Envoy is then sent an empty one)
    view.apply("endpointslices", "ADDED", load("slice-ipv4"))
    assert len(view.groups()[0]["web"].endpoints) == 3
    view.replace("services", None, [])  # the Service is gone from a relisting: so is its group
    assert "web" not in view.groups()[0]


def test_health_check_annotations() -> None:
    annotations = {"eds.group": "web", "eds.port": "9090", "eds.health.tcp": "true", "eds.health.interval": "2s"}
    ep = by_address(service(**annotations), load("slice-ipv4"))["127.0.0.2"]
    assert ep.check == HealthSpec("tcp", interval=2.0)
    out = service_endpoints(service(**{**annotations, "eds.health.interval": "soon"}), [load("slice-ipv4")], "eds")
    assert out.pairs == [] and "annotation eds.health.interval: 'soon' is not a duration" in str(out.warnings)
