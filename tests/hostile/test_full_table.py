"""A full connection table still serves the next Envoy: attackers from 50 loopback addresses keep
the gRPC port's table full (every connection with a valid stream, answering PINGs, so no budget is
charged), and a fresh Envoy from a new address, one from an attacker's address, and the canary are
all served, because a newcomer takes the place of the idlest connection of the address holding the
most, never the other way round (docs/limits.md, "Connections"). Once with a table of 300, once
under an open-file limit of 1,024 (the table then follows the limit, with room kept for the admin
port and the upstreams reload: the canary's changes go through the upstreams file there)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.support.canary import GROUP, TOKEN, Canary, assert_canary_fine, pin, upstreams_text
from tests.support.envoy_harness import EdsCluster, envoy_binary, envoy_bootstrap, envoy_fleet
from tests.support.paths import ROOT
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

MAX_CONNECTIONS = 300  # the table the attackers fill: 50 addresses x 8 connections is more
OPEN_FILES = 1024  # the other case: the table follows this limit (1024 - 600 kept for other files)
ATTACK_SECONDS = 40.0  # the attacker's longest run: it holds the table until the test is done (SIGTERM)
ATTACKERS = "127.0.0.100"  # the first of the attackers' 50 addresses
SERVED_WITHIN = 20.0  # seconds for each Envoy's cluster to get its endpoint


@pytest.mark.parametrize("case", ["table", "open_files"])
async def test_a_full_table_serves_new_envoys_and_the_canary(tmp_path: Path, case: str) -> None:
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text(upstreams_text(0))  # the canary's group: one endpoint, moving; the Envoys ask for it too
    if case == "table":
        limit: tuple[str, ...] = ("--max-connections", str(MAX_CONNECTIONS))
        table, open_files, per_address = MAX_CONNECTIONS, None, 8
    else:
        limit, table, open_files, per_address = (), OPEN_FILES - 600, OPEN_FILES, 12
    async with EdsServerProcess(
        upstreams,
        "--log-level",
        "info",
        "--admin-token",
        TOKEN,
        "--registration-allow-cidr",
        "127.0.0.0/8",
        *limit,
        workdir=tmp_path,
        open_files=open_files,
    ) as server:
        assert server.proc is not None
        pin(server.proc.pid, 0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.hostile_clients",
            "fill_table",
            str(server.port),
            ATTACKERS,
            str(ATTACK_SECONDS),
            str(per_address),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        pin(proc.pid, 1)
        try:

            async def full() -> bool:
                return int((await server.admin("/v1/stats"))["connections_open"]) >= table - 1

            await wait_for(full, timeout=30)
            if open_files:  # changes through the upstreams file: its reload needs descriptors too
                canary = Canary(server.port, upstreams)
            else:
                canary = Canary(server.port, upstreams, admin_port=server.admin_port, token=TOKEN)
            envoys = [
                envoy_bootstrap(server.port, [EdsCluster(GROUP)], node_id=f"late-{i}", xds_source_address=src)
                for i, src in enumerate(("127.0.0.3", ATTACKERS))  # a new address, and an attacker's
            ]
            async with envoy_fleet(envoys, first_base_id=300) as fleet:
                during = await canary.run(6.0)

                async def served() -> bool:
                    looks = await asyncio.gather(*(e.members(GROUP) for e in fleet))
                    return all(m.get(GROUP, 0) >= 1 for m in looks)  # the file's endpoint (and a registered one)

                await wait_for(served, timeout=SERVED_WITHIN)
            stats = await server.admin("/v1/stats")
        finally:
            if proc.returncode is None:
                proc.terminate()  # the table has served its purpose: the attacker reports and ends
            out, err = await asyncio.wait_for(proc.communicate(), ATTACK_SECONDS + 60)
        log = server.log_text()
    assert proc.returncode == 0, err.decode()
    attacker = json.loads(out.decode().strip().splitlines()[-1])
    print(json.dumps({"during": during.summary(), "attacker": attacker, "refused": stats.get("refused_by_reason")}))
    assert_canary_fine(during, "during")
    assert attacker["opened"] >= table, attacker  # the table was full
    assert attacker["closed_by_server"] >= 1, attacker  # and attackers gave way, not the newcomers
    assert "Traceback" not in log, log[-3000:]
    assert "to make room" in log, log[-3000:]
