"""Docker discovery end to end: a real engine, labelled containers, eds-server and a real Envoy.

Containers use host networking and serve on 127.0.0.1 ports; nothing talks to bridge addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.docker_engine import DockerEngine, arun_backend
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, Host, envoy_bootstrap
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.envoy]


@dataclass
class Stack:
    engine: DockerEngine
    server: EdsServerProcess
    envoy: EnvoyProcess

    async def hosts(self, cluster: str = "web") -> dict[int, Host]:
        return {h.port: h for h in await self.envoy.hosts(cluster)}

    async def wait_hosts(self, check: object, cluster: str = "web", timeout: float = 10.0) -> dict[int, Host]:
        return await self.envoy.wait_for(lambda: self.hosts(cluster), check, timeout=timeout)  # type: ignore[arg-type]

    async def backend(self, name: str, labels: dict[str, str] | None = None, **kwargs: object) -> int:
        port = free_port()
        await arun_backend(
            self.engine, name, port, {"eds.group": "web", "eds.port": str(port), **(labels or {})}, **kwargs
        )
        return port

    async def docker(self, *args: str) -> str:
        return await self.engine.acli(*args)


@contextlib.asynccontextmanager
async def _stack(engine: DockerEngine, tmp_path: Path, upstreams: Path | None = None) -> AsyncIterator[Stack]:
    async with EdsServerProcess(upstreams, "--docker", "--docker-host", engine.host, workdir=tmp_path) as server:
        bootstrap = envoy_bootstrap(
            server.port,
            [EdsCluster("web"), EdsCluster("api-cluster", service_name="api")],
            free_port(),
            routes={"/api": "api-cluster", "/": "web"},
        )
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live()
            yield Stack(engine, server, envoy)
            for cluster in ("web", "api-cluster"):
                assert await envoy.update_rejected(cluster) == 0


@pytest.fixture
async def stack(docker_cleanup: DockerEngine, tmp_path: Path) -> AsyncIterator[Stack]:
    async with _stack(docker_cleanup, tmp_path) as s:
        yield s


async def test_lifecycle_with_real_traffic(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    early = free_port()  # running before eds-server starts
    await arun_backend(docker_cleanup, "web-early", early, {"eds.group": "web", "eds.port": str(early)})
    async with _stack(docker_cleanup, tmp_path) as s:
        assert set(await s.hosts()) == {early}
        assert (await s.hosts())[early].health == "HEALTHY"
        assert (await s.hosts())[early].hostname == "web-early"
        late = await s.backend("web-late")
        await s.wait_hosts(lambda h: set(h) == {early, late})
        assert {(await s.envoy.get("/"))[1] for _ in range(6)} == {"web-early", "web-late"}

        drainer = await s.backend("web-drain", drain_seconds=3)
        await s.wait_hosts(lambda h: drainer in h)
        stop = asyncio.create_task(s.docker("stop", "-t", "10", "web-drain"))
        await s.wait_hosts(lambda h: h.get(drainer) is not None and h[drainer].health == "DRAINING")
        await stop
        await s.wait_hosts(lambda h: drainer not in h)

        await s.docker("kill", "web-late")
        await s.wait_hosts(lambda h: set(h) == {early})
        assert {(await s.envoy.get("/"))[1] for _ in range(3)} == {"web-early"}


async def test_health_checks_and_pause(stack: Stack) -> None:
    port = await stack.backend("web-hc", health_cmd="test -f /healthy", wait_ready=True)
    await stack.wait_hosts(lambda h: h.get(port) is not None and h[port].health == "UNHEALTHY")
    await stack.docker("exec", "web-hc", "touch", "/healthy")
    await stack.wait_hosts(lambda h: h.get(port) is not None and h[port].health == "HEALTHY")
    await stack.docker("pause", "web-hc")
    await stack.wait_hosts(lambda h: h[port].health == "UNHEALTHY")
    await stack.docker("unpause", "web-hc")
    await stack.wait_hosts(lambda h: h[port].health == "HEALTHY")


async def test_starting_container_is_left_out_until_healthy(stack: Stack) -> None:
    port = await stack.backend(
        "web-slow",
        health_cmd="test -f /healthy",
        extra_args=["--health-start-period", "30s", "--health-retries", "1000"],
    )
    await asyncio.sleep(1.0)  # several health checks have failed, but it is still "starting"
    assert port not in await stack.hosts()
    await stack.docker("exec", "web-slow", "touch", "/healthy")
    await stack.wait_hosts(lambda h: h.get(port) is not None and h[port].health == "HEALTHY")


async def test_labels_and_two_groups_from_one_container(stack: Stack) -> None:
    api_port = free_port()  # its second port, in group "api" (no traffic is sent there)
    port = await stack.backend(
        "web-rich",
        {
            "eds.group": "web,api",
            "eds.weight": "3",
            "eds.region": "eu",
            "eds.zone": "eu-1a",
            "eds.priority": "1",
            "eds.metadata.version": "v2",
            "eds.api.port": str(api_port),
            "eds.api.weight": "7",
        },
    )
    web = (await stack.wait_hosts(lambda h: port in h))[port]
    assert (web.weight, tuple(web.locality), web.priority) == (3, ("eu", "eu-1a", ""), 1)
    api = (await stack.wait_hosts(lambda h: api_port in h, cluster="api-cluster"))[api_port]
    assert (api.weight, api.priority) == (7, 1)
    groups = {g["name"]: g for g in (await stack.server.admin("/v1/groups"))["groups"]}
    assert groups["web"]["endpoints"][0]["metadata"] == {"version": "v2"}


async def test_bad_label_skips_only_that_container(stack: Stack) -> None:
    good = await stack.backend("web-good")
    await stack.backend("web-bad", {"eds.weight": "heavy"})
    await stack.wait_hosts(lambda h: set(h) == {good})
    warning = "container web-bad: label eds.weight: 'heavy' is not a weight"
    await wait_for(lambda: warning in stack.server.log_text(), timeout=5, what="the warning (the container seen)")
    assert "container web-bad: label eds.weight: 'heavy' is not a weight" in stack.server.log_text()
    assert set(await stack.hosts()) == {good}


async def test_engine_restart_keeps_endpoints_then_converges(stack: Stack) -> None:
    first = await stack.backend("web-1")
    await stack.wait_hosts(lambda h: set(h) == {first})
    await asyncio.to_thread(stack.engine.stop)  # --live-restore: the container keeps running
    body = await wait_for(
        lambda: stack.server.admin("/v1/groups"),
        lambda b: b["groups"] and b["groups"][0]["stale"],
        timeout=10,
        interval=0.1,
        what="the group stale",
    )
    groups = body["groups"]
    assert groups[0]["stale"] and [e["port"] for e in groups[0]["endpoints"]] == [first]
    assert set(await stack.hosts()) == {first}  # Envoy keeps routing meanwhile
    assert (await stack.envoy.get("/"))[1] == "web-1"
    await asyncio.to_thread(stack.engine.start)
    second = await stack.backend("web-2")
    await stack.wait_hosts(lambda h: set(h) == {first, second}, timeout=15)
    groups = (await stack.server.admin("/v1/groups"))["groups"]
    assert not groups[0]["stale"]


@contextlib.asynccontextmanager
async def _web_from_file_and_docker(
    engine: DockerEngine, tmp_path: Path
) -> AsyncIterator[tuple[Stack, Path, int, int]]:
    """Group "web": one endpoint from the upstreams file, one from a container; Envoy has both.
    Yields the stack, the file, the file's port and the container's."""
    fixed = free_port()
    path = tmp_path / "upstreams.yaml"
    path.write_text(f"groups:\n  web:\n    endpoints: [127.0.0.1:{fixed}]\n")
    async with _stack(engine, tmp_path, upstreams=path) as s:
        port = await s.backend("web-dyn")
        await s.wait_hosts(lambda h: set(h) == {fixed, port})
        yield s, path, fixed, port


async def test_file_and_docker_feed_one_group(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    async with _web_from_file_and_docker(docker_cleanup, tmp_path) as (s, path, _, _):
        sources = {g["name"]: g["sources"] for g in (await s.server.admin("/v1/groups"))["groups"]}
        assert sources["web"] == [f"file:{path}", "docker"]


async def test_one_group_says_which_source_gave_each_endpoint(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    async with _web_from_file_and_docker(docker_cleanup, tmp_path) as (s, path, fixed, port):
        web = await s.server.admin("/v1/groups/web")
        assert {e["port"]: e["source"] for e in web["endpoints"]} == {fixed: f"file:{path}", port: "docker"}
