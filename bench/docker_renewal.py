"""What renewing the Docker event subscription costs: engine CPU and requests, renewing or not.

    .venv/bin/python bench/docker_renewal.py [--containers 20] [--seconds 60] [--health] [--rounds 1]

(as root: starts a private dockerd.) Runs the Docker source in this process against the engine for
`seconds` twice, once with the default renewal (every ping_interval + 2 * ping_timeout = 5 s) and once
without (never renewed: the behaviour before renewals), and reads the CPU time of dockerd and
containerd from /proc over each run, so the figure does not depend on how busy the machine is
otherwise. With --health each container runs a health check every second (three exec events a
second each: a busy event history, of which each renewal replays the margin again). Prints a table and
writes bench/results/docker_renewal.json. Containers use host networking and are never contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test helpers: tests.support

from eds_server.encode import encode_group  # noqa: E402
from eds_server.sources.containers import DockerOptions  # noqa: E402
from eds_server.sources.docker import DockerSource  # noqa: E402
from eds_server.store import Store  # noqa: E402
from tests.support.docker_engine import DockerEngine  # noqa: E402
from tests.support.feeds import alone  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICKS


async def one_run(engine: DockerEngine, renew: float | None, seconds: float) -> dict[str, float]:
    store = Store(encode_group)
    source = alone(DockerSource, store, DockerOptions(), host=engine.host, renew_interval=renew)
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    for _ in range(600):  # until it follows the engine (bounded: 60 s)
        if source.connected:
            break
        await asyncio.sleep(0.1)
    assert source.connected and source.events is not None and source.heartbeat is not None
    await asyncio.sleep(2)  # let the listing settle
    pids = engine.engine_pids()
    events, heartbeat = source.events, source.heartbeat
    renewals, probes, relists = events.renewals, heartbeat.probes, source.relists
    cpu0, t0, own0 = cpu_seconds(pids), time.monotonic(), time.process_time()
    await asyncio.sleep(seconds)
    cpu1, t1, own1 = cpu_seconds(pids), time.monotonic(), time.process_time()
    minutes = (t1 - t0) / 60
    result = {
        "renew_s": renew if renew is not None else source.renew_interval,
        "engine_cpu_ms_per_min": round(1000 * (cpu1 - cpu0) / minutes, 1),
        "own_cpu_ms_per_min": round(1000 * (own1 - own0) / minutes, 1),
        "event_subscriptions_per_min": round((events.renewals - renewals) / minutes, 1),
        "pings_per_min": round((heartbeat.probes - probes) / minutes, 1),
        "relists": source.relists - relists,
        "gaps": events.gaps,
    }
    stop.set()
    await asyncio.wait_for(task, 30)
    return result


async def main(containers: int, seconds: float, health: bool, rounds: int) -> list[dict[str, float]]:
    with DockerEngine() as engine:
        for i in range(containers):
            checks = ("--health-cmd", "true", "--health-interval", "1s") if health else ()
            engine.cli(
                "run",
                "-d",
                "--network",
                "host",
                "--label",
                "eds.group=bench",
                "--label",
                f"eds.port={20000 + i}",
                *checks,
                engine.image,
                "sleep",
                "3600",
            )
        return [await one_run(engine, renew, seconds) for _ in range(rounds) for renew in (None, math.inf)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--containers", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--health", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="each a run renewing, then one not")
    args = parser.parse_args()
    rows = asyncio.run(main(args.containers, args.seconds, args.health, args.rounds))
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "docker_renewal.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1) + "\n")
