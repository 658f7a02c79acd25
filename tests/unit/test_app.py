"""Start-up gating through the real command line: nothing is served until every source has
delivered (by default, however long that takes), or an explicit `--startup-timeout` has passed (then
what is loaded is served, and the log says which sources were missing)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp

from tests.support.server_process import EdsServerProcess


async def readyz(server: EdsServerProcess) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r:
        return r.status


async def test_unreachable_source_holds_readiness_until_the_timeout(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:1]\n")
    server = EdsServerProcess(path, "--docker", "--docker-host", f"unix://{tmp_path}/no-engine.sock",
                              "--startup-timeout", "2s", workdir=tmp_path)  # fmt: skip
    await server.start(wait_ready=False)
    try:
        statuses: list[int] = []
        for _ in range(100):  # bounded
            with contextlib.suppress(aiohttp.ClientError):
                statuses.append(await readyz(server))
            if statuses and statuses[-1] == 200:
                break
            await asyncio.sleep(0.1)
        assert statuses[0] == 503 and statuses[-1] == 200
        log = server.log_text()
        assert "startup timeout (2s): sources never loaded: docker" in log
        assert "docker: engine unreachable" in log
        groups = await server.admin("/v1/groups")
        assert [g["name"] for g in groups["groups"]] == ["web"]
    finally:
        assert await server.stop() == 0


async def test_by_default_a_source_that_never_loaded_keeps_the_server_unready(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:1]\n")
    server = EdsServerProcess(path, "--docker", "--docker-host", f"unix://{tmp_path}/no-engine.sock",
                              workdir=tmp_path)  # fmt: skip
    await server.start(wait_ready=False)
    try:
        bodies = []
        for _ in range(40):  # bounded: 4 s, longer than the old 2 s test timeout
            with contextlib.suppress(aiohttp.ClientError):
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r:
                    bodies.append((r.status, await r.json()))
            await asyncio.sleep(0.1)
        assert bodies and all(status == 503 for status, _ in bodies)
        waiting = bodies[-1][1]["waiting_for"]
        assert [w["source"] for w in waiting] == ["docker"] and "no-engine.sock" in (waiting[0]["last_error"] or "")
        log = server.log_text()
        assert "not loaded yet: nothing is answered to Envoy until it is" in log
        assert "last known endpoints" not in log and "startup timeout" not in log
    finally:
        assert await server.stop() == 0
