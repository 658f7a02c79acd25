"""Start-up gating through the real command line: nothing is served until every source has
delivered (by default, however long that takes), or an explicit `--startup-timeout` has passed (then
what is loaded is served, and the log says which sources were missing)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for


async def readyz(server: EdsServerProcess) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r:
        return r.status


async def test_unreachable_source_holds_readiness_until_the_timeout(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:1]\n")
    server = EdsServerProcess(
        path,
        "--docker",
        "--docker-host",
        f"unix://{tmp_path}/no-engine.sock",
        "--startup-timeout",
        "2s",
        workdir=tmp_path,
    )
    await server.start(wait_ready=False)
    try:
        statuses: list[int] = []

        async def status() -> int:
            statuses.append(await readyz(server))
            return statuses[-1]

        await wait_for(status, lambda s: s == 200, timeout=10, interval=0.1, what="/readyz 200 past the timeout")
        assert statuses[0] == 503
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
    server = EdsServerProcess(path, "--docker", "--docker-host", f"unix://{tmp_path}/no-engine.sock", workdir=tmp_path)
    await server.start(wait_ready=False)
    try:
        bodies = []
        loop = asyncio.get_running_loop()
        until = loop.time() + 4.0  # what is claimed is a duration: longer than the old 2 s default timeout

        async def sample() -> float:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r:
                bodies.append((r.status, await r.json()))
            return loop.time()

        await wait_for(sample, lambda now: now >= until, timeout=10, interval=0.1, what="4 s of /readyz answers")
        assert bodies and all(status == 503 for status, _ in bodies)
        waiting = bodies[-1][1]["waiting_for"]
        assert [w["source"] for w in waiting] == ["docker"] and "no-engine.sock" in (waiting[0]["last_error"] or "")
        log = server.log_text()
        assert "not loaded yet: nothing is answered to Envoy until it is" in log
        assert "last known endpoints" not in log and "startup timeout" not in log
    finally:
        assert await server.stop() == 0
