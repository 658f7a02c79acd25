"""Swarm discovery: rules from recorded JSON, and SwarmSource against a real single-node Swarm.

tests/data/swarm/ holds `GET /services`, `/tasks` and `/nodes` recorded from a single-node Swarm on a
private engine: service `web` (host network, 2 replicas on one port, so one fails), `ov` (overlay
network `appnet`, 2 replicas) and `pub` (overlay, port 8080 published in mode host). Overlay addresses
appear only in that data: the real-engine tests use host networking on 127.0.0.1 ports (and look at
the store only).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
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
from tests.support.docker_engine import (
    DockerEngine,
    _skip_or_fail,
    backend_script,
    swarm_close,
    swarm_init,
    swarm_remove_services,
    unavailable_reason,
)
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.paths import DATA
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess

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
    assert service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, nodes, NODE).endpoints == \
        service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, NODES, NODE).endpoints != {}


def test_groups_merge_services() -> None:
    svc = copy.deepcopy(SERVICES["pub"])
    svc["Spec"]["Labels"]["eds.group"] = "ov"
    merged = groups_of([service_endpoints(SERVICES["ov"], tasks_of("ov"), OPTS, NODES, NODE),
                        service_endpoints(svc, tasks_of("pub"), OPTS, NODES, NODE)])  # fmt: skip
    assert set(merged) == {"ov"} and len(merged["ov"].endpoints) == 3


async def test_unreachable_manager_stays_pending() -> None:
    if True:
        store = Store(encode_group)
        src = SwarmSource(store, OPTS, host="unix:///nonexistent/docker.sock")
        stop = asyncio.Event()
        task = asyncio.create_task(src.run(stop))
        await asyncio.sleep(0.5)
        assert not store.ready and store.pending_sources == ("swarm",)  # nothing before a full listing
        assert src.last_error and not src.connected
        stop.set()
        await asyncio.wait_for(task, 10)


# -- a real single-node Swarm -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def swarm_engine() -> Iterator[DockerEngine]:
    """A private engine (no --live-restore: Swarm refuses it) in swarm mode, advertising 127.0.0.1."""
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)
    engine = DockerEngine(live_restore=False)
    try:
        engine.start()
        swarm_init(engine)
    except Exception as exc:
        engine.close()
        _skip_or_fail(f"single-node swarm did not start: {exc}")
    try:
        yield engine
    finally:
        with contextlib.suppress(Exception):
            swarm_remove_services(engine)
        swarm_close(engine)


@pytest.fixture
def swarm(swarm_engine: DockerEngine) -> Iterator[DockerEngine]:
    if not swarm_engine.running:
        swarm_engine.start()
    yield swarm_engine
    if not swarm_engine.running:
        swarm_engine.start()
    swarm_remove_services(swarm_engine)
    node = swarm_engine.cli("node", "ls", "-q").split()[0]
    swarm_engine.cli("node", "update", "--availability", "active", node)


Check = Callable[[dict[int, Endpoint]], bool]


class Harness:
    def __init__(self, engine: DockerEngine, store: Store, source: SwarmSource) -> None:
        self.engine, self.store, self.source = engine, store, source

    def endpoints(self, group: str = "web") -> dict[int, Endpoint]:
        res = self.store.resources().get(group)
        return {e.port: e for e in res.group.endpoints} if res else {}

    async def wait(self, check: Check, group: str = "web", timeout: float = 30.0) -> dict[int, Endpoint]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            eps = self.endpoints(group)
            if check(eps):
                return eps
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out; endpoints of {group}: {self.endpoints(group)}")

    async def service(self, name: str, port: int, *args: str, drain: float = 0, group: str = "web") -> str:
        return await self.engine.acli(
            "service", "create", "-d", "--name", name, "--network", "host", "--label", f"eds.group={group}",
            "--label", f"eds.port={port}", "--stop-grace-period", "20s", *args, self.engine.image,
            "sh", "-c", backend_script(name, port, drain_seconds=drain), timeout=60,
        )  # fmt: skip

    async def docker(self, *args: str) -> str:
        return await self.engine.acli(*args, timeout=60)


@contextlib.asynccontextmanager
async def _harness(engine: DockerEngine) -> AsyncIterator[Harness]:
    store = Store(encode_group)
    source = SwarmSource(store, OPTS, host=engine.host, resync_interval=30.0, ping_interval=1.0,
                         request_timeout=5.0)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        yield Harness(engine, store, source)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


@pytest.mark.docker
async def test_swarm_lifecycle(swarm: DockerEngine) -> None:
    early = free_port()
    async with _harness(swarm) as h:
        await h.service("web-early", early)  # created while the source starts
        await h.wait(lambda e: set(e) == {early})
        assert h.store.ready and h.endpoints()[early].address == "127.0.0.1"
        assert h.endpoints()[early].hostname == "web-early.1" and h.endpoints()[early].health == Health.HEALTHY

        # scale down to 0 (draining first: the task traps SIGTERM and lingers), then up again
        late = free_port()
        await h.service("web-late", late, drain=3)
        await h.wait(lambda e: set(e) == {early, late})
        scale = asyncio.create_task(h.docker("service", "scale", "-d", "web-late=0"))
        await h.wait(lambda e: late in e and e[late].health == Health.DRAINING)
        await scale
        await h.wait(lambda e: set(e) == {early})
        await h.docker("service", "scale", "-d", "web-late=1")
        await h.wait(lambda e: set(e) == {early, late} and e[late].health == Health.HEALTHY)

        # rolling update: labels change (weight), the old task drains, the new one takes over
        await h.docker("service", "update", "-d", "--label-add", "eds.weight=7", "--force", "web-late")
        await h.wait(lambda e: late in e and e[late].weight == 7 and e[late].health == Health.HEALTHY)

        # a new group via a service label update; a removed service goes
        await h.docker("service", "update", "-d", "--label-add", "eds.group=web,api", "web-early")
        await h.wait(lambda e: set(e) == {early}, group="api")
        await h.docker("service", "rm", "web-early")
        await h.wait(lambda e: set(e) == {late})
        await h.wait(lambda e: not e, group="api")


@pytest.mark.docker
async def test_swarm_node_drain_and_active(swarm: DockerEngine) -> None:
    port = free_port()
    async with _harness(swarm) as h:
        await h.service("web-n", port, drain=2)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY)
        node = (await h.docker("node", "ls", "-q")).split()[0]
        await h.docker("node", "update", "--availability", "drain", node)
        await h.wait(lambda e: port in e and e[port].health == Health.DRAINING)
        await h.wait(lambda e: not e)
        await h.docker("node", "update", "--availability", "active", node)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY, timeout=45)


@pytest.mark.docker
async def test_swarm_engine_restart(swarm: DockerEngine) -> None:
    port = free_port()
    async with _harness(swarm) as h:
        await h.service("web-r", port)
        await h.wait(lambda e: set(e) == {port})
        await asyncio.to_thread(swarm.stop)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while h.source.connected and loop.time() < deadline:
            await asyncio.sleep(0.1)
        assert not h.source.connected and h.store.is_stale("web")
        assert set(h.endpoints()) == {port}  # the last known endpoints stay
        await asyncio.to_thread(swarm.start)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY, timeout=60)
        deadline = loop.time() + 30
        while (not h.source.connected or h.store.is_stale("web")) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        assert h.source.connected and not h.store.is_stale("web")


@pytest.mark.docker
@pytest.mark.envoy
async def test_swarm_through_the_cli_to_a_real_envoy(swarm: DockerEngine, tmp_path: Path) -> None:
    """eds-server --swarm serving a real Envoy: traffic reaches the service's task; a scale-down drains it."""
    port = free_port()
    async with _harness(swarm) as h:  # only to create services the way the other tests do
        await h.service("web-envoy", port, drain=2)
    async with EdsServerProcess(None, "--swarm", "--docker-host", swarm.host, workdir=tmp_path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live(timeout=30)
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: [x.port for x in hs] == [port], timeout=30)
            _, body = await envoy.wait_for(lambda: envoy.get("/"), lambda r: r[0] == 200, timeout=15)
            assert body == "web-envoy"
            scale = asyncio.create_task(swarm.acli("service", "scale", "-d", "web-envoy=0", timeout=60))
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: not hs, timeout=30)
            await scale
            assert await envoy.update_rejected("web") == 0
        sources = {s["name"]: s for s in (await server.admin("/v1/sources"))["sources"]}
        assert sources["swarm"]["connected"] and sources["swarm"]["loaded"]
