"""Hostile clients: whatever one client does, a well-behaved one keeps getting its updates.

Each attack runs against a real eds-server process from another loopback address (127.0.0.2+,
so per-IP limits tell it from the canary at 127.0.0.1), the server and the attacker each on a core
of their own where there are two, while the canary (tests/support/canary.py)
follows changes and opens fresh connections. The canary is measured without the attack first,
then during it. Bounds are generous multiples of what was measured here (see docs/limits.md);
RSS is the server's peak (VmHWM). Set HOSTILE_REPORT=FILE to append each run's figures as JSON.
HOSTILE_LOAD=N runs N busy loops beside them, on no core in particular, for the whole of each case
(`make test-hostile-loaded`: a loaded host, where a defence that only works with a core to spare fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.canary import TOKEN, Canary, assert_canary_fine, peak_rss_mb, pin, upstreams_text
from tests.support.hostile_clients import ANSWERED_WITHIN, BIG_GROUP, FRAME_SIZE_ERROR, MALFORMED, PROTOCOL_ERROR
from tests.support.paths import ROOT
from tests.support.server_process import EdsServerProcess

HOSTILE = "tests.support.hostile_clients"  # run as a module of the repository: `python -m`, from ROOT
BEFORE_SECONDS = 1.5  # the canary without the attack: reported beside the attack's figures, not asserted
ATTACK_SECONDS = 5.0
AFTER_SECONDS = 3.0  # asserted, as the attack is: at least 3 changes and 3 fresh connections
RSS_CAP_MB = 250  # the server idles at ~50 MB; these attacks took it to 1.7 GB before the per-client limits

# attack -> (extra server flags, what the server log must show)
ATTACKS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "ping_flood": ((), "ENHANCE_YOUR_CALM"),
    "settings_flood": ((), "ENHANCE_YOUR_CALM"),
    "priority_flood": ((), "ENHANCE_YOUR_CALM"),
    "unknown_flood": ((), "ENHANCE_YOUR_CALM"),
    "empty_data_flood": ((), "ENHANCE_YOUR_CALM"),
    "reset_churn": ((), "ENHANCE_YOUR_CALM"),
    "open_close_churn": ((), "ENHANCE_YOUR_CALM"),
    "data_after_end": ((), "ENHANCE_YOUR_CALM"),
    # streams without a request time out (charged to the address), and past its budget are refused:
    # how far it gets in the attack's window depends on how fast the attacker runs
    "idle_streams": (("--request-timeout", "2s"), "REFUSED_STREAM|no request within"),
    "idle_connections": (("--request-timeout", "2s"), "no stream opened"),
    "partial_messages": (("--request-timeout", "3s", "--partial-message-budget", str(32 << 20)), None),
    "big_health_message": (("--max-message-size", str(1 << 20), "--partial-message-budget", str(32 << 20)), None),
    "health_streams": (("--max-streams", "5000"), None),
    # on the HTTP/2 layer itself (transport/h2/test_attacks.py has their frame-level tests)
    "big_messages_small_frames": ((), None),
    "oversize_frames": ((), "FRAME_SIZE_ERROR"),
    "malformed_headers": ((), "PROTOCOL_ERROR"),
    # valid streams in bursts: nothing over a budget, only the time their header blocks cost
    "header_bursts": ((), None),
    "request_bursts": ((), None),
    "pooled_bursts": ((), None),
    "window_update_flood": ((), "ENHANCE_YOUR_CALM"),
    "continuation_flood": ((), "ENHANCE_YOUR_CALM|[Cc]ontinuation frames"),  # h2 ends it at 64 (fast path)
    "hpack_bomb": ((), None),
    # a frame fed a byte at a time never completes: closed a request timeout after it began
    "drip_frames": (("--request-timeout", "2s"), "slow input"),
    # 4,000 streams of a 10,000-endpoint group never read (~1 GB of responses): the server holds little of it
    "slow_readers": ((), None),
}
BIG_ENDPOINTS = 10_000  # the big group's size where an attack asks for it (~250 KB a response)


LOAD = int(os.environ.get("HOSTILE_LOAD", "0"))  # busy loops beside the server and the attacker
STOCK = os.environ.get("EDS_HTTP2") == "stock"  # `make test-stock`: the server runs the stock HTTP/2 path
# attack -> what the stock path's log shows instead: h2's 100 streams a connection hold there, and
# the guard ends a connection that opens more than twice that without a request
# (transport/h2/test_request_guard.py; test_admission.py shows a stream without a request reset)
STOCK_MARKERS: dict[str, str | None] = {"idle_streams": "streams past the limit|no request within"}
# what the stock path does not defend against (docs/limits.md, "The stock HTTP/2 path")
NOT_ON_STOCK: dict[str, str] = {}


@contextlib.asynccontextmanager
async def busy_loops(n: int, seconds: float) -> AsyncIterator[None]:
    """`n` processes spinning on the CPU (each ends by itself after `seconds`), killed on the way out."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", code) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def attack_run(tmp_path: Path, attack: str, extra: tuple[str, ...], src: str) -> dict[str, Any]:
    upstreams = tmp_path / "upstreams.yaml"
    big = (
        [f"127.{i // 62500}.{i // 250 % 250}.{1 + i % 250}:8080" for i in range(BIG_ENDPOINTS)]
        if attack == "slow_readers"
        else []
    )
    upstreams.write_text(upstreams_text(0) + (f"  {BIG_GROUP}:\n    endpoints: [{', '.join(big)}]\n" if big else ""))
    async with (
        EdsServerProcess(
            upstreams,
            "--log-level",
            "info",
            "--admin-token",
            TOKEN,
            "--registration-allow-cidr",
            "127.0.0.0/8",
            *extra,
            workdir=tmp_path,
        ) as server,
        busy_loops(LOAD, BEFORE_SECONDS + ATTACK_SECONDS + AFTER_SECONDS + 60),
    ):
        assert server.proc is not None
        pin(server.proc.pid, 0)
        # changes through the registration API: immediate, unlike a file watch on a busy machine
        canary = Canary(server.port, upstreams, admin_port=server.admin_port, token=TOKEN)
        before = await canary.run(BEFORE_SECONDS)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            HOSTILE,
            attack,
            str(server.port),
            src,
            str(ATTACK_SECONDS),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        pin(proc.pid, 1)  # an attacker has its own machine: it does not take the server's CPU
        await asyncio.sleep(0.5)  # the attack is under way
        during = await canary.run(ATTACK_SECONDS)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        attacker = json.loads(out.decode().strip().splitlines()[-1])
        peak = peak_rss_mb(server.proc.pid)
        after = await canary.run(AFTER_SECONDS)  # and once the attacker is gone
        stats = await server.admin("/v1/stats")
        log = server.log_text()
        # reported before the server is stopped: a server that fails to stop still shows what it did
        result = {
            "attack": attack,
            "busy_loops": LOAD,
            "before": before.summary(),
            "during": during.summary(),
            "after": after.summary(),
            "peak_rss_mb": round(peak, 1),
            "attacker": attacker,
            "server": {
                k: stats.get(k)
                for k in ("calmed", "connections_refused", "timed_out", "refused", "partial_messages_refused")
            },
        }
        if os.environ.get("HOSTILE_REPORT"):
            with open(os.environ["HOSTILE_REPORT"], "a") as f:
                f.write(json.dumps(result) + "\n")
        print(json.dumps(result))
    result["log"] = log
    result["_during"] = during
    result["_after"] = after
    return result


