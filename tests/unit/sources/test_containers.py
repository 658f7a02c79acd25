"""Container -> endpoint rules from inspect JSON: labels, address selection, health."""

from __future__ import annotations

from typing import Any

import pytest

from eds_server.health.spec import HealthSpec
from eds_server.model import Endpoint, Health, Locality
from eds_server.sources.containers import DockerOptions, container_endpoints, groups_of

OPTS = DockerOptions()


def inspect(
    labels: dict[str, str],
    *,
    name: str = "c1",
    networks: dict[str, str] | None = None,
    mode: str = "bridge",
    exposed: tuple[str, ...] = (),
    ports: dict[str, list[dict[str, str]]] | None = None,
    status: str = "running",
    health: str | None = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"Status": status, "Running": status == "running", "Paused": status == "paused"}
    if health:
        state["Health"] = {"Status": health}
    return {
        "Id": "0123456789abcdef",
        "Name": "/" + name,
        "State": state,
        "Config": {"Labels": labels, "ExposedPorts": {p: {} for p in exposed}},
        "HostConfig": {"NetworkMode": mode},
        "NetworkSettings": {
            "Networks": {n: {"IPAddress": ip} for n, ip in (networks or {}).items()},
            "Ports": ports or {},
        },
    }


def eps(data: dict[str, Any], options: DockerOptions = OPTS, draining: bool = False) -> dict[str, Endpoint]:
    c = container_endpoints(data, options, draining=draining)
    assert c.warning is None, c.warning
    return c.endpoints


def warning(data: dict[str, Any], options: DockerOptions = OPTS) -> str:
    c = container_endpoints(data, options)
    assert c.warning is not None and c.endpoints == {}
    return c.warning


def test_user_network_ip_and_only_exposed_port() -> None:
    got = eps(inspect({"eds.group": "web"}, networks={"shop_default": "172.20.0.5"}, exposed=("8080/tcp",)))
    assert got == {"web": Endpoint("172.20.0.5", 8080, health=Health.HEALTHY, hostname="c1")}


def test_all_settings_from_labels() -> None:
    labels = {
        "eds.group": "web",
        "eds.port": "81",
        "eds.weight": "3",
        "eds.priority": "1",
        "eds.region": "eu",
        "eds.zone": "eu-1a",
        "eds.subzone": "r1",
        "eds.hostname": "w",
        "eds.metadata.version": "v2",
    }
    got = eps(inspect(labels, networks={"n": "10.1.0.2"}))["web"]
    assert got == Endpoint(
        "10.1.0.2",
        81,
        weight=3,
        health=Health.HEALTHY,
        priority=1,
        locality=Locality("eu", "eu-1a", "r1"),
        hostname="w",
        metadata={"version": "v2"},
    )


def test_two_groups_two_ports() -> None:
    labels = {"eds.group": "web, admin", "eds.port": "80", "eds.admin.port": "9090", "eds.admin.weight": "2"}
    got = eps(inspect(labels, networks={"n": "10.1.0.2"}))
    assert (got["web"].port, got["web"].weight) == (80, None)
    assert (got["admin"].port, got["admin"].weight) == (9090, 2)


def test_dotted_group_names() -> None:
    got = eps(inspect({"eds.group": "api.v2", "eds.api.v2.port": "7000"}, networks={"n": "10.1.0.2"}))
    assert got["api.v2"].port == 7000


def test_host_network_uses_host_address() -> None:
    data = inspect({"eds.group": "web", "eds.port": "18555"}, mode="host", networks={"host": ""})
    assert eps(data)["web"].key == ("127.0.0.1", 18555)
    assert eps(data, DockerOptions(host_address="10.9.9.9"))["web"].key == ("10.9.9.9", 18555)


