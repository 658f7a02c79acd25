"""How long a `docker run` / `docker stop` takes to show in a real Envoy, through eds-server.

    .venv/bin/python bench/docker_latency.py [--rounds 10]      (as root: starts a private dockerd)

For each round: start a labelled host-network container and time from `docker run` returning
(the container is running) until Envoy's /clusters lists it; then time from `docker stop` being
issued until Envoy no longer lists it. Envoy's admin is polled every 10 ms, so figures carry up to
~10 ms of polling slack. Prints a table (medians and maxima) and writes
bench/results/docker_latency.json. Containers serve on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test helpers: tests.support

from tests.support.docker_engine import DockerEngine, arun_backend  # noqa: E402
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.server_process import EdsServerProcess  # noqa: E402


async def until(probe: object, timeout: float = 10.0) -> float:
    """Seconds until probe() is true, polling every 10 ms (bounded)."""
    start = time.monotonic()
    for _ in range(int(timeout / 0.01)):
        if await probe():  # type: ignore[operator]
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise TimeoutError("not seen in Envoy")


async def main(rounds: int) -> dict[str, object]:
    run_s: list[float] = []
    stop_s: list[float] = []
    with DockerEngine() as engine, tempfile.TemporaryDirectory() as tmp:
        args = ("--docker", "--docker-host", engine.host, "--log-level", "info")
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(EdsServerProcess(None, *args, workdir=Path(tmp)))
            envoy = await stack.enter_async_context(EnvoyProcess(envoy_bootstrap(server.port, [EdsCluster("web")])))
            await envoy.wait_live()
            for i in range(rounds):
                port = free_port()

                async def present(port: int = port) -> bool:
                    return any(h.port == port for h in await envoy.hosts("web"))

                await arun_backend(
                    engine, f"lat-{i}", port, {"eds.group": "web", "eds.port": str(port)}, wait_ready=False
                )
                run_s.append(await until(present))
                stopping = asyncio.create_task(engine.acli("stop", "-t", "5", f"lat-{i}"))
                stop_s.append(await until(lambda present=present: _not(present)))
                await stopping

    def row(xs: list[float]) -> dict[str, float]:
        return {"median_ms": 1000 * statistics.median(xs), "max_ms": 1000 * max(xs)}

    return {"rounds": rounds, "run_to_envoy": row(run_s), "stop_to_envoy": row(stop_s), "debounce_ms": 50}


async def _not(probe: object) -> bool:
    return not await probe()  # type: ignore[operator]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    result = asyncio.run(main(parser.parse_args().rounds))
    print(f"{'event':<16} {'median ms':>10} {'max ms':>8}   ({result['rounds']} rounds)")
    for key in ("run_to_envoy", "stop_to_envoy"):
        r = result[key]
        print(f"{key:<16} {r['median_ms']:>10.0f} {r['max_ms']:>8.0f}")  # type: ignore[index]
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "docker_latency.json").write_text(json.dumps(result, indent=2) + "\n")
