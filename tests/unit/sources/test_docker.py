"""Recorded engine output: address rules on real `docker inspect` objects, and event handling
replayed from a real event stream (no engine, no traffic)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from eds_server.encode import encode_group
from eds_server.model import Health
from eds_server.sources.containers import DockerOptions, container_endpoints
from eds_server.sources.docker import DockerSource
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.paths import DATA

DATA = DATA / "docker"


def recorded(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())  # type: ignore[no-any-return]


def test_host_network() -> None:
    c = container_endpoints(recorded("host-network"), DockerOptions())
    assert c.warning is None
    assert c.endpoints["web"].key == ("127.0.0.1", 18601) and c.endpoints["web"].weight == 2


def test_user_network_with_exposed_port() -> None:
    data = recorded("bridge-expose")
    ip = data["NetworkSettings"]["Networks"]["eds-net1"]["IPAddress"]
    assert container_endpoints(data, DockerOptions()).endpoints["api"].key == (ip, 8080)


def test_two_networks() -> None:
    data = recorded("two-networks")
    c = container_endpoints(data, DockerOptions())
    assert c.warning is not None and "several networks (eds-net1, eds-net2)" in c.warning
    ip2 = data["NetworkSettings"]["Networks"]["eds-net2"]["IPAddress"]
    assert container_endpoints(data, DockerOptions(network="eds-net2")).endpoints["api"].address == ip2


def test_published_ports() -> None:
    data = recorded("published-ports")
    published = DockerOptions(address_mode="published", host_address="192.0.2.1")
    assert container_endpoints(data, published).endpoints["api"].key == ("127.0.0.1", 18081)
    data["Config"]["Labels"]["eds.port"] = "9090"  # published on every interface
    assert container_endpoints(data, published).endpoints["api"].key == ("192.0.2.1", 18082)


@pytest.mark.parametrize(
    ("name", "health"),
    [
        ("health-starting", None),
        ("health-healthy", Health.HEALTHY),
        ("health-unhealthy", Health.UNHEALTHY),
        ("paused", Health.UNHEALTHY),
        ("exited", None),
    ],
)
def test_recorded_states(name: str, health: Health | None) -> None:
    data = recorded(name)
    data["Config"]["Labels"]["eds.port"] = "80"
    got = container_endpoints(data, DockerOptions()).endpoints
    assert (got["web"].health if got else None) == health


class FakeEngine:
    """Answers inspect calls from a table the test keeps current, and counts them."""

    def __init__(self) -> None:
        self.template = recorded("host-network")
        self.state: dict[str, dict[str, Any]] = {}
        self.inspects = 0
        self.containers = self

    def container(self, cid: str) -> Any:
        engine = self

        class _C:
            async def show(self) -> dict[str, Any]:
                engine.inspects += 1
                return copy.deepcopy(engine.state[cid])

        return _C()

    def set(self, cid: str, name: str, status: str, **state: Any) -> None:
        data = copy.deepcopy(self.template)
        data.update(Id=cid, Name="/" + name)
        data["Config"]["Labels"]["eds.port"] = str(20000 + len(self.state))  # one port each
        data["State"] = {
            "Status": status,
            "Running": status in ("running", "paused"),
            "Paused": status == "paused",
            **state,
        }
        if cid in self.state:  # keep its port
            data["Config"]["Labels"]["eds.port"] = self.state[cid]["Config"]["Labels"]["eds.port"]
        self.state[cid] = data


def events() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / "events.jsonl").read_text().splitlines()]


async def test_replayed_event_stream() -> None:
    store = Store(encode_group)
    source = alone(DockerSource, store, DockerOptions())
    engine = FakeEngine()
    seen: list[tuple[str, str]] = []
    for ev in events():
        cid = ev["Actor"]["Attributes"].get("container") or ev["Actor"]["ID"]
        name = ev["Actor"]["Attributes"].get("name", "")
        action = ev["Action"]
        # keep the fake engine's answer in step with what the real one would say now
        if action in ("create",) or (action == "connect" and cid not in engine.state):
            engine.set(cid, name or "x", "created")
        elif action in ("start", "unpause"):
            engine.set(cid, name, "running")
        elif action == "pause":
            engine.set(cid, name, "paused")
        elif action == "rename":
            engine.state[cid]["Name"] = "/" + name
        elif action.startswith("health_status: "):
            engine.state[cid]["State"]["Health"] = {"Status": action.split(": ", 1)[1]}
        elif action in ("die", "destroy"):
            engine.set(cid, engine.state[cid]["Name"][1:], "exited")
        if await source.handle(engine, ev):  # type: ignore[arg-type]
            source.publish()
        group = store.get("web").group
        eps = {e.hostname: e.health.name for e in group.endpoints}
        seen.append((f"{ev['Type']} {action.split(':')[0]} {name}", json.dumps(eps, sort_keys=True)))

    timeline = dict(seen)  # the state after each (distinct) step
    assert timeline["container kill ev-drain"] == '{"ev-drain": "DRAINING"}'
    assert timeline["container die ev-drain"] == "{}"
    assert timeline["container stop ev-drain"] == "{}"  # the disconnect in between did not revive it
    assert timeline["container pause ev-pause"] == '{"ev-pause": "UNHEALTHY"}'
    assert '"ev-renamed": "HEALTHY"' in timeline["container rename ev-renamed"]
    health_steps = [eps for step, eps in seen if step == "container health_status ev-health"]
    assert [json.loads(e)["ev-health"] for e in health_steps] == ["UNHEALTHY", "HEALTHY", "UNHEALTHY"]
    final = store.get("web").group
    assert {e.hostname for e in final.endpoints} == {"ev-pause", "ev-health", "ev-net"}  # still running
    assert {e.hostname: e.health for e in final.endpoints}["ev-health"] == Health.UNHEALTHY
    # health checks run as execs: dozens of exec events, no inspect for any of them
    execs = sum(1 for e in events() if e["Action"].startswith("exec_"))
    assert execs > 10 and engine.inspects < len(events()) - execs


def test_a_socket_we_may_not_open_names_the_fix() -> None:
    from eds_server.sources.docker import with_fix

    reason = "ClientConnectorError: Cannot connect to host localhost:80 ssl:default [Permission denied]"
    assert "DOCKER_GID" in with_fix(reason) and with_fix(reason).startswith(reason)
    assert with_fix("500: engine exploded") == "500: engine exploded"
