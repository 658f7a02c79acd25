"""Process-level faults through the real command line."""

from __future__ import annotations

import signal
from pathlib import Path

import aiohttp

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.server_process import EdsServerProcess

TOKEN = "test-token-0123456789"


async def test_acknowledged_registration_survives_kill_9(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    server = EdsServerProcess(
        None,
        "--state",
        str(state),
        "--admin-token",
        TOKEN,
        "--registration-allow-cidr",
        "127.0.0.0/8",
        workdir=tmp_path,
    )
    await server.start()
    url = f"http://127.0.0.1:{server.admin_port}/v1/groups/web/endpoints/vm-1"
    async with aiohttp.ClientSession() as s:
        async with s.put(
            url, json={"address": "127.0.0.1", "port": 9001, "weight": 4}, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            assert r.status == 201
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)  # right after the 2xx: no chance to flush anything
        await server.proc.wait()
    await server.start()  # same ports, same state file
    try:
        groups = {g["name"]: g for g in (await server.admin("/v1/groups"))["groups"]}
        assert groups["web"]["endpoints"] == [{"address": "127.0.0.1", "port": 9001, "health": "unknown", "weight": 4}]
        async with EnvoyProcess(envoy_bootstrap(server.port, [EdsCluster("web")])) as envoy:
            await envoy.wait_live()
            hosts = await envoy.hosts("web")
            assert [(h.port, h.weight) for h in hosts] == [(9001, 4)]
    finally:
        assert await server.stop() == 0
