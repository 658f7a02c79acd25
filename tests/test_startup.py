"""Start-up gating through the real command line: nothing is served until every source has
delivered, or `--startup-timeout` has passed (then what is loaded is served, and the log says
which sources were missing)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
from server_process import EdsServerProcess


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
        assert "startup timeout (2s): sources still empty: docker" in log
        assert "docker: engine unreachable" in log
        groups = await server.admin("/v1/groups")
        assert [g["name"] for g in groups["groups"]] == ["web"]
    finally:
        assert await server.stop() == 0