def test_several_networks_need_a_choice() -> None:
    data = inspect({"eds.group": "web", "eds.port": "80"}, networks={"a_front": "10.1.0.2", "a_back": "10.2.0.2"})
    assert "several networks (a_back, a_front): set eds.network" in warning(data)
    data["Config"]["Labels"]["eds.network"] = "back"  # compose's project prefix is optional
    assert eps(data)["web"].address == "10.2.0.2"
    assert (
        eps(
            inspect({"eds.group": "web", "eds.port": "80"}, networks={"a_front": "10.1.0.2", "a_back": "10.2.0.2"}),
            DockerOptions(network="a_front"),
        )["web"].address
        == "10.1.0.2"
    )
    data["Config"]["Labels"]["eds.network"] = "nope"
    assert "no address on network 'nope'" in warning(data)


def test_address_override() -> None:
    data = inspect({"eds.group": "web", "eds.port": "80", "eds.address": "192.0.2.7"}, networks={})
    assert eps(data)["web"].key == ("192.0.2.7", 80)


def test_published_mode() -> None:
    opts = DockerOptions(address_mode="published", host_address="198.51.100.1")
    ports = {
        "8080/tcp": [{"HostIp": "0.0.0.0", "HostPort": "32768"}, {"HostIp": "::", "HostPort": "32768"}],
        "9090/tcp": [{"HostIp": "127.0.0.1", "HostPort": "19090"}],
        "7070/tcp": None,
    }
    base = {"eds.group": "web"}
    assert eps(inspect({**base, "eds.port": "8080"}, ports=ports), opts)["web"].key == ("198.51.100.1", 32768)
    assert eps(inspect({**base, "eds.port": "9090"}, ports=ports), opts)["web"].key == ("127.0.0.1", 19090)
    assert "7070/tcp is not published" in warning(inspect({**base, "eds.port": "7070"}, ports=ports), opts)


@pytest.mark.parametrize(
    ("labels", "exposed", "expected"),
    [
        ({"eds.group": "web"}, (), "no eds.port label and no exposed TCP port"),
        ({"eds.group": "web"}, ("80/tcp", "443/tcp"), "exposes several ports (80, 443): set eds.port"),
        ({"eds.group": "web", "eds.port": "http"}, (), "label eds.port: 'http' is not a port"),
        ({"eds.group": "web", "eds.weight": "0"}, ("80/tcp",), "label eds.weight: '0' is not a weight"),
        ({"eds.group": "web", "eds.address": "db.local"}, ("80/tcp",), "label eds.address: 'db.local'"),
        ({"eds.group": "web", "eds.wieght": "2"}, ("80/tcp",), "unknown label eds.wieght"),
        ({"eds.group": "web", "eds.other.port": "2"}, ("80/tcp",), "unknown label eds.other.port"),
        ({"eds.group": " , "}, ("80/tcp",), "label eds.group is empty"),
    ],
)
def test_bad_labels_skip_the_container_with_a_named_warning(
    labels: dict[str, str], exposed: tuple[str, ...], expected: str
) -> None:
    w = warning(inspect(labels, name="shop-web-1", networks={"n": "10.1.0.2"}, exposed=exposed))
    assert w.startswith("container shop-web-1: ") and expected in w and w.endswith("skipped")


@pytest.mark.parametrize(
    ("status", "health", "draining", "expected"),
    [
        ("running", None, False, Health.HEALTHY),
        ("running", "healthy", False, Health.HEALTHY),
        ("running", "unhealthy", False, Health.UNHEALTHY),
        ("running", "starting", False, None),
        ("running", None, True, Health.DRAINING),
        ("paused", None, False, Health.UNHEALTHY),
        ("exited", None, False, None),
        ("restarting", None, False, None),
    ],
)
def test_health(status: str, health: str | None, draining: bool, expected: Health | None) -> None:
    data = inspect({"eds.group": "web", "eds.port": "80"}, networks={"n": "10.1.0.2"}, status=status, health=health)
    got = eps(data, draining=draining)
    assert (got["web"].health if got else None) == expected


