"""Swarm discovery's rules, from recorded JSON (no engine); the real single-node Swarm is in
e2e/docker/test_swarm.py.

tests/data/swarm/ holds `GET /services`, `/tasks` and `/nodes` recorded from a single-node Swarm on a
private engine: service `web` (host network, 2 replicas on one port, so one fails), `ov` (overlay
network `appnet`, 2 replicas) and `pub` (overlay, port 8080 published in mode host). Overlay addresses
appear only in that data.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Health
from eds_server.sources.containers import DockerOptions
from eds_server.sources.swarm import (
    SwarmSource,
    groups_of,
    service_endpoints,
    service_labels,
    task_health,
    task_transitional,
)
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.paths import DATA
from tests.support.waiting import wait_for

DATA = DATA / "swarm"
OPTS = DockerOptions()


def _load(name: str) -> list[dict[str, Any]]:
    return list(json.loads((DATA / f"{name}.json").read_text()))


SERVICES = {s["Spec"]["Name"]: s for s in _load("services")}
TASKS = _load("tasks")
NODES = {n["ID"]: n for n in _load("nodes")}
NODE = next(iter(NODES))


def tasks_of(name: str) -> list[dict[str, Any]]:
    return [copy.deepcopy(t) for t in TASKS if t["ServiceID"] == SERVICES[name]["ID"]]


def eps(
    name: str,
    tasks: list[dict[str, Any]] | None = None,
    options: DockerOptions = OPTS,
    local: str | None = NODE,
    service: dict[str, Any] | None = None,
) -> dict[str, list[Endpoint]]:
    s = service_endpoints(service or SERVICES[name], tasks_of(name) if tasks is None else tasks, options, NODES, local)
    assert s.warning is None, s.warning
    return s.endpoints


# -- recorded JSON ----------------------------------------------------------------------------------


def test_overlay_task_addresses_strip_prefix_and_ignore_vip() -> None:
    got = eps("ov")["ov"]
    assert sorted((e.address, e.port) for e in got) == [("10.0.1.3", 8080), ("10.0.1.4", 8080)]
    vip = SERVICES["ov"]["Endpoint"]["VirtualIPs"][0]["Addr"].split("/")[0]
    assert vip not in {e.address for e in got}
    assert {e.hostname for e in got} == {"ov.1", "ov.2"}
    assert all(e.health == Health.HEALTHY for e in got)


def test_network_choice() -> None:
    svc = copy.deepcopy(SERVICES["ov"])
    tasks = tasks_of("ov")
    # a second attachment: now the network must be named
    for t in tasks:
        extra = copy.deepcopy(t["NetworksAttachments"][0])
        extra["Network"]["Spec"]["Name"] = "shop_backend"
        extra["Addresses"] = ["10.0.9." + str(t["Slot"] + 10) + "/24"]
        t["NetworksAttachments"].append(extra)
    s = service_endpoints(svc, tasks, OPTS, NODES, NODE)
    assert s.endpoints == {} and s.warning and "several networks" in s.warning and "eds.network" in s.warning
    by_option = eps("ov", tasks, DockerOptions(network="backend"))  # stack prefix accepted
    assert sorted(e.address for e in by_option["ov"]) == ["10.0.9.11", "10.0.9.12"]
    svc["Spec"]["Labels"]["eds.network"] = "appnet"  # the label wins over --docker-network
    by_label = eps("ov", tasks, DockerOptions(network="backend"), service=svc)
    assert sorted(e.address for e in by_label["ov"]) == ["10.0.1.3", "10.0.1.4"]
    svc["Spec"]["Labels"]["eds.network"] = "nope"
    s = service_endpoints(svc, tasks, OPTS, NODES, NODE)
    assert s.warning and "no address on network 'nope'" in s.warning


def test_ingress_attachment_is_never_used() -> None:
    tasks = tasks_of("ov")
    for t in tasks:
        ingress = copy.deepcopy(t["NetworksAttachments"][0])
        ingress["Network"]["Spec"].update(Name="ingress", Ingress=True)
        ingress["Addresses"] = ["10.0.0.7/24"]
        t["NetworksAttachments"].insert(0, ingress)
    assert sorted(e.address for e in eps("ov", tasks)["ov"]) == ["10.0.1.3", "10.0.1.4"]


def test_host_mode_published_port_uses_node_address() -> None:
    local = eps("pub")["pub"]
    published = SERVICES["pub"]["Endpoint"]["Ports"][0]["PublishedPort"]
    assert [(e.address, e.port) for e in local] == [("127.0.0.1", published)]
    assert [(e.address, e.port) for e in eps("pub", options=DockerOptions(host_address="192.0.2.1"))["pub"]] == [
        ("192.0.2.1", published)
    ]
    # another node: its Status.Addr
    nodes = copy.deepcopy(NODES)
    nodes[NODE]["Status"]["Addr"] = "198.51.100.7"
    s = service_endpoints(SERVICES["pub"], tasks_of("pub"), OPTS, nodes, local_node="someone-else")
    assert [(e.address, e.port) for e in s.endpoints["pub"]] == [("198.51.100.7", published)]
    nodes[NODE]["Status"]["Addr"] = "0.0.0.0"
    s = service_endpoints(SERVICES["pub"], tasks_of("pub"), OPTS, nodes, local_node="someone-else")
    assert s.warning and "no known address" in s.warning


def test_published_mode_needs_host_publishing() -> None:
    s = service_endpoints(SERVICES["ov"], tasks_of("ov"), DockerOptions(address_mode="published"), NODES, NODE)
    assert s.warning and "not published in mode host" in s.warning


def test_host_network_service_only_running_tasks() -> None:
    got = eps("web")["web"]  # one task running; a failed and a "ready" one are left out
    port = int(SERVICES["web"]["Spec"]["Labels"]["eds.port"])
    assert [(e.address, e.port, e.hostname) for e in got] == [("127.0.0.1", port, "web.1")]
    assert got[0].weight == 3  # eds.weight from the task template's container labels


def test_labels_service_wins_over_container_labels() -> None:
    svc = copy.deepcopy(SERVICES["web"])
    svc["Spec"]["TaskTemplate"]["ContainerSpec"]["Labels"] = {"eds.weight": "3", "eds.zone": "z1", "eds.port": "1"}
    labels = service_labels(svc)
    assert labels["eds.port"] == svc["Spec"]["Labels"]["eds.port"] and labels["eds.zone"] == "z1"
    # container labels alone opt a service in
    only_container = copy.deepcopy(svc)
    only_container["Spec"]["Labels"] = {}
    only_container["Spec"]["TaskTemplate"]["ContainerSpec"]["Labels"] = {"eds.group": "c", "eds.port": "81"}
    assert [e.port for e in eps("web", service=only_container)["c"]] == [81]
    # not opted in: nothing, no warning
    plain = copy.deepcopy(only_container)
    plain["Spec"]["TaskTemplate"]["ContainerSpec"]["Labels"] = {}
    assert service_endpoints(plain, tasks_of("web"), OPTS, NODES, NODE).endpoints == {}


def test_bad_label_skips_the_service_with_a_warning() -> None:
    svc = copy.deepcopy(SERVICES["ov"])
    svc["Spec"]["Labels"]["eds.weight"] = "heavy"
    s = service_endpoints(svc, tasks_of("ov"), OPTS, NODES, NODE)
    assert s.endpoints == {} and s.warning and "label eds.weight" in s.warning and "service ov" in s.warning
    svc = copy.deepcopy(SERVICES["ov"])
    del svc["Spec"]["Labels"]["eds.port"]
    s = service_endpoints(svc, tasks_of("ov"), OPTS, NODES, NODE)
    assert s.warning and "no eds.port label" in s.warning


def test_per_group_settings_and_multiple_groups() -> None:
    svc = copy.deepcopy(SERVICES["ov"])
    svc["Spec"]["Labels"].update({"eds.group": "a,b", "eds.b.port": "9090", "eds.b.metadata.v": "2"})
    got = eps("ov", service=svc)
    assert {e.port for e in got["a"]} == {8080} and {e.port for e in got["b"]} == {9090}
    assert all(e.metadata == {"v": "2"} for e in got["b"])


def test_health_and_draining() -> None:
    task = tasks_of("ov")[0]
    assert task_health(task) == Health.HEALTHY and not task_transitional(task)
    task["DesiredState"] = "shutdown"  # scaled down / updated / node drained, still running
    assert task_health(task) == Health.DRAINING and task_transitional(task)
    task["Status"]["State"] = "shutdown"
    assert task_health(task) is None and not task_transitional(task)
    task = tasks_of("ov")[0]
    task["Status"]["State"] = "starting"  # swarm holds a task here until its health check passes
    assert task_health(task) is None and task_transitional(task)
    task = tasks_of("ov")[0]
    for status, health in (("healthy", Health.HEALTHY), ("unhealthy", Health.UNHEALTHY), ("starting", None)):
        task["Status"]["ContainerStatus"]["Health"] = {"Status": status}
        assert task_health(task) == health
    draining = tasks_of("ov")
    draining[0]["DesiredState"] = "shutdown"
    healths = sorted((e.hostname, e.health) for e in eps("ov", draining)["ov"])
    assert healths == [("ov.1", Health.DRAINING), ("ov.2", Health.HEALTHY)]


def test_tasks_on_a_down_node_are_left_out() -> None:
    nodes = copy.deepcopy(NODES)
    nodes[NODE]["Status"]["State"] = "down"
    assert service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, nodes, NODE).endpoints == {}


@pytest.mark.parametrize("state", ["unknown", "disconnected"])
def test_tasks_on_a_node_in_transition_are_kept(state: str) -> None:
    """A restarted manager lists workers as unknown until they re-register; their tasks run on."""
    nodes = copy.deepcopy(NODES)
    nodes[NODE]["Status"]["State"] = state
    assert (
        service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, nodes, NODE).endpoints
        == service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, NODES, NODE).endpoints
        != {}
    )


def test_groups_merge_services() -> None:
    svc = copy.deepcopy(SERVICES["pub"])
    svc["Spec"]["Labels"]["eds.group"] = "ov"
    merged = groups_of(
        [
            service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, NODES, NODE),
            service_endpoints(svc, tasks_of("pub"), OPTS, NODES, NODE),
        ]
    )
    assert set(merged) == {"ov"} and len(merged["ov"].endpoints) == 3


async def test_unreachable_manager_stays_pending() -> None:
    if True:
        store = Store(encode_group)
        src = alone(SwarmSource, store, OPTS, host="unix:///nonexistent/docker.sock")
        stop = asyncio.Event()
        task = asyncio.create_task(src.run(stop))
        await wait_for(lambda: src.last_error, timeout=5, what="the failed connection said")
        assert not store.ready and store.pending_sources == ("swarm",)  # nothing before a full listing
        assert src.last_error and not src.connected
        stop.set()
        await asyncio.wait_for(task, 10)
