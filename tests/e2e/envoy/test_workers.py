"""`--workers 2` with real Envoys: connections spread over both workers, every Envoy gets every
change, a worker killed with SIGKILL empties no cluster and changes no version, and once restarted
it gets its share of the streams back while the summed counters never go back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality
from prometheus_client.parser import text_string_to_metric_families

from eds_server.sources.relay import DELTA_PATH, decode_response, encode_request
from eds_server.transport.h2 import PassThroughCodec
from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import EdsCluster, envoy_bootstrap, envoy_fleet
from tests.support.fault_watch import FaultWatch
from tests.support.ports import bindable, free_port
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
    bootstraps = [
        envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"}, node_id=f"envoy-{i}")
        for i in range(ENVOYS)
    ]
    async with envoy_fleet(bootstraps) as envoys:
        for envoy in envoys:
            await envoy.wait_for(lambda e=envoy: e.hosts("web"), lambda h: len(h) == 2)
        write_atomically(path, upstreams(backends))
        changed = (await wait_for(lambda: server.admin("/v1/groups/web"), lambda g: g["version"] != version))["version"]
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
    bootstraps = [
        envoy_bootstrap(
            server.port,
            [EdsCluster("web", api_type="DELTA_GRPC")],
            free_port(),
            routes={"/": "web"},
            node_id=f"envoy-{i}",
            xds_retry_back_off={"base_interval": "0.2s", "max_interval": "1s"},
        )
        for i in range(ENVOYS)
    ]
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
            await wait_for(lambda: streams(server), lambda s: any(x["node"] == node for x in s), timeout=10)
        assert watch.failed_while_backends_up() == []
        assert min(s.hosts for s in watch.samples if s.hosts is not None) == 2  # never emptied
        assert await envoy.version_text("web") == version
        assert (await envoy.stats(updates))[updates] == before  # nothing sent again
        stats = await wait_for(
            lambda: server.admin("/v1/stats"), lambda s: all(w["alive"] for w in s["workers"]), timeout=10
        )
        assert sum(w["restarts"] for w in stats["workers"]) == 1
        assert "killed by signal 9" in server.log_text()


async def _metrics(server: EdsServerProcess) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
        return await r.text()


def counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and histogram sample of an exposition (the series that may only go up)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("counter", "histogram"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.fast_path  # the stock path cannot send one connection GOAWAY: load comes back as Envoys reconnect
async def test_a_restarted_worker_gets_load_back_and_summed_counters_never_go_back(
    two_workers: tuple[EdsServerProcess, Path], backends: list[Backend]
) -> None:
    server, _ = two_workers
    envoys_n, clusters = (
        4,
        [EdsCluster("web"), EdsCluster("web-b", service_name="web"), EdsCluster("web-c", service_name="web")],
    )
    bootstraps = [
        envoy_bootstrap(
            server.port,
            clusters,
            free_port(),
            routes={"/": "web"},
            node_id=f"envoy-{i}",
            xds_retry_back_off={"base_interval": "0.2s", "max_interval": "1s"},
        )
        for i in range(envoys_n)
    ]
    scrapes: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]] = []

    async def scrape(stop: asyncio.Event) -> None:
        for _ in range(600):  # bounded: 0.1 s apart at most 60 s
            scrapes.append(counters(await _metrics(server)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
                return

    async with envoy_fleet(bootstraps) as envoys:
        for envoy in envoys:
            await envoy.wait_for(lambda e=envoy: e.hosts("web"), lambda h: len(h) == 2)
        await wait_for(lambda: streams(server), lambda s: len(s) == envoys_n * len(clusters))
        versions = [await e.version_text("web") for e in envoys]
        stats = await server.admin("/v1/stats")
        victim = max(stats["workers"], key=lambda w: w["streams_open"])
        stop = asyncio.Event()
        scraper = asyncio.create_task(scrape(stop))
        async with contextlib.AsyncExitStack() as stack:
            watches = [
                await stack.enter_async_context(FaultWatch(e, server, backends=[b.port for b in backends[:2]]))
                for e in envoys
            ]
            os.kill(victim["pid"], signal.SIGKILL)
            # restarted, then given load back: the streams end up even (6 and 6)
            stats = await wait_for(
                lambda: server.admin("/v1/stats"),
                lambda s: (
                    sorted(w["streams_open"] or 0 for w in s["workers"]) == [6, 6]
                    and all(w["alive"] for w in s["workers"])
                ),
                timeout=40,
            )
        stop.set()
        await scraper
        for watch in watches:
            assert watch.failed_while_backends_up() == []
            assert min(s.hosts for s in watch.samples if s.hosts is not None) == 2  # never emptied
        for envoy, version in zip(envoys, versions, strict=True):
            assert await envoy.version_text("web") == version
            assert await envoy.update_rejected("web") == 0
    restarts = [w["restarts"] for w in stats["workers"]]
    assert sorted(restarts) == [0, 1]
    # moved by asking whole connections to reconnect: all six streams at once (2 connections), or in
    # rounds when some of the dead worker's Envoys came back only after the restart (a busy host)
    assert re.search(r"asked [12] connections \([36] streams\) to reconnect elsewhere", server.log_text())
    # every summed counter, scraped across the restart, only went up (rate() holds)
    assert len(scrapes) > 5
    for before, after in itertools.pairwise(scrapes):
        went_back = {k: (before[k], after.get(k)) for k in before if after.get(k, -1.0) < before[k]}
        assert went_back == {}
    assert scrapes[-1][("eds_worker_restarts_total", (("worker", str(victim["worker"])),))] == 1.0


async def test_an_owner_killed_while_a_worker_restarts_leaves_the_port_to_the_next_server(
    tmp_path: Path, backends: list[Backend]
) -> None:
    """The orphan that black-holed Envoys: the owner killed while a restarted worker is starting.
    Nothing of it survives, and a new eds-server on the same port serves an Envoy started afterwards."""
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams(backends[:2]))
    server = EdsServerProcess(path, "--workers", "2", workdir=tmp_path)
    await server.start()
    assert server.proc is not None
    pids = [w["pid"] for w in (await server.admin("/v1/stats"))["workers"]]
    os.kill(pids[0], signal.SIGKILL)
    await wait_for(lambda: server.log_text().count(" starting (pid ") == 3, timeout=10, what="the worker restarting")
    server.proc.send_signal(signal.SIGKILL)
    await server.proc.wait()
    await wait_for(lambda: bindable(server.port), timeout=10, what="the port free")
    await server.start()  # the same ports
    bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
    async with envoy_fleet([bootstrap]) as (envoy,):
        await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
        async with FaultWatch(envoy, server, backends=[b.port for b in backends[:2]]) as watch:
            await wait_for(lambda: _count(watch), lambda n: n >= 20, timeout=20, what="20 requests")
        assert watch.requests and watch.failed_while_backends_up() == []
    assert await server.stop() == 0


async def _count(watch: FaultWatch) -> int:
    return len(watch.requests)


async def test_sighup_under_traffic_restarts_nothing_and_fails_no_request(
    two_workers: tuple[EdsServerProcess, Path], backends: list[Backend]
) -> None:
    """SIGHUP once killed the owner and orphaned its workers; now it only reloads."""
    server, _ = two_workers
    assert server.proc is not None
    bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
    async with envoy_fleet([bootstrap]) as (envoy,):
        await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
        version = await envoy.version_text("web")
        pids = [w["pid"] for w in (await server.admin("/v1/stats"))["workers"]]
        async with FaultWatch(envoy, server, backends=[b.port for b in backends[:2]]) as watch:
            for _ in range(3):
                server.proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.3)
            await wait_for(
                lambda: server.log_text().count("SIGHUP: nothing to reload") == 6,
                timeout=10,
                what="each worker's reload line, three times",
            )
            await wait_for(lambda: _count(watch), lambda n: n >= 20, timeout=20, what="20 requests")
        assert watch.failed_while_backends_up() == []
        assert min(s.hosts for s in watch.samples if s.hosts is not None) == 2
        assert await envoy.version_text("web") == version
        assert [w["pid"] for w in (await server.admin("/v1/stats"))["workers"]] == pids
