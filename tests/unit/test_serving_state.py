"""Ready, degraded or not ready, from what the sources say of themselves: the one function the
status page, /readyz and eds_state share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from eds_server.serving_state import serving_state
from eds_server.sources.base import SourceStatus
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for


def test_every_source_loaded_and_healthy_is_ready() -> None:
    state = serving_state(True, [SourceStatus("file:u", True, True).as_json()])
    assert (state.name, state.value, state.describe(), state.degraded) == ("ready", 1, "ready", ())


def test_a_loaded_file_whose_reload_failed_is_degraded_with_the_reason() -> None:
    sources = [
        SourceStatus("file:u", True, True, "u:3: mapping values are not allowed here").as_json(),
        SourceStatus("registrations", True, True).as_json(),
    ]
    state = serving_state(True, sources)
    assert state.name == "degraded" and state.value == 2
    assert state.describe() == (
        "degraded: serving the last good state of file:u because u:3: mapping values are not allowed here"
    )


def test_a_stale_source_is_degraded_even_without_an_error() -> None:
    state = serving_state(True, [SourceStatus("docker", True, False).as_json()])
    assert state.name == "degraded" and "docker because it is no longer followed" in state.describe()


def test_every_degraded_source_is_named() -> None:
    state = serving_state(
        True,
        [
            SourceStatus("docker", True, False, "engine gone").as_json(),
            SourceStatus("etcd", True, False, "unreachable").as_json(),
        ],
    )
    assert [d.source for d in state.degraded] == ["docker", "etcd"] and "; " in state.describe()


def test_not_ready_wins_and_a_source_not_loaded_is_pending_not_degraded() -> None:
    sources = [
        SourceStatus("file:u", True, True, "broken").as_json(),
        SourceStatus("docker", False, False, "engine gone").as_json(),
    ]
    state = serving_state(False, sources)
    assert (state.name, state.value, state.pending) == ("not ready", 0, ("docker",))
    assert state.describe() == "not ready: waiting for docker"
    assert [d.source for d in state.degraded] == ["file:u"]


def test_ready_past_the_start_up_timeout_with_a_source_never_loaded_is_ready() -> None:
    """--startup-timeout: serving without it; that is not-yet-loaded, which /readyz lists as pending."""
    state = serving_state(True, [SourceStatus("docker", False, False, "engine gone").as_json()])
    assert state.name == "ready" and state.pending == ("docker",)


async def _readyz(server: EdsServerProcess) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r,
    ):
        return r.status, await r.json()


async def _eds_state(server: EdsServerProcess) -> float:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r,
    ):
        text = await r.text()
    line = next(x for x in text.splitlines() if x.startswith("eds_state "))
    return float(line.split()[1])


async def test_readyz_and_eds_state_say_degraded_and_stay_200_while_the_last_good_file_is_served(
    tmp_path: Path,
) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8080]\n")
    async with EdsServerProcess(path) as server:
        status, body = await _readyz(server)
        assert (status, body["state"], body["detail"], body["degraded"]) == (200, "ready", "ready", [])
        assert await _eds_state(server) == 1
        path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8080\n")  # a syntax error
        status, body = await wait_for(lambda: _readyz(server), lambda r: r[1]["state"] == "degraded", timeout=15)
        assert status == 200 and body["ready"] is True
        assert body["detail"].startswith(f"degraded: serving the last good state of file:{path} because ")
        assert body["degraded"][0]["source"] == f"file:{path}" and body["degraded"][0]["reason"]
        assert await _eds_state(server) == 2
        group = await server.admin("/v1/groups/web")
        assert [e["port"] for e in group["endpoints"]] == [8080]  # the last good state, still served
        path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
        await wait_for(lambda: _readyz(server), lambda r: r[1]["state"] == "ready", timeout=15)
        assert await _eds_state(server) == 1
