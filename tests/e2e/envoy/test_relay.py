"""Two tiers with a real Envoy: origin (upstreams file) -> relay (`--upstream-eds`) -> Envoy.

The relay serves the origin's bytes and versions unchanged, keeps its last state while the origin
is away, and serves nothing for a name its upstream never answered."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import ApiType, EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fault_watch import FaultWatch
from tests.support.hung_peer import frozen_is_said, wait_source
from tests.support.junk_h2 import junk_upstream
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, write_atomically
from tests.support.waiting import wait_for

pytestmark = pytest.mark.envoy


def upstreams(web: list[Backend], api: list[Backend]) -> str:
    lines = ["groups:", "  web:", "    endpoints:", *(f"      - 127.0.0.1:{b.port}" for b in web)]
    lines += ["  api:", "    endpoints:", *(f"      - 127.0.0.1:{b.port}" for b in api)]
    return "\n".join(lines) + "\n"


async def origin_version(origin: EdsServerProcess, name: str) -> str:
    return str((await origin.admin(f"/v1/groups/{name}"))["version"])


@contextlib.asynccontextmanager
async def tiers(
    tmp_path: Path, backends: list[Backend], api: ApiType
) -> AsyncIterator[tuple[EdsServerProcess, EdsServerProcess, EnvoyProcess, Path]]:
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams(backends[:2], backends[2:]))
    async with EdsServerProcess(path, workdir=tmp_path) as origin:
        relay = EdsServerProcess(None, "--upstream-eds", f"127.0.0.1:{origin.port}", workdir=tmp_path)
        async with relay:
            bootstrap = envoy_bootstrap(
                relay.port,
                [EdsCluster("web", api_type=api), EdsCluster("api-cluster", service_name="api", api_type=api)],
                free_port(),
                routes={"/api": "api-cluster", "/": "web"},
                xds_retry_back_off={"base_interval": "0.2s", "max_interval": "1s"},
            )
            async with EnvoyProcess(bootstrap) as envoy:
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                yield origin, relay, envoy, path
                for cluster in ("web", "api-cluster"):
                    assert await envoy.update_rejected(cluster) == 0


@pytest.fixture
async def backends() -> AsyncIterator[list[Backend]]:
    async with http_backends(3) as started:
        yield started


@pytest.mark.parametrize("api", ["GRPC", "DELTA_GRPC"])
async def test_origin_change_reaches_envoy_with_the_origins_version(
    tmp_path: Path, backends: list[Backend], api: ApiType
) -> None:
    async with tiers(tmp_path, backends, api) as (origin, relay, envoy, path):
        assert await envoy.version_text("web") == await origin_version(origin, "web") or api == "GRPC"
        write_atomically(path, upstreams(backends[:1], backends[1:]))
        await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 1, timeout=5)
        await envoy.wait_for(lambda: envoy.hosts("api-cluster"), lambda h: len(h) == 2, timeout=5)
        relayed = await relay.admin("/v1/groups/web")
        assert relayed["version"] == await origin_version(origin, "web")  # the origin's, unchanged
        assert relayed["sources"] == [f"upstream-eds:127.0.0.1:{origin.port}"]
        if api == "DELTA_GRPC":  # delta: Envoy's version of a cluster is the resource's own
            assert await envoy.version_text("web") == await origin_version(origin, "web")
        status, _ = await envoy.get("/")
        assert status == 200


async def test_origin_restart_keeps_every_cluster_and_a_change_after_it_arrives(
    tmp_path: Path, backends: list[Backend]
) -> None:
    async with tiers(tmp_path, backends, "DELTA_GRPC") as (origin, relay, envoy, path):
        async with FaultWatch(envoy, relay, backends=[b.port for b in backends[:2]]) as watch:
            await origin.stop()
            # the relay serves its last state, marked stale, while traffic goes on
            sources = await wait_for(
                lambda: relay.admin("/v1/sources"),
                lambda r: r["sources"][0]["stale"] and r["sources"][0]["last_error"],
                what="the relay's upstream marked stale",
            )
            assert sources["sources"][0]["last_error"]
            during = len(watch.samples)
            await wait_for(lambda: len(watch.samples) >= during + 5, what="traffic sampled while the origin is away")
            await origin.start()
            write_atomically(path, upstreams(backends[:1], backends[2:]))
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 1, timeout=15)
        assert watch.failed_while_backends_up() == []
        assert min(s.hosts for s in watch.samples if s.hosts is not None) >= 1  # never empty
        assert not (await relay.admin("/v1/sources"))["sources"][0]["stale"]


@pytest.mark.parametrize("api", ["GRPC", "DELTA_GRPC"])
async def test_relay_restart_sends_envoy_nothing_again(tmp_path: Path, backends: list[Backend], api: ApiType) -> None:
    async with tiers(tmp_path, backends, api) as (_, relay, envoy, _):
        await envoy.wait_for(lambda: envoy.hosts("api-cluster"), lambda h: len(h) == 1)
        updates = "cluster.web.update_success"
        before = (await envoy.stats(updates))[updates]
        version = await envoy.version_text("web")
        async with FaultWatch(envoy, relay, backends=[b.port for b in backends[:2]]) as watch:
            await relay.stop()
            await asyncio.sleep(0.5)
            await relay.start()
            # Envoy reconnects and says which versions it holds: the relay has the same ones
            await envoy.wait_for(lambda: relay.admin("/v1/stats"), lambda s: s["streams_open"] >= 1, timeout=15)
            await asyncio.sleep(1.0)
        assert watch.failed_while_backends_up() == []
        assert min(s.hosts for s in watch.samples if s.hosts is not None) == 2
        assert await envoy.version_text("web") == version
        assert (await envoy.stats(updates))[updates] == before  # nothing was sent again


async def test_relay_whose_upstream_never_answered_serves_nothing_and_says_why(tmp_path: Path) -> None:
    closed = free_port()
    relay = EdsServerProcess(None, "--upstream-eds", f"127.0.0.1:{closed}", workdir=tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        await relay.start(wait_ready=False)
        stack.push_async_callback(relay.stop)
        ready = await wait_for(
            lambda: relay.admin("/readyz"), lambda r: r["waiting_for"] and r["waiting_for"][0]["last_error"]
        )
        assert not ready["ready"]
        assert ready["waiting_for"][0]["source"] == f"upstream-eds:127.0.0.1:{closed}"
        assert "refused" in ready["waiting_for"][0]["last_error"]
        envoy = await stack.enter_async_context(EnvoyProcess(envoy_bootstrap(relay.port, [EdsCluster("web")])))
        await asyncio.sleep(2.0)
        assert await envoy.hosts("web") == []
        assert (await envoy.stats("cluster.web.update_success"))["cluster.web.update_success"] == 0


async def test_relay_fetch_answers_the_names_its_streams_follow_and_unavailable_for_others(
    tmp_path: Path, backends: list[Backend]
) -> None:
    from grpclib.client import Channel
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    from eds_server.pb.envoy.config.core.v3 import Node
    from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest
    from eds_server.pb.envoy.service.endpoint.v3 import EndpointDiscoveryServiceStub
    from eds_server.xds.common import EDS_TYPE_URL

    async with tiers(tmp_path, backends, "GRPC") as (origin, relay, _, _):
        channel = Channel("127.0.0.1", relay.port)
        try:
            stub = EndpointDiscoveryServiceStub(channel)

            def ask(name: str) -> DiscoveryRequest:
                return DiscoveryRequest(node=Node(id="poller"), resource_names=[name], type_url=EDS_TYPE_URL)

            answer = await stub.fetch_endpoints(ask("web"))  # Envoy's stream follows it
            assert answer.version_info == await origin_version(origin, "web")
            with pytest.raises(GRPCError) as refused:
                await stub.fetch_endpoints(ask("nobody-follows-this"))
            assert refused.value.status == Status.UNAVAILABLE
        finally:
            channel.close()


async def test_relay_over_mtls_to_an_origin_that_requires_client_certificates(
    tmp_path: Path, backends: list[Backend]
) -> None:
    from tests.support.tls import CertAuthority

    ca = CertAuthority("relay test CA", tmp_path / "pki")
    server = ca.issue(tmp_path / "pki" / "origin", dns=["localhost"], ips=["127.0.0.1"])
    client = ca.issue(tmp_path / "pki" / "relay", uris=["spiffe://test/relay"])
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams(backends[:2], backends[2:]))
    tls = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.cert_path)]
    async with EdsServerProcess(path, *tls, workdir=tmp_path) as origin:
        no_cert = EdsServerProcess(
            None, "--upstream-eds", f"127.0.0.1:{origin.port}", "--upstream-eds-ca", str(ca.cert_path), workdir=tmp_path
        )
        async with contextlib.AsyncExitStack() as stack:
            await no_cert.start(wait_ready=False)
            stack.push_async_callback(no_cert.stop)
            refused = await wait_for(
                lambda: no_cert.admin("/readyz"), lambda r: r["waiting_for"] and r["waiting_for"][0]["last_error"]
            )
            assert not refused["ready"]  # the origin wants a certificate: nothing is served
        relay = EdsServerProcess(
            None,
            "--upstream-eds",
            f"127.0.0.1:{origin.port}",
            "--upstream-eds-ca",
            str(ca.cert_path),
            "--upstream-eds-cert",
            str(client.cert),
            "--upstream-eds-key",
            str(client.key),
            workdir=tmp_path,
        )
        async with relay:
            envoy = EnvoyProcess(envoy_bootstrap(relay.port, [EdsCluster("web")], free_port(), routes={"/": "web"}))
            async with envoy:
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                assert (await relay.admin("/v1/groups/web"))["version"] == await origin_version(origin, "web")


@pytest.mark.parametrize("random_bytes", [False, True], ids=["junk-grpc", "random-bytes"])
async def test_relay_pointed_at_junk_is_never_ready_and_says_why_in_few_lines(
    tmp_path: Path, random_bytes: bool
) -> None:
    """An upstream streaming junk gRPC messages (empty ones, random bytes, another type) or answering
    with random bytes: the relay never loads (503, not ready), /readyz and /v1/sources name the last
    error, and the log has a few lines, not one per message."""
    async with junk_upstream(random_bytes=random_bytes) as junk:
        relay = EdsServerProcess(None, "--upstream-eds", f"127.0.0.1:{junk.port}", workdir=tmp_path)
        await relay.start(wait_ready=False)
        try:
            ready = await wait_for(
                lambda: relay.admin("/readyz"), lambda r: r["waiting_for"] and r["waiting_for"][0]["last_error"]
            )
            await asyncio.sleep(8.0)  # thousands of junk messages, several reconnects
            ready = await relay.admin("/readyz")
            source = (await relay.admin("/v1/sources"))["sources"][0]
        finally:
            await relay.stop()
    log = relay.log_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    print(
        f"\n{junk.connections} connections, {junk.sent} junk messages sent, {len(warnings)} warnings; "
        f"last_error: {source['last_error']}"
    )
    assert not ready["ready"] and ready["waiting_for"][0]["last_error"], ready
    assert source["last_error"] and not source["loaded"], source
    assert "all sources loaded" not in log
    assert len(warnings) <= 12, "\n".join(warnings[:20])
    if not random_bytes:
        assert junk.connections > 1 and junk.sent >= 6 and "refused a response of the upstream" in log
        assert "not EDS answers" in source["last_error"]  # the connection was dropped for it


async def test_a_frozen_origin_is_said_stale_within_the_bound_and_envoy_keeps_its_hosts(
    tmp_path: Path, backends: list[Backend]
) -> None:
    """The origin SIGSTOPped: its connection stays open and nothing answers. The relay says it is stale
    within the stated bound (/v1/sources, /readyz, /metrics), Envoy keeps both hosts and no request
    fails; after SIGCONT the relay follows it again and a change reaches Envoy."""
    async with tiers(tmp_path, backends, "DELTA_GRPC") as (origin, relay, envoy, path):
        source = f"upstream-eds:127.0.0.1:{origin.port}"
        await wait_source(relay, source, stale=False, timeout=10)
        assert origin.proc is not None
        async with FaultWatch(envoy, relay, backends=[b.port for b in backends[:2]]) as watch:
            await watch.served(5, "traffic through Envoy before the freeze")
            origin.proc.send_signal(signal.SIGSTOP)
            try:
                frozen_at = time.monotonic()
                watch.mark("origin frozen (SIGSTOP)")
                took = await frozen_is_said(relay, source, frozen_at)
                watch.mark(f"relay said stale {took:.1f} s after the freeze")
                await asyncio.sleep(3.0)
                await wait_source(relay, source, stale=True, timeout=1)
            finally:
                origin.proc.send_signal(signal.SIGCONT)
            watch.mark("origin thawed (SIGCONT)")
            await wait_source(relay, source, stale=False, timeout=15)
            watch.mark("relay live again")
            write_atomically(path, upstreams(backends[:1], backends[2:]))
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 1, timeout=15)
            watch.mark("a change after the thaw reached Envoy")
        print("\n" + watch.summary("origin frozen behind a relay"))
        assert watch.failed() == []
        assert watch.host_counts()[0] == 0 and watch.host_counts()[None] == 0
