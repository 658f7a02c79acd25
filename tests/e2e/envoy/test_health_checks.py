"""Health checks run by eds-server, proven through a real Envoy: a backend whose /health answers 500
while it still serves leaves Envoy's rotation after `unhealthy_threshold` failed checks, with no
failed client request, and comes back after `healthy_threshold` passing ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fault_watch import FaultWatch
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for

INTERVAL, UNHEALTHY, HEALTHY = 1.0, 2, 2
CHECK = f"{{http: /health, interval: {INTERVAL:g}s, timeout: 500ms, healthy_threshold: {HEALTHY}, " \
        f"unhealthy_threshold: {UNHEALTHY}}}"  # fmt: skip


@dataclass
class Backend:
    name: str
    port: int = 0
    sick: bool = False  # /health answers 500; everything else is still served
    hits: int = 0  # requests served, /health apart
    health_500s: int = 0


async def envoy_health(envoy: EnvoyProcess, port: int) -> str:
    return {h.port: h.health for h in await envoy.hosts("web")}.get(port, "")


@asynccontextmanager
async def backend(b: Backend) -> AsyncIterator[Backend]:
    async def handle(request: web.Request) -> web.Response:
        if request.path == "/health":
            if b.sick:
                b.health_500s += 1
                return web.Response(status=500, text="sick")
            return web.Response(text="ok")
        b.hits += 1
        return web.Response(text=b.name)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    b.port = int(runner.addresses[0][1])
    try:
        yield b
    finally:
        await runner.cleanup()


async def test_failing_health_endpoint_leaves_rotation_and_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    async with AsyncExitStack() as stack:
        backends = [await stack.enter_async_context(backend(Backend(f"b{i}"))) for i in range(3)]
        eps = "\n".join(f"      - {{address: 127.0.0.1, port: {b.port}}}" for b in backends)
        path.write_text(f"groups:\n  web:\n    health_check: {CHECK}\n    endpoints:\n{eps}\n")
        server = await stack.enter_async_context(EdsServerProcess(path, workdir=tmp_path))
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
        envoy = await stack.enter_async_context(EnvoyProcess(bootstrap))

        await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: [x.health for x in h] == ["HEALTHY"] * 3)
        sick = backends[0]
        async with FaultWatch(envoy, server) as watch:  # no direct probes of the backends: hits are Envoy's
            await asyncio.sleep(1.0)  # traffic reaches all three
            assert sick.hits > 0
            watch.mark("b0 /health answers 500")
            sick.sick = True
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await wait_for(lambda: envoy_health(envoy, sick.port), lambda h: h == "UNHEALTHY",
                           timeout=UNHEALTHY * INTERVAL + 1.0, interval=0.05, what="b0 out of rotation")  # fmt: skip
            out_after = loop.time() - t0
            watch.mark("b0 out of Envoy's rotation")
            assert sick.health_500s in (UNHEALTHY, UNHEALTHY + 1), sick.health_500s  # its threshold, no sooner
            hits_when_out = sick.hits
            await asyncio.sleep(1.5)
            assert sick.hits <= hits_when_out + 1  # nothing more sent to it (one may have been in flight)
            group = await server.admin("/v1/groups/web")
            mine = next(e for e in group["endpoints"] if e["port"] == sick.port)
            assert mine["health"] == "unhealthy" and mine["check"]["reason"] == "HTTP 500", mine
            assert mine["check"]["result"] == "fail" and mine["check"]["in_a_row"] >= UNHEALTHY

            sick.sick = False
            watch.mark("b0 /health answers 200 again")
            t1 = loop.time()
            await wait_for(lambda: envoy_health(envoy, sick.port), lambda h: h == "HEALTHY",
                           timeout=HEALTHY * INTERVAL + 1.0, interval=0.05, what="b0 back in rotation")  # fmt: skip
            back_after = loop.time() - t1
            hits_when_back = sick.hits
            await wait_for(lambda: sick.hits, lambda n: n > hits_when_back + 3, timeout=5, what="traffic to b0")
        failed = watch.failed()
        print(f"out of rotation after {out_after:.2f}s, back after {back_after:.2f}s (bound "
              f"{UNHEALTHY * INTERVAL + 1:g}s); {len(watch.requests)} requests through Envoy, "
              f"{len(failed)} failed")  # fmt: skip
        assert len(watch.requests) >= 50 and failed == [], watch.summary("health checks")
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
            metrics = await r.text()
        assert 'eds_health_checks_total{kind="http",result="fail"}' in metrics
        assert 'eds_health_endpoints{health="healthy"} 3.0' in metrics
        assert await envoy.update_rejected("web") == 0
