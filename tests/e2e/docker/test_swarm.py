"""SwarmSource against a real single-node Swarm on a private engine, and through the command line to
a real Envoy. Services use host networking on 127.0.0.1 ports (the tests look at the store, and Envoy
routes to loopback only); the rules themselves are pinned on recorded JSON in
unit/sources/test_swarm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Health
from eds_server.sources.containers import DockerOptions
from eds_server.sources.swarm import SwarmSource
from eds_server.store import Store
from tests.support.docker_engine import DockerEngine, backend_script
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.feeds import alone
from tests.support.hung_peer import HUNG_WAIT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for

OPTS = DockerOptions()


Check = Callable[[dict[int, Endpoint]], bool]


class Harness:
    def __init__(self, engine: DockerEngine, store: Store, source: SwarmSource) -> None:
        self.engine, self.store, self.source = engine, store, source

    def endpoints(self, group: str = "web") -> dict[int, Endpoint]:
        res = self.store.resources().get(group)
        return {e.port: e for e in res.group.endpoints} if res else {}

    async def wait(self, check: Check, group: str = "web", timeout: float = 30.0) -> dict[int, Endpoint]:
        return await wait_for(
            lambda: self.endpoints(group), check, timeout=timeout, interval=0.1, what=f"the endpoints of {group}"
        )

    async def service(self, name: str, port: int, *args: str, drain: float = 0, group: str = "web") -> str:
        return await self.engine.acli(
            "service",
            "create",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "--label",
            f"eds.group={group}",
            "--label",
            f"eds.port={port}",
            "--stop-grace-period",
            "20s",
            *args,
            self.engine.image,
            "sh",
            "-c",
            backend_script(name, port, drain_seconds=drain),
            timeout=60,
        )

    async def docker(self, *args: str) -> str:
        return await self.engine.acli(*args, timeout=60)


@contextlib.asynccontextmanager
async def _harness(engine: DockerEngine) -> AsyncIterator[Harness]:
    store = Store(encode_group)
    source = alone(
        SwarmSource, store, OPTS, host=engine.host, resync_interval=30.0, ping_interval=1.0, request_timeout=5.0
    )
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        yield Harness(engine, store, source)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_swarm_lifecycle(swarm: DockerEngine) -> None:
    early = free_port()
    async with _harness(swarm) as h:
        await h.service("web-early", early)  # created while the source starts
        await h.wait(lambda e: set(e) == {early})
        assert h.store.ready and h.endpoints()[early].address == "127.0.0.1"
        assert h.endpoints()[early].hostname == "web-early.1" and h.endpoints()[early].health == Health.HEALTHY

        # scale down to 0 (draining first: the task traps SIGTERM and lingers), then up again
        late = free_port()
        await h.service("web-late", late, drain=3)
        await h.wait(lambda e: set(e) == {early, late})
        scale = asyncio.create_task(h.docker("service", "scale", "-d", "web-late=0"))
        await h.wait(lambda e: late in e and e[late].health == Health.DRAINING)
        await scale
        await h.wait(lambda e: set(e) == {early})
        await h.docker("service", "scale", "-d", "web-late=1")
        await h.wait(lambda e: set(e) == {early, late} and e[late].health == Health.HEALTHY)

        # rolling update: labels change (weight), the old task drains, the new one takes over
        await h.docker("service", "update", "-d", "--label-add", "eds.weight=7", "--force", "web-late")
        await h.wait(lambda e: late in e and e[late].weight == 7 and e[late].health == Health.HEALTHY)

        # a new group via a service label update; a removed service goes
        await h.docker("service", "update", "-d", "--label-add", "eds.group=web,api", "web-early")
        await h.wait(lambda e: set(e) == {early}, group="api")
        await h.docker("service", "rm", "web-early")
        await h.wait(lambda e: set(e) == {late})
        await h.wait(lambda e: not e, group="api")


async def test_swarm_node_drain_and_active(swarm: DockerEngine) -> None:
    port = free_port()
    async with _harness(swarm) as h:
        await h.service("web-n", port, drain=2)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY)
        node = (await h.docker("node", "ls", "-q")).split()[0]
        await h.docker("node", "update", "--availability", "drain", node)
        await h.wait(lambda e: port in e and e[port].health == Health.DRAINING)
        await h.wait(lambda e: not e)
        await h.docker("node", "update", "--availability", "active", node)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY, timeout=45)


async def test_swarm_engine_restart(swarm: DockerEngine) -> None:
    port = free_port()
    async with _harness(swarm) as h:
        await h.service("web-r", port)
        await h.wait(lambda e: set(e) == {port})
        await asyncio.to_thread(swarm.stop)
        await wait_for(lambda: not h.source.connected, timeout=20, interval=0.1, what="the source disconnected")
        assert h.store.is_stale("web")
        assert set(h.endpoints()) == {port}  # the last known endpoints stay
        await asyncio.to_thread(swarm.start)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY, timeout=60)
        await wait_for(
            lambda: h.source.connected and not h.store.is_stale("web"),
            timeout=30,
            interval=0.1,
            what="the source connected and fresh",
        )


@pytest.mark.envoy
async def test_swarm_through_the_cli_to_a_real_envoy(swarm: DockerEngine, tmp_path: Path) -> None:
    """eds-server --swarm serving a real Envoy: traffic reaches the service's task; a scale-down drains it."""
    port = free_port()
    async with _harness(swarm) as h:  # only to create services the way the other tests do
        await h.service("web-envoy", port, drain=2)
    async with EdsServerProcess(None, "--swarm", "--docker-host", swarm.host, workdir=tmp_path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live(timeout=30)
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: [x.port for x in hs] == [port], timeout=30)
            _, body = await envoy.wait_for(lambda: envoy.get("/"), lambda r: r[0] == 200, timeout=15)
            assert body == "web-envoy"
            scale = asyncio.create_task(swarm.acli("service", "scale", "-d", "web-envoy=0", timeout=60))
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: not hs, timeout=30)
            await scale
            assert await envoy.update_rejected("web") == 0
        sources = {s["name"]: s for s in (await server.admin("/v1/sources"))["sources"]}
        assert sources["swarm"]["connected"] and sources["swarm"]["loaded"]


