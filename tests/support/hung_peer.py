"""A peer frozen with SIGSTOP, seen from eds-server's admin side: the source it feeds must be said stale
on every surface an operator or a probe reads (`/v1/sources`, `/readyz`, `/metrics`, the groups of the
status page), within the bound
the docs state, and said live again after SIGCONT.

HUNG_BOUND is the bound the docs state for every remote source, by design: a second of quiet, then
two probes with two seconds each to answer, from the peer's last sign of life. It has no slack for a
loaded host's scheduling, so the tests do not race it: they wait up to HUNG_WAIT, which only a hang
found by something other than the heartbeat would exceed (the next timeouts are 30 s and more), check
that the heartbeat found it (its words), and print how long it took (the figures the docs quote).
"""

from __future__ import annotations

import re
import time
from typing import Any

import aiohttp

from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for

HUNG_BOUND = 5.0
HUNG_WAIT = 2 * HUNG_BOUND


async def _sources(server: EdsServerProcess) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in (await server.admin("/v1/sources"))["sources"]}


async def wait_source(server: EdsServerProcess, source: str, *, stale: bool, timeout: float) -> dict[str, Any]:
    """Wait until the loaded `source` is (or no longer is) stale; returns its /v1/sources entry."""

    def settled(found: dict[str, dict[str, Any]]) -> bool:
        s = found.get(source)
        return bool(s and s["loaded"] and s["stale"] == stale)

    found = await wait_for(
        lambda: _sources(server), settled, timeout=timeout, interval=0.1, what=f"source {source} stale={stale}"
    )
    return found[source]


async def frozen_is_said(server: EdsServerProcess, source: str, frozen_at: float) -> float:
    """After the peer behind `source` was frozen at `frozen_at` (time.monotonic()): the heartbeat finds
    it (stale within HUNG_WAIT, its words as the last_error), and /readyz (still 200: the last state is
    served) and /metrics say so. Returns the seconds it took (a figure to print)."""
    left = max(0.1, HUNG_WAIT - (time.monotonic() - frozen_at))
    entry = await wait_source(server, source, stale=True, timeout=left)
    took = time.monotonic() - frozen_at
    assert "twice running (hung or cut off)" in str(entry["last_error"]), entry  # the heartbeat, not a read timeout
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r:
            status, body = r.status, await r.json()
        async with s.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
            metrics = await r.text()
        async with s.get(f"http://127.0.0.1:{server.admin_port}/v1/groups") as r:
            groups = (await r.json())["groups"]
    assert status == 200 and body["state"] == "degraded", body  # ready: the last good state is served
    assert source in [d["source"] for d in body["degraded"]], body
    healthy = re.search(rf'^eds_source_healthy{{source="{re.escape(source)}"}} (\S+)$', metrics, re.M)
    assert healthy is not None and float(healthy.group(1)) == 0.0, metrics[-2000:]
    assert groups and all(g["stale"] for g in groups), groups  # what the status page lists, marked stale
    return took