def check_attacker(attack: str, seen: dict[str, Any]) -> None:
    """What the attacker saw, where it says more than the canary: the attack ran, and was answered
    as it must be."""
    if attack == "big_messages_small_frames":
        assert seen["first_response"] and seen["messages"] >= 1, seen
        assert seen["goaway"] is None and seen["reset"] is None and not seen["trailers"], seen  # valid: read on
    elif attack == "oversize_frames":
        assert seen["connections"] >= 12 and seen["unanswered"] == 0, seen
        assert set(seen["goaway"]) == {str(FRAME_SIZE_ERROR)}, seen
        assert seen["max_payload_before_goaway"] < ANSWERED_WITHIN, seen
    elif attack == "slow_readers":
        assert seen["streams"] >= 1_000, seen  # the attack held at least a quarter of its streams
    elif attack == "malformed_headers":
        assert seen["sent"] >= len(MALFORMED) and seen["unanswered"] == 0, seen
        assert set(seen["reset"]) | set(seen["goaway"]) == {str(PROTOCOL_ERROR)}, seen
        assert seen["valid_failed"] == 0, seen


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_the_canary_keeps_flowing(tmp_path: Path, attack: str) -> None:
    extra, marker = ATTACKS[attack]
    if STOCK:
        if attack in NOT_ON_STOCK:
            pytest.skip(f"stock HTTP/2 path: {NOT_ON_STOCK[attack]}")
        marker = STOCK_MARKERS.get(attack, marker)
    src = f"127.0.0.{2 + list(ATTACKS).index(attack)}"
    result = await attack_run(tmp_path, attack, extra, src)
    assert_canary_fine(result["_during"], "during")
    assert_canary_fine(result["_after"], "after")
    assert result["peak_rss_mb"] < RSS_CAP_MB, result
    check_attacker(attack, result["attacker"])
    log = result["log"]
    assert "Traceback" not in log and "Server error" not in log and "NotImplementedError" not in log, log[-3000:]
    if marker is not None:  # on a line naming the attacker
        assert any(re.search(marker, line) and src in line for line in log.splitlines()), log[-3000:]
