"""`--workers 2` with real Envoys: connections spread over both workers, every Envoy gets every
change, and a worker killed with SIGKILL empties no cluster and changes no version."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality

from eds_server.sources.relay import DELTA_PATH, decode_response, encode_request
from eds_server.transport.h2 import PassThroughCodec
from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import EdsCluster, envoy_bootstrap, envoy_fleet
from tests.support.fault_watch import FaultWatch
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, write_atomically
from tests.support.waiting import wait_for

pytestmark = pytest.mark.envoy
ENVOYS = 3


def upstreams(backends: list[Backend]) -> str:
    return "groups:\n  web:\n    endpoints:\n" + "".join(f"      - 127.0.0.1:{b.port}\n" for b in backends)


@pytest.fixture
async def backends() -> AsyncIterator[list[Backend]]:
    async with http_backends(3) as started:
        yield started


@pytest.fixture
async def two_workers(tmp_path: Path, backends: list[Backend]) -> AsyncIterator[tuple[EdsServerProcess, Path]]:
    """eds-server --workers 2 serving web: the first two backends."""
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams(backends[:2]))
    async with EdsServerProcess(path, "--workers", "2", workdir=tmp_path) as server:
        yield server, path


async def streams(server: EdsServerProcess) -> list[dict[str, object]]:
    return list((await server.admin("/v1/streams?limit=1000"))["streams"])


@contextlib.asynccontextmanager
async def delta_clients(port: int, count: int) -> AsyncIterator[list[str]]:
    """`count` plain delta clients, one connection each, following web; yields the versions they got."""
    channels = [Channel("127.0.0.1", port, codec=PassThroughCodec()) for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        versions = []
        for i, channel in enumerate(channels):
            stack.callback(channel.close)
            stream = await stack.enter_async_context(
                channel.request(DELTA_PATH, Cardinality.STREAM_STREAM, bytes, bytes)
            )
            stack.push_async_callback(stream.cancel)
            await stream.send_message(encode_request(f"client-{i}", subscribe=["web"], node=True))
            received = decode_response(await asyncio.wait_for(stream.recv_message(), 10))
            versions.extend(v for _, v, _ in received.resources)
        yield versions


async def test_connections_land_on_both_workers_and_every_envoy_gets_every_change(
    two_workers: tuple[EdsServerProcess, Path], backends: list[Backend]
) -> None:
    server, path = two_workers
    version = (await server.admin("/v1/groups/web"))["version"]
    # 20 connections: the kernel hashes each to a worker; all on one would be a 1 in 500,000 chance
    async with delta_clients(server.port, 20) as versions:
        assert set(versions) == {version}  # the owner's version, from whichever worker
        shown = await streams(server)
        assert {s["worker"] for s in shown} == {1, 2}
        stats = await server.admin("/v1/stats")
        assert stats["streams_open"] == 20 and sum(w["streams_open"] for w in stats["workers"]) == 20
    bootstraps = [envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"},
                                  node_id=f"envoy-{i}") for i in range(ENVOYS)]  # fmt: skip
    async with envoy_fleet(bootstraps) as envoys:
        for envoy in envoys:
            await envoy.wait_for(lambda e=envoy: e.hosts("web"), lambda h: len(h) == 2)
        write_atomically(path, upstreams(backends))
        changed = (await wait_for(lambda: server.admin("/v1/groups/web"),
                                  lambda g: g["version"] != version))["version"]  # fmt: skip
        for envoy in envoys:
            await envoy.wait_for(lambda e=envoy: e.hosts("web"), lambda h: len(h) == 3, timeout=5)
            assert await envoy.update_rejected("web") == 0
        metrics = await _metrics(server)
        assert f'eds_group_info{{group="web",version="{changed}"}} 1.0' in metrics
        assert "eds_workers_alive 2.0" in metrics
        assert 'eds_streams_open{transport="sotw"} 3.0' in metrics  # the Envoys', not the workers' links
    pids = [w["pid"] for w in (await server.admin("/v1/stats"))["workers"]]
    assert await server.stop() == 0  # the owner drains its workers, then stops
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_killed_worker_empties_no_cluster_and_its_envoys_come_back(
    two_workers: tuple[EdsServerProcess, Path], backends: list[Backend]
) -> None:
    server, _ = two_workers
    bootstraps = [envoy_bootstrap(server.port, [EdsCluster("web", api_type="DELTA_GRPC")], free_port(),
                                  routes={"/": "web"}, node_id=f"envoy-{i}",
                                  xds_retry_back_off={"base_interval": "0.2s", "max_interval": "1s"})
                  for i in range(ENVOYS)]  # fmt: skip
    async with envoy_fleet(bootstraps) as envoys:
        for envoy in envoys:
            await envoy.wait_for(lambda e=envoy: e.hosts("web"), lambda h: len(h) == 2)
        shown = await wait_for(lambda: streams(server), lambda s: len(s) == ENVOYS)
        victim_index = int(shown[0]["worker"])  # type: ignore[call-overload]
        node = shown[0]["node"]
        envoy = envoys[int(str(node).rsplit("-", 1)[1])]
        version = await envoy.version_text("web")
        updates = "cluster.web.update_success"
        before = (await envoy.stats(updates))[updates]
        pid = next(w["pid"] for w in (await server.admin("/v1/stats"))["workers"] if w["worker"] == victim_index)
        async with FaultWatch(envoy, server, backends=[b.port for b in backends[:2]]) as watch:
            os.kill(pid, signal.SIGKILL)
            # its Envoy reconnects, to the other worker or the restarted one
            await wait_for(lambda: streams(server),
                           lambda s: any(x["node"] == node for x in s), timeout=10)  # fmt: skip
        assert watch.failed_while_backends_up() == []
        assert min(s.hosts for s in watch.samples if s.hosts is not None) == 2  # never emptied
        assert await envoy.version_text("web") == version
        assert (await envoy.stats(updates))[updates] == before  # nothing sent again
        stats = await wait_for(lambda: server.admin("/v1/stats"),
                               lambda s: all(w["alive"] for w in s["workers"]), timeout=10)  # fmt: skip
        assert sum(w["restarts"] for w in stats["workers"]) == 1
        assert "killed by signal 9" in server.log_text()


async def _metrics(server: EdsServerProcess) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
        return await r.text()