async def test_a_frozen_manager_is_found_within_the_bound_and_followed_again(swarm: DockerEngine) -> None:
    """The manager's dockerd and containerd SIGSTOPped (Swarm shares the Docker source's heartbeat):
    stale within the bound with the endpoints kept, followed again after SIGCONT."""
    port = free_port()
    async with _harness(swarm) as h:
        await h.service("web-frozen", port)
        await h.wait(lambda e: set(e) == {port} and e[port].health == Health.HEALTHY)
        await wait_for(lambda: h.source.connected, lambda c: c, timeout=10, interval=0.1, what="following")
        with swarm.frozen():
            loop = asyncio.get_running_loop()
            frozen_at = loop.time()
            await wait_for(
                lambda: h.source.connected,
                lambda c: not c,
                timeout=HUNG_WAIT,
                interval=0.1,
                what="the frozen manager noticed",
            )
            print(f"\nstale {loop.time() - frozen_at:.1f} s after the freeze: {h.source.last_error}")
            assert h.store.is_stale("web") and set(h.endpoints()) == {port}
            assert "did not answer within 2 s, twice running" in str(h.source.last_error)  # the heartbeat's words
        await wait_for(lambda: h.source.connected, lambda c: c, timeout=30, interval=0.1, what="following again")
        assert not h.store.is_stale("web") and set(h.endpoints()) == {port}
        await h.docker("service", "rm", "web-frozen")
        await h.wait(lambda e: not e)


@pytest.mark.envoy
async def test_swarm_services_checked_by_their_labels(swarm: DockerEngine, tmp_path: Path) -> None:
    """eds.health.* labels on Swarm services: one service's path answers (healthy), the other's is
    missing (404, unhealthy after its threshold); Envoy sends everything to the healthy one."""
    good, bad = free_port(), free_port()
    check = ["--label", "eds.health.interval=500ms", "--label", "eds.health.unhealthy_threshold=2"]
    async with _harness(swarm) as h:
        await h.service("web-checked-ok", good, "--label", "eds.health.http=/index.html", *check)
        await h.service("web-checked-404", bad, "--label", "eds.health.http=/health", *check)
    async with EdsServerProcess(None, "--swarm", "--docker-host", swarm.host, workdir=tmp_path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live(timeout=30)
            hosts = await envoy.wait_for(
                lambda: envoy.hosts("web"),
                lambda hs: {x.port: x.health for x in hs} == {good: "HEALTHY", bad: "UNHEALTHY"},
                timeout=60,
            )
            assert len(hosts) == 2
            for _ in range(10):  # bounded
                status, body = await envoy.get("/")
                assert (status, body) == (200, "web-checked-ok")
        group = await server.admin("/v1/groups/web")
        reasons = {e["port"]: e["check"]["reason"] for e in group["endpoints"]}
        assert reasons == {good: "HTTP 200", bad: "HTTP 404"}, group
