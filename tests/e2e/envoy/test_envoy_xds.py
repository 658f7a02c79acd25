"""A real Envoy, subscribed over each transport (SotW gRPC, delta gRPC, REST), against eds-server run
through its command line."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import aiohttp
import pytest

from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import (
    SHIPPED_XDS_BACK_OFF,
    ApiType,
    EdsCluster,
    EnvoyProcess,
    Host,
    envoy_bootstrap,
)
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, write_atomically

pytestmark = pytest.mark.envoy

# After eds-server serves again, every Envoy stream is back within this: the shipped back-off's
# max_interval (2 s) with room for a loaded machine. Envoy's default (up to 30 s) overran it.
BACK_WITHIN = 5.0  # seconds: the shipped back-off tries at least every 2 s (twice that allowed a loaded host)
OUTAGE = 10.0  # long enough for Envoy's default back-off to reach 4-16 s between attempts


def upstreams_yaml(web: list[Backend], api: list[Backend]) -> str:
    lines = ["groups:", "  web:", "    endpoints:"]
    lines += [f"      - 127.0.0.1:{b.port}" for b in web]
    lines += ["  api:", "    endpoints:"]
    lines += [f"      - 127.0.0.1:{b.port}" for b in api]
    return "\n".join(lines) + "\n"


@pytest.fixture
async def backends() -> AsyncIterator[list[Backend]]:
    async with http_backends(3) as started:
        yield started


@pytest.fixture(params=["GRPC", "DELTA_GRPC", "REST"])
async def stack(
    request: pytest.FixtureRequest, tmp_path: Path, backends: list[Backend]
) -> AsyncIterator[tuple[EdsServerProcess, EnvoyProcess, Path]]:
    """eds-server serving web (backends 0, 1) and api (backend 2) to an Envoy with a listener."""
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams_yaml(backends[:2], backends[2:]))
    api: ApiType = request.param
    rest_port = free_port()
    async with EdsServerProcess(path, "--rest-listen", f"127.0.0.1:{rest_port}") as server:
        bootstrap = envoy_bootstrap(
            server.port,
            [
                EdsCluster("web", api_type=api),
                EdsCluster("api-cluster", service_name="api", api_type=api),
                EdsCluster("later", api_type=api),
            ],
            free_port(),
            routes={"/api": "api-cluster", "/later": "later", "/": "web"},
            rest_port=rest_port,
        )
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live()
            yield server, envoy, path
            for cluster in ("web", "api-cluster", "later"):
                assert await envoy.update_rejected(cluster) == 0
            if api != "REST":
                assert ("delta" if api == "DELTA_GRPC" else "sotw") + " stream opened" in server.log_text()


async def ports(envoy: EnvoyProcess, cluster: str) -> set[int]:
    return {h.port for h in await envoy.hosts(cluster)}


async def test_clusters_by_name_and_service_name(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    server, envoy, _ = stack
    assert await ports(envoy, "web") == {backends[0].port, backends[1].port}
    assert await ports(envoy, "api-cluster") == {backends[2].port}
    served = {g["name"]: g["version"] for g in (await server.admin("/v1/groups"))["groups"]}
    assert await envoy.version_text("web") == served["web"]
    assert await envoy.version_text("api-cluster") == served["api"]
    # a cluster with no group warms at once with no hosts, instead of waiting out the fetch timeout
    assert await envoy.hosts("later") == []
    assert (await envoy.stats("init_fetch_timeout")).get("cluster.later.init_fetch_timeout", 0) == 0


async def test_real_traffic_reaches_the_right_backends(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    _, envoy, _ = stack
    web_answers = {(await envoy.get("/"))[1] for _ in range(8)}
    assert web_answers == {backends[0].name, backends[1].name}
    assert {(await envoy.get("/api"))[1] for _ in range(4)} == {backends[2].name}
    status, _ = await envoy.get("/later")
    assert status == 503  # no endpoints: "no healthy upstream"


async def test_weight_locality_health_priority_hostname(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    _, envoy, path = stack
    b0, b1, b2 = (b.port for b in backends)
    write_atomically(
        path,
        f"""\