def test_unlabelled_and_other_prefix() -> None:
    data = inspect({"app.group": "web", "app.port": "80"}, networks={"n": "10.1.0.2"})
    assert eps(data) == {}
    assert eps(data, DockerOptions(label_prefix="app"))["web"].port == 80


def test_groups_merge_and_dedupe() -> None:
    a = container_endpoints(inspect({"eds.group": "web", "eds.port": "80"}, networks={"n": "10.0.0.1"}), OPTS)
    b = container_endpoints(inspect({"eds.group": "web,api", "eds.port": "80"}, networks={"n": "10.0.0.2"}), OPTS)
    groups = groups_of([a, b, a])
    assert sorted(groups) == ["api", "web"]
    assert [e.address for e in groups["web"].endpoints] == ["10.0.0.1", "10.0.0.2"]


def test_health_check_labels_apply_to_every_group() -> None:
    labels = {
        "eds.group": "web,api",
        "eds.port": "80",
        "eds.health.http": "/health",
        "eds.health.interval": "1s",
        "eds.health.unhealthy_threshold": "2",
    }
    got = eps(inspect(labels, networks={"n": "172.20.0.5"}))
    want = HealthSpec("http", path="/health", interval=1.0, timeout=1.0, unhealthy_threshold=2)
    assert got["web"].check == got["api"].check == want


@pytest.mark.parametrize(
    ("labels", "says"),
    [
        ({"eds.health.htp": "/health"}, "label eds.health.htp: unknown key (expected one of: http, tcp"),
        ({"eds.health.http": "health"}, "label eds.health.http: 'health' is not a request path"),
        ({"eds.health.tcp": "true", "eds.health.unhealthy_threshold": "0"}, "label eds.health.unhealthy_threshold: 0"),
        ({"eds.health.interval": "1s"}, "label eds.health.http: exactly one kind"),
    ],
)
def test_bad_health_labels_skip_the_container_naming_the_label(labels: dict[str, str], says: str) -> None:
    got = warning(inspect({"eds.group": "web", "eds.port": "80", **labels}, networks={"n": "172.20.0.5"}))
    assert got.startswith(f"container c1: {says}"), got


def test_sidecar_labels_understood_or_pointed_to_ours() -> None:
    base = {"eds.group": "web", "eds.port": "80"}
    sidecar = {"HealthCheck": "HttpGet", "HealthCheckArgs": "http://{{ host }}:{{ tcp 10080 }}/status/health"}
    got = eps(inspect({**base, **sidecar}, networks={"n": "172.20.0.5"}))
    assert got["web"].check == HealthSpec("http", path="/status/health")
    c = container_endpoints(inspect({**base, "HealthCheck": "External"}, networks={"n": "172.20.0.5"}), OPTS)
    assert c.endpoints["web"].check is None and c.warning is not None
    assert "HealthCheck=External is not run by eds-server: write eds.health.http=/PATH" in c.warning
    ours = eps(inspect({**base, **sidecar, "eds.health.tcp": "true"}, networks={"n": "172.20.0.5"}))
    assert ours["web"].check == HealthSpec("tcp")  # ours win


def test_per_group_health_labels() -> None:
    labels = {
        "eds.group": "web,admin",
        "eds.port": "80",
        "eds.health.http": "/health",
        "eds.health.interval": "2s",
        "eds.admin.health.tcp": "true",
        "eds.web.health.unhealthy_threshold": "5",
    }
    got = eps(inspect(labels, networks={"n": "172.20.0.5"}))
    assert got["web"].check == HealthSpec("http", path="/health", interval=2.0, unhealthy_threshold=5)
    assert got["admin"].check == HealthSpec("tcp", interval=2.0)  # its own kind replaces the common one
    bad = warning(inspect({**labels, "eds.web.health.interval": "x"}, networks={"n": "172.20.0.5"}))
    assert bad.startswith("container c1: label eds.web.health.interval: 'x' is not a duration"), bad
