"""Big legitimate deployments are served in full: one Envoy with 1,500 EDS clusters, and 20 Envoys
of 80 clusters each, all from 127.0.0.1 (as behind one NAT address), over SotW and delta gRPC.

Per-IP HTTP/2 budgets exist to stop hostile clients (docs/limits.md); these tests hold them to not
locking out a big honest one. Each case runs with eds-server's default limits and checks, from
Envoy's admin and eds-server's, that every cluster gets its endpoints on a cold start within
COLD_START seconds with no GOAWAY, and that a restart of eds-server on the same port never empties
a cluster and gets every stream back within RESTART seconds.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.envoy_harness import ApiType, EdsCluster, EnvoyProcess, envoy_binary, envoy_bootstrap, envoy_fleet
from tests.support.server_process import EdsServerProcess

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

COLD_START = 30.0  # seconds for every cluster to get its endpoints, from the Envoys' start
RESTART = 30.0  # seconds for every stream to be back after eds-server restarts
POLL = 0.5  # seconds between looks at the Envoys' admin: each look costs Envoy's main thread
# What an operator with more than 1,024 EDS clusters on one api_config_source sets on the xDS cluster
# (docs/envoy.md "More than 1,024 EDS clusters"): each gRPC stream is a request on it, and until the HTTP/2
# connection is up each is a pending one; Envoy's defaults (1,024 each) reset the rest locally.
XDS_BREAKERS = {"max_requests": 100_000, "max_pending_requests": 100_000}
# Envoy re-establishes each xDS stream after a fully jittered backoff doubling from 0.5 s up to 30 s. Over
# eds-server's restart (1-6 s to stop, its listener closed from the first moment, ~1 s to start) each
# stream fails several times, and with that default the last of 1,600 came back 8-29 s after the start:
# time Envoy spent asleep. Capped at 5 s, 5-7 s; so RESTART measures eds-server, not Envoy's dice.
XDS_BACK_OFF = {"base_interval": "0.5s", "max_interval": "5s"}
# what eds-server logs when it turns a client away: GOAWAY, streams reset or refused, connections
# refused or closed for opening no stream
TURNED_AWAY = re.compile(r"GOAWAY|ENHANCE_YOUR_CALM|RST_STREAM|refus|no stream opened", re.IGNORECASE)

API_TYPES = [pytest.param("GRPC", id="sotw"), pytest.param("DELTA_GRPC", id="delta")]


def write_upstreams(path: Path, groups: int) -> None:
    """Groups c0..c{n-1}, each one endpoint of its own port on 127.0.0.1 (nothing listens: Envoy does
    not health check these, and a distinct port tells each group's endpoint from the others')."""
    path.write_text("groups:\n" + "".join(f"  c{i}:\n    endpoints: [127.0.0.1:{10000 + i}]\n" for i in range(groups)))


def bootstraps(server: EdsServerProcess, envoys: int, clusters: int, api: ApiType) -> list[dict[str, object]]:
    """`envoys` bootstraps of `clusters` EDS clusters c0.. each, named alike: replicas of one proxy
    config, as a fleet of identical Envoys on one host is; each with a node id of its own."""
    return [
        envoy_bootstrap(
            server.port,
            [EdsCluster(f"c{i}", api_type=api) for i in range(clusters)],
            xds_circuit_breakers=XDS_BREAKERS,
            xds_retry_back_off=XDS_BACK_OFF,
            node_id=f"big-{n}",
        )
        for n in range(envoys)
    ]


async def served(envoys: Sequence[EnvoyProcess], clusters: int) -> int:
    """Clusters, over all the Envoys, that hold one endpoint (their group has one); one cheap look at each
    admin, so it can be repeated while Envoy is busy."""
    looks = await asyncio.gather(*(e.members(r"c\d+") for e in envoys))
    return sum(1 for members in looks for i in range(clusters) if members.get(f"c{i}") == 1)


async def streams_open(server: EdsServerProcess) -> int:
    return int((await server.admin("/v1/streams?limit=1"))["total"])


async def wait_all_served(envoys: Sequence[EnvoyProcess], clusters: int, start: float, timeout: float) -> float:
    """Seconds from `start` until every cluster of every Envoy has its endpoint, or AssertionError with
    how many had."""
    want, got = len(envoys) * clusters, -1
    for _ in range(int(timeout / POLL) + 1):  # bounded in count and (each look is) in time
        got = await asyncio.wait_for(served(envoys, clusters), timeout=10)
        if got == want or time.monotonic() - start > timeout:
            break
        await asyncio.sleep(POLL)
    elapsed = time.monotonic() - start
    assert got == want and elapsed <= timeout, f"{got} of {want} clusters served after {elapsed:.1f}s"
    return elapsed


def turned_away(log: str) -> str:
    """How many log lines turned a client away, and the first few: what a failure shows."""
    lines = [line for line in log.splitlines() if TURNED_AWAY.search(line)]
    return f"{len(lines)} log lines turning clients away" + "".join(f"\n  {line}" for line in lines[:5])


async def streams_per_connection(server: EdsServerProcess) -> list[int]:
    """Streams eds-server holds on each client connection (peer address and port), most first."""
    peers: Counter[str] = Counter()
    after = 0
    for _ in range(100):  # bounded: 100 pages of 1,000 streams
        page = await server.admin(f"/v1/streams?limit=1000&after={after}")
        peers.update(str(stream["peer"]) for stream in page["streams"])
        if page["next_after"] is None:
            break
        after = page["next_after"]
    return sorted(peers.values(), reverse=True)


async def connections(server: EdsServerProcess, envoys: Sequence[EnvoyProcess]) -> str:
    """For the record: the HTTP/2 connections each Envoy has open to eds-server and has opened so far,
    and the streams and connections eds-server holds."""
    key = "cluster.xds_cluster.upstream_cx_"
    looks = await asyncio.gather(*(e.stats(rf"^{re.escape(key)}(active|total)$") for e in envoys))
    per_envoy = " ".join(f"{look[key + 'active']}/{look[key + 'total']}" for look in looks)
    stats, spread = await server.admin("/v1/stats"), await streams_per_connection(server)
    return (
        f"Envoy xDS connections open/opened {per_envoy}; eds-server {stats['streams_open']} streams on"
        f" {stats['connections_open']} connections, per connection {spread}"
    )


def refusals(stats: dict[str, Any]) -> dict[str, int]:
    """The non-zero counters of /v1/stats that count clients turned away, whichever the server reports:
    connections calmed (GOAWAY) or refused, streams refused or denied, and `refused_by_reason`."""
    counts = {key: stats.get(key, 0) for key in ("calmed", "connections_refused", "timed_out", "refused", "denied")}
    counts |= stats.get("refused_by_reason", {})
    return {key: value for key, value in counts.items() if value}


async def assert_nobody_turned_away(server: EdsServerProcess, log: str) -> None:
    counted = refusals(await server.admin("/v1/stats"))
    assert not counted, f"eds-server turned away {counted}; {turned_away(log)}"
    assert not TURNED_AWAY.search(log), turned_away(log)


async def cold_start(server: EdsServerProcess, envoys: Sequence[EnvoyProcess], clusters: int, start: float) -> None:
    """Every cluster has its endpoint within COLD_START of `start` (when the Envoys were started), every
    stream is open on eds-server, and nobody was turned away."""
    try:
        took = await wait_all_served(envoys, clusters, start, COLD_START)
    except AssertionError as e:
        stats = await server.admin("/v1/stats")
        e.add_note(
            f"eds-server: {stats['streams_open']} streams open, turned away {refusals(stats)};"
            f" {turned_away(server.log_text())}"
        )
        raise
    print(f"\ncold start: {len(envoys) * clusters} clusters served in {took:.1f}s; {await connections(server, envoys)}")
    assert await streams_open(server) == len(envoys) * clusters
    await assert_nobody_turned_away(server, server.log_text())
    for envoy in envoys:  # and each its own group's endpoint, once, with the full (dearer) look
        ports = {
            c["name"]: [h["address"]["socket_address"]["port_value"] for h in c.get("host_statuses", [])]
            for c in (await envoy.clusters())["cluster_statuses"]
        }
        assert all(ports[f"c{i}"] == [10000 + i] for i in range(clusters)), envoy.bootstrap["node"]


async def restart(server: EdsServerProcess, envoys: Sequence[EnvoyProcess], clusters: int) -> None:
    """eds-server stopped and started again on the same port: no cluster of any Envoy is ever seen
    without its endpoint meanwhile, and every stream is back within RESTART, nobody turned away."""
    want, log_before = len(envoys) * clusters, len(server.log_text())
    looks: list[int] = []  # clusters served, per look during the restart
    done = asyncio.Event()

    async def watch() -> None:
        for _ in range(int((RESTART + 30) / POLL)):  # bounded; ends once the streams are back
            looks.append(await asyncio.wait_for(served(envoys, clusters), timeout=10))
            if done.is_set():
                return
            await asyncio.sleep(POLL)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.sleep(POLL)
        stopping = time.monotonic()
        assert await server.stop() == 0
        started = time.monotonic()
        await server.start()
        ready = time.monotonic() - started
        took, streams, counts = 0.0, 0, []
        for _ in range(int(RESTART / POLL) + 1):  # bounded
            streams, took = await streams_open(server), time.monotonic() - started
            counts.append(f"{took:.0f}s:{streams}")
            if streams == want or took > RESTART:
                break
            await asyncio.sleep(POLL)
        done.set()
        await asyncio.wait_for(watcher, timeout=15)
    finally:
        watcher.cancel()
    log = server.log_text()[log_before:]
    print(f"restart: stopped in {started - stopping:.1f}s, ready {ready:.1f}s after the start; streams {counts}")
    print(
        f"restart: {streams} of {want} streams back in {took:.1f}s; clusters served, fewest in"
        f" {len(looks)} looks: {min(looks)}; {await connections(server, envoys)}"
    )
    assert min(looks) == want, f"a cluster lost its endpoints during the restart: {min(looks)} of {want} served"
    assert streams == want and took <= RESTART, f"{streams} of {want} streams back in {took:.1f}s; {turned_away(log)}"
    await assert_nobody_turned_away(server, log)
    assert await served(envoys, clusters) == want


async def serve_in_full(tmp_path: Path, api: ApiType, envoys: int, clusters: int) -> None:
    """eds-server with default limits, `envoys` Envoys of `clusters` clusters each: cold start, restart."""
    write_upstreams(tmp_path / "upstreams.yaml", clusters)
    async with EdsServerProcess(tmp_path / "upstreams.yaml") as server:
        boots, start = bootstraps(server, envoys, clusters, api), time.monotonic()
        async with envoy_fleet(boots) as fleet:
            await cold_start(server, fleet, clusters, start)
            await restart(server, fleet, clusters)
            print(f"whole case {time.monotonic() - start:.1f}s from the Envoys' start")


@pytest.mark.parametrize("api", API_TYPES)
async def test_one_envoy_with_1500_clusters(tmp_path: Path, api: ApiType) -> None:
    await serve_in_full(tmp_path, api, envoys=1, clusters=1500)


@pytest.mark.parametrize("api", API_TYPES)
async def test_twenty_envoys_of_80_clusters_from_one_address(tmp_path: Path, api: ApiType) -> None:
    await serve_in_full(tmp_path, api, envoys=20, clusters=80)
