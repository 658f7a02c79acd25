"""The real-Docker test infrastructure itself: a private dockerd, busybox backends on loopback ports."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.support.docker_engine import NOT_YET_DOCKER, DockerEngine, DockerError, http_get, run_backend
from tests.support.paths import DATA
from tests.support.ports import free_port
from tests.support.waiting import wait_for_blocking

pytestmark = pytest.mark.docker


def _event(events: list[dict[str, Any]], action: str) -> dict[str, Any]:
    found = [e for e in events if e["Action"] == action]
    assert found, f"no {action!r} event in {[e['Action'] for e in events]}"
    return found[0]


def test_backend_serves_its_name_on_loopback(docker_cleanup: DockerEngine) -> None:
    port = free_port()
    cid = run_backend(docker_cleanup, "eng-web-1", port, {"eds.group": "web"})
    assert len(cid) == 64
    assert http_get(port) == (200, "eng-web-1")


def test_inspect_shows_labels_and_host_network(docker_cleanup: DockerEngine) -> None:
    port = free_port()
    labels = {"eds.group": "web", "eds.port": str(port), "eds.weight": "3"}
    cid = run_backend(docker_cleanup, "eng-web-2", port, labels)
    info = docker_cleanup.inspect("eng-web-2")
    assert info["Id"] == cid
    assert info["Name"] == "/eng-web-2"
    assert info["Config"]["Labels"] == labels
    assert info["HostConfig"]["NetworkMode"] == "host"
    assert list(info["NetworkSettings"]["Networks"]) == ["host"]
    assert info["State"]["Running"] is True
    assert info["State"].get("Health") is None


def test_cli_error_carries_stderr(docker_cleanup: DockerEngine) -> None:
    with pytest.raises(DockerError, match="No such"):
        docker_cleanup.cli("container", "inspect", "no-such-container")


def test_health_flips(docker_cleanup: DockerEngine) -> None:
    eng, port, since = docker_cleanup, free_port(), time.time()
    cid = run_backend(eng, "eng-health", port, {"eds.group": "web"}, health_cmd="test -f /healthy")
    eng.wait_health(cid, "unhealthy")
    eng.cli("exec", "eng-health", "touch", "/healthy")
    eng.wait_health(cid, "healthy")
    eng.cli("exec", "eng-health", "rm", "/healthy")
    eng.wait_health(cid, "unhealthy")
    assert http_get(port) == (200, "eng-health")  # health is only what Docker reports
    actions = [e["Action"] for e in eng.events(since, filters=[f"container={cid}"])]
    assert "health_status: healthy" in actions and "health_status: unhealthy" in actions


def test_stop_without_drain_is_prompt(docker_cleanup: DockerEngine) -> None:
    eng, port = docker_cleanup, free_port()
    cid = run_backend(eng, "eng-quick", port, {})
    t0 = time.monotonic()
    eng.cli("stop", "-t", "10", cid)
    assert time.monotonic() - t0 < 5
    state = eng.inspect(cid)["State"]
    assert state["Running"] is False and state["ExitCode"] == 0  # exited on SIGTERM, not SIGKILL (137)


def test_drain_delays_exit_after_stop(docker_cleanup: DockerEngine) -> None:
    eng, port, drain = docker_cleanup, free_port(), 1.5
    cid = run_backend(eng, "eng-drain", port, {"eds.group": "web"}, drain_seconds=drain)
    since = time.time()
    stopper = threading.Thread(target=eng.cli, args=("stop", "-t", "20", cid), daemon=True)
    stopper.start()
    # the kill (SIGTERM) event comes first; the backend still serves while it drains
    kill = eng.wait_event(since, lambda e: e["Action"] == "kill", filters=[f"container={cid}"])
    assert kill["Actor"]["Attributes"]["signal"] == "15"
    assert http_get(port) == (200, "eng-drain")
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    events = eng.events(since, filters=[f"container={cid}"])
    die = _event(events, "die")
    assert die["Actor"]["Attributes"]["exitCode"] == "0"
    assert die["Actor"]["Attributes"]["eds.group"] == "web"  # labels ride along in Actor.Attributes
    gap = (die["timeNano"] - kill["timeNano"]) / 1e9
    assert drain - 0.1 <= gap < drain + 5
    assert [e["Action"] for e in events][-1] == "stop"
    with pytest.raises(OSError):
        http_get(port, timeout=1.0)


def test_live_restore_keeps_containers_across_engine_restart(docker_cleanup: DockerEngine) -> None:
    eng, port = docker_cleanup, free_port()
    cid = run_backend(eng, "eng-live", port, {"eds.group": "web"})
    pid = eng.inspect(cid)["State"]["Pid"]
    eng.stop()
    try:
        assert not eng.ping()
        assert http_get(port) == (200, "eng-live")  # served while dockerd is down
    finally:
        eng.start()
    state = eng.inspect(cid)["State"]
    assert state["Running"] is True and state["Pid"] == pid
    assert http_get(port) == (200, "eng-live")
    wait_for_blocking(
        lambda: cid in eng.container_ids(all=False), timeout=5, what="container listed as running", retry=NOT_YET_DOCKER
    )


async def test_async_cli_on_uvloop(docker_cleanup: DockerEngine) -> None:
    version = await docker_cleanup.acli("version", "--format", "{{.Server.APIVersion}}")
    assert version.count(".") == 1


def test_recorded_fixtures_load() -> None:
    """The JSON recorded by tests/data/docker/record.py (no engine needed)."""
    data = DATA / "docker"
    states = {
        "host-network": ("running", None),
        "bridge-expose": ("running", None),
        "two-networks": ("running", None),
        "published-ports": ("running", None),
        "health-starting": ("running", "starting"),
        "health-healthy": ("running", "healthy"),
        "health-unhealthy": ("running", "unhealthy"),
        "paused": ("paused", None),
        "exited": ("exited", None),
    }
    for name, (status, health) in states.items():
        info = json.loads((data / f"{name}.json").read_text())
        assert isinstance(info, dict), name
        assert info["State"]["Status"] == status, name
        assert (info["State"].get("Health") or {}).get("Status") == health, name
    assert len(json.loads((data / "containers-list.json").read_text())) == len(states) - 2
    events = [json.loads(line) for line in (data / "events.jsonl").read_text().splitlines()]
    assert {e["Type"] for e in events} == {"container", "network"}
    assert {"kill", "die", "stop", "pause", "unpause", "rename", "destroy", "health_status: healthy"} <= {
        e["Action"] for e in events
    }
