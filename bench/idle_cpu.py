"""Idle cost: CPU used by eds-server while a real Envoy stays connected and nothing changes.

    .venv/bin/python bench/idle_cpu.py [--clusters 150] [--seconds 30] [--docker]

With --docker (as root) the groups come from a private Docker engine instead of the file: one
labelled host-network container per cluster, none of them contacted.

Prints a table and writes bench/results/idle_cpu.json. CPU time is read from /proc (user + system
ticks of the server process), so the figure does not depend on how busy the machine is otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test helpers: tests.support

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap  # noqa: E402
from tests.support.server_process import EdsServerProcess  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def main(clusters: int, seconds: float, docker: bool) -> dict[str, object]:
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        path: Path | None = Path(tmp) / "upstreams.yaml"
        args: tuple[str, ...] = ("--log-level", "info")
        if docker:
            from docker_engine import DockerEngine

            engine = stack.enter_context(DockerEngine())
            for i in range(clusters):
                engine.cli(
                    "run",
                    "-d",
                    "--network",
                    "host",
                    "--label",
                    f"eds.group=c{i}",
                    "--label",
                    f"eds.port={20000 + i}",
                    engine.image,
                    "sleep",
                    "3600",
                )
            path, args = None, (*args, "--docker", "--docker-host", engine.host)
        else:
            assert path is not None
            path.write_text(
                "groups:\n" + "".join(f"  c{i}:\n    endpoints: [127.0.0.1:{20000 + i}]\n" for i in range(clusters))
            )
        async with EdsServerProcess(path, *args, workdir=Path(tmp)) as server:
            bootstrap = envoy_bootstrap(server.port, [EdsCluster(f"c{i}") for i in range(clusters)])
            async with EnvoyProcess(bootstrap) as envoy:
                await envoy.wait_live(timeout=60)
                await asyncio.sleep(2)  # let start-up settle
                assert server.proc is not None
                before = cpu_seconds(server.proc.pid)
                await asyncio.sleep(seconds)
                used = cpu_seconds(server.proc.pid) - before
    return {
        "source": "docker" if docker else "file",
        "clusters": clusters,
        "seconds": seconds,
        "cpu_seconds": used,
        "core_percent": 100 * used / seconds,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--clusters", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--docker", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main(args.clusters, args.seconds, args.docker))
    print(f"{'source':>7} {'streams':>8} {'window s':>9} {'cpu s':>7} {'% of a core':>12}")
    print(
        f"{result['source']:>7} {result['clusters']:>8} {result['seconds']:>9.0f} "
        f"{result['cpu_seconds']:>7.2f} {result['core_percent']:>12.2f}"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"idle_cpu_{result['source']}.json").write_text(json.dumps(result, indent=2) + "\n")
