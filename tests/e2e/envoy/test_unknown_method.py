"""An Envoy configured for ADS gets UNIMPLEMENTED, and eds-server says so once, with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.grpc_harness import Harness
from tests.support.server_process import EdsServerProcess

pytestmark = pytest.mark.envoy


async def test_an_ads_envoy_is_told_once_per_peer(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
    async with EdsServerProcess(path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], initial_fetch_timeout="1s")
        bootstrap["dynamic_resources"] = {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
            }
        }
        web = bootstrap["static_resources"]["clusters"][-1]
        web["eds_cluster_config"]["eds_config"] = {"resource_api_version": "V3", "ads": {}}
        async with EnvoyProcess(bootstrap) as envoy:
            # Envoy retries the ADS stream with backoff: wait for a few attempts
            await envoy.wait_for(
                lambda: envoy.stats(r"^cluster\.web\.update_failure$"),
                lambda s: int(s.get("cluster.web.update_failure", 0)) >= 3,
                timeout=30,
            )
            assert await envoy.hosts("web") == []
    log = server.log_text()
    warnings = [line for line in log.splitlines() if "unknown gRPC method" in line]
    assert len(warnings) == 1, warnings
    assert "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources" in warnings[0]
    assert "from 127.0.0.1: eds-server serves EDS without ADS: remove `ads_config`" in warnings[0]
    assert "api_config_source" in warnings[0]


async def test_v2_and_other_methods_are_named_and_the_record_is_bounded(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    from grpclib import GRPCError
    from grpclib.const import Cardinality, Status

    from eds_server.transport.unknown import UnknownMethods

    for path, why in [
        ("/envoy.api.v2.EndpointDiscoveryService/StreamEndpoints", "the v2 xDS API is not served"),
        (
            "/envoy.service.cluster.v3.ClusterDiscoveryService/StreamClusters",
            "serves only envoy.service.endpoint.v3.EndpointDiscoveryService",
        ),
    ]:
        for _ in range(3):
            with pytest.raises(GRPCError) as e:
                async with harness.channel.request(path, Cardinality.STREAM_STREAM, None, None) as stream:  # type: ignore[type-var]
                    await stream.send_request(end=True)
                    await stream.recv_initial_metadata()
                    await stream.recv_trailing_metadata()
            assert e.value.status == Status.UNIMPLEMENTED and why in (e.value.message or "")
        warned = [r.getMessage() for r in caplog.records if path in r.getMessage()]
        assert len(warned) == 1 and why in warned[0]
    table = UnknownMethods({}, "x", most=10)

    class _Peer:
        def addr(self) -> tuple[str, int]:
            return ("127.0.0.1", 1)

    class _Stream:
        peer = _Peer()

    async def call(method: str) -> list[str]:
        """The warnings logged for one call of an unknown method (its handler, as grpclib runs it)."""
        caplog.clear()
        with pytest.raises(GRPCError):
            await table.get(f"/no.Such/{method}").func(_Stream())
        return [r.getMessage() for r in caplog.records if f"/no.Such/{method} " in r.getMessage()]

    for i in range(100):
        assert len(await call(f"M{i}")) == 1
    assert await call("M90") == []  # the 10 newest are remembered: not warned again
    assert len(await call("M89")) == 1  # older ones are forgotten: the record holds 10, whatever clients send