groups:
  web:
    endpoints:
      - address: 127.0.0.1
        port: {b0}
        weight: 3
        region: eu-west-1
        zone: eu-west-1a
        subzone: rack-1
        hostname: web-0
        metadata: {{version: v2, canary: true}}
      - address: 127.0.0.1
        port: {b1}
        health: draining
        priority: 1
  api:
    endpoints: [127.0.0.1:{b2}]
""",
    )
    hosts = await envoy.wait_for(
        lambda: envoy.hosts("web"),
        lambda hs: {h.port for h in hs} == {b0, b1} and any(h.weight == 3 for h in hs),
    )
    by_port: dict[int, Host] = {h.port: h for h in hosts}
    assert by_port[b0].weight == 3
    assert tuple(by_port[b0].locality) == ("eu-west-1", "eu-west-1a", "rack-1")
    assert by_port[b0].hostname == "web-0"
    assert by_port[b0].health == "HEALTHY"
    assert by_port[b1].health == "DRAINING"
    assert by_port[b1].priority == 1 and by_port[b0].priority == 0


async def test_live_edit_reaches_envoy_and_broken_edit_changes_nothing(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    server, envoy, path = stack
    before = await envoy.version_text("web")
    write_atomically(path, upstreams_yaml(backends[:1], backends[2:]))
    await envoy.wait_for(lambda: ports(envoy, "web"), lambda p: p == {backends[0].port})
    after = await envoy.version_text("web")
    assert after != before

    # a broken edit, written in place as a plain editor would: reported, nothing changes
    path.write_text(upstreams_yaml(backends[:1], backends[2:]) + "  bad:\n    endpoints: [nope:1]\n")
    # an in-place write can be read half-written first ("file is empty"): wait for the whole file's error
    await envoy.wait_for(
        lambda: server.admin("/v1/sources"),
        lambda s: "groups.bad.endpoints[0]" in (s["sources"][0]["last_error"] or ""),
    )
    assert "groups.bad.endpoints[0]" in server.log_text()
    assert await envoy.version_text("web") == after
    assert await ports(envoy, "web") == {backends[0].port}

    # the next good edit applies again
    path.write_text(upstreams_yaml(backends[:2], backends[2:]))
    await envoy.wait_for(lambda: ports(envoy, "web"), lambda p: len(p) == 2)
    assert await envoy.version_text("web") == before  # same content, same version


async def test_only_changed_groups_are_pushed(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    _, envoy, path = stack
    # update_success: responses Envoy applied (a REST poll answered 304 is an attempt, not a success)
    web_updates = (await envoy.stats("cluster.web.update_success"))["cluster.web.update_success"]
    write_atomically(path, upstreams_yaml(backends[:2], backends[1:]))
    await envoy.wait_for(lambda: ports(envoy, "api-cluster"), lambda p: len(p) == 2)
    # rewriting identical content is no change at all
    write_atomically(path, upstreams_yaml(backends[:2], backends[1:]))
    await asyncio.sleep(0.5)
    stats = await envoy.stats("cluster.web.update_success")
    assert stats["cluster.web.update_success"] == web_updates


async def test_group_removed_and_added_back(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    _, envoy, path = stack
    write_atomically(
        path, f"groups:\n  api:\n    endpoints: []\n  later:\n    endpoints: [127.0.0.1:{backends[0].port}]\n"
    )
    await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: h == [])
    await envoy.wait_for(lambda: envoy.hosts("api-cluster"), lambda h: h == [])
    await envoy.wait_for(lambda: ports(envoy, "later"), lambda p: p == {backends[0].port})
    assert (await envoy.get("/later"))[1] == backends[0].name


async def test_server_restart_never_empties_envoy(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    server, envoy, path = stack
    version = await envoy.version_text("web")
    assert await server.stop() == 0  # SIGTERM: clean exit
    seen: list[int] = []

    async def watch() -> None:
        for _ in range(200):  # bounded: at most ~10 s
            seen.append(len(await envoy.hosts("web")))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.5)
    write_atomically(path, upstreams_yaml(backends[:1], backends[2:]))  # changed while away
    await server.start()  # returns serving: Envoy is back within its back-off's max_interval (2 s)
    await envoy.wait_for(lambda: ports(envoy, "web"), lambda p: p == {backends[0].port}, timeout=2 * BACK_WITHIN)
    watcher.cancel()
    assert seen and min(seen) > 0, seen
    assert await envoy.version_text("web") != version
    # and a change after the restart reaches Envoy too
    write_atomically(path, upstreams_yaml(backends[:2], backends[2:]))
    await envoy.wait_for(lambda: envoy.version_text("web"), lambda v: v == version)


async def back_after_outage(
    tmp_path: Path, backends: list[Backend], api: ApiType, back_off: Mapping[str, str] | None
) -> tuple[float, int]:
    """eds-server down for OUTAGE while both its groups change, then up again: the seconds from it
    serving again to both Envoy clusters holding the change (each cluster has its own stream, its
    own back-off), and the connections Envoy attempted in the last half of the outage."""
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams_yaml(backends[:2], backends[2:]))
    async with EdsServerProcess(path) as server:
        clusters = [EdsCluster("web", api_type=api), EdsCluster("api-cluster", service_name="api", api_type=api)]
        async with EnvoyProcess(envoy_bootstrap(server.port, clusters, xds_retry_back_off=back_off)) as envoy:
            await envoy.wait_for(lambda: ports(envoy, "api-cluster"), lambda p: p == {backends[2].port})
            assert await server.stop() == 0
            write_atomically(path, upstreams_yaml(backends[:1], backends[1:2]))  # both groups changed while away
            await asyncio.sleep(OUTAGE / 2)
            failed = await envoy.stats("xds_cluster.upstream_cx_connect_fail")
            await asyncio.sleep(OUTAGE / 2)
            late = await envoy.stats("xds_cluster.upstream_cx_connect_fail")
            attempts = int(late["cluster.xds_cluster.upstream_cx_connect_fail"]) - int(
                failed["cluster.xds_cluster.upstream_cx_connect_fail"]
            )
            await server.start()  # returns once it serves (/readyz)
            loop = asyncio.get_running_loop()
            serving = loop.time()

            async def changed() -> bool:
                return await ports(envoy, "web") == {backends[0].port} and await ports(envoy, "api-cluster") == {
                    backends[1].port
                }

            await envoy.wait_for(changed, timeout=60, interval=0.05)
            return loop.time() - serving, attempts


@pytest.mark.parametrize("api", ["GRPC", "DELTA_GRPC"])
async def test_envoy_is_back_within_seconds_after_an_outage(
    tmp_path: Path, backends: list[Backend], api: ApiType
) -> None:
    """With the shipped back-off Envoy keeps trying at least every 2 s however long eds-server is
    away, so a change made while it was away reaches both clusters within seconds of it serving
    (printed; held here by the count of its attempts, not by the clock)."""
    seconds, attempts = await back_after_outage(tmp_path, backends, api, SHIPPED_XDS_BACK_OFF)
    print(f"{api}: both clusters changed {seconds:.2f}s after eds-server served again; {attempts} attempts")
    # in the outage's last 5 s each of the two streams tried at least twice (at most 2 s apart); with
    # Envoy's own back-off, 4-16 s apart by then, 1-3 attempts in all were seen
    assert attempts >= 4


@pytest.mark.fast_path  # stock grpclib advertises 100 streams a connection: Envoy opens two
async def test_150_clusters_on_one_connection(tmp_path: Path) -> None:
    n = 150
    path = tmp_path / "upstreams.yaml"
    path.write_text(
        "groups:\n" + "".join(f"  c{i}:\n    endpoints: [127.0.0.{1 + i // 200}:{10000 + i}]\n" for i in range(n))
    )
    async with EdsServerProcess(path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster(f"c{i}") for i in range(n)])
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live(timeout=30)
            wanted = r"^cluster\.(c\d+\.(version_text|update_rejected)|xds_cluster\.upstream_cx)"
            stats = await envoy.stats(wanted)
            versions = [k for k, v in stats.items() if k.endswith(".version_text") and v]
            assert len(versions) == n
            assert all(v == 0 for k, v in stats.items() if k.endswith("update_rejected"))
            assert stats["cluster.xds_cluster.upstream_cx_total"] == 1
            assert stats["cluster.xds_cluster.upstream_cx_destroy"] == 0
            clusters = (await envoy.clusters())["cluster_statuses"]
            with_hosts = [c for c in clusters if c["name"].startswith("c") and c.get("host_statuses")]
            assert len(with_hosts) == n
    assert len(re.findall("stream opened", server.log_text())) == n


async def test_admin_shows_streams_and_metrics(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    server, envoy, path = stack
    if "REST" in str(envoy.bootstrap):  # REST polls hold no stream
        return
    streams = (await server.admin("/v1/streams"))["streams"]
    by_name = {n: (s, v) for s in streams for n, v in s["names"].items()}
    web_stream, web = by_name["web"]
    assert web_stream["node"] == envoy.bootstrap["node"]["id"]
    version = await envoy.version_text("web")
    assert web["sent"] == web["acked"] == version and web["nacked"] is None
    write_atomically(path, upstreams_yaml(backends[:1], backends[2:]))
    await envoy.wait_for(lambda: ports(envoy, "web"), lambda p: p == {backends[0].port})
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
        text = await r.text()
    kind = web_stream["transport"]
    assert f'eds_streams_open{{transport="{kind}"}} 3.0' in text
    assert "eds_push_latency_seconds_count 1.0" in text  # the one change, to its one subscriber
    assert 'eds_group_endpoints{group="web"} 1.0' in text
    assert 'eds_source_loaded{source="file:' in text and "eds_ready 1.0" in text
    # Envoy's ACKs on a SotW stream following one name are read by their bytes, not decoded: the
    # fan-out's fast way in takes a real Envoy's requests, not only the bench's
    streams = (await server.admin("/v1/streams"))["streams"]
    acks_read_whole = {n: s["acks_read_whole"] for s in streams for n in s["names"]}
    if kind == "sotw" and len(web_stream["names"]) == 1:
        assert acks_read_whole["web"] >= 2, streams  # the first response's ACK, and the change's
    else:
        assert acks_read_whole["web"] == 0, streams  # delta, or a stream of several names: decoded


async def test_envoy_restart_converges_and_leaves_no_streams_behind(
    stack: tuple[EdsServerProcess, EnvoyProcess, Path], backends: list[Backend]
) -> None:
    server, envoy, _ = stack
    before = len((await server.admin("/v1/streams"))["streams"])
    async with EnvoyProcess(
        envoy.bootstrap | {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}}
    ) as second:
        await second.wait_live()
        assert await ports(second, "web") == {backends[0].port, backends[1].port}
        assert await second.version_text("web") == await envoy.version_text("web")
    # the second Envoy has gone: its streams are closed on the server
    await envoy.wait_for(lambda: server.admin("/v1/streams"), lambda s: len(s["streams"]) == before)


@pytest.mark.parametrize("api", ["GRPC", "DELTA_GRPC"])
async def test_envoy_answers_our_keepalive_and_keeps_its_one_connection(
    api: ApiType, tmp_path: Path, backends: list[Backend]
) -> None:
    """eds-server's own keepalive (a PING every 300 ms here, closed unanswered after 300 ms) against
    a real Envoy: Envoy echoes every PING, so its one connection to eds-server is never reset, and
    its endpoints stay."""
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams_yaml(backends[:2], backends[2:]))
    async with EdsServerProcess(path, "--keepalive-time", "300ms", "--keepalive-timeout", "300ms") as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web", api_type=api)], free_port(), routes={"/": "web"})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live()
            for _ in range(40):  # bounded: until ten PINGs were answered (about 3 s), at most 20 s
                keepalive = (await server.admin("/v1/stats"))["keepalive"]
                if keepalive["answered"] >= 10:
                    break
                await asyncio.sleep(0.5)
            stats = await server.admin("/v1/stats")
            assert stats["keepalive"]["answered"] >= 10, stats["keepalive"]  # the floor: PINGs went, and came back
            assert stats["refused_by_reason"]["keepalive"] == 0
            connections = await envoy.stats("cluster.xds_cluster.upstream_cx_total")
            assert connections["cluster.xds_cluster.upstream_cx_total"] == 1  # never reset, never reopened
            assert await ports(envoy, "web") == {backends[0].port, backends[1].port}
