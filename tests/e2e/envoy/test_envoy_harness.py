"""The real-Envoy harness itself works (no eds-server involved).

Traffic goes to a STATIC cluster, an EDS cluster whose server is absent, and an EDS cluster
fed by a tiny in-test REST (JSON) EDS endpoint.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, Host, Locality, envoy_binary, envoy_bootstrap
from tests.support.ports import free_port
from tests.support.waiting import wait_for

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def _lb_endpoint(port: int, **extra: Any) -> dict[str, Any]:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    return {"endpoint": {"address": address, **extra.pop("endpoint", {})}, **extra}


@asynccontextmanager
async def rest_eds(state: dict[str, Any]) -> AsyncIterator[int]:
    """A minimal REST EDS endpoint serving `state["version"]` / `state["resources"]`
    (service name -> ClusterLoadAssignment JSON); yields its port."""

    async def discovery(request: web.Request) -> web.Response:
        names = (await request.json()).get("resource_names", [])
        resources = [
            {"@type": CLA_TYPE, "cluster_name": n, **state["resources"][n]} for n in names if n in state["resources"]
        ]
        return web.json_response({"version_info": state["version"], "resources": resources})

    app = web.Application()
    app.router.add_post("/v3/discovery:endpoints", discovery)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def test_bootstrap_shape() -> None:
    boot = envoy_bootstrap(
        1234,
        [EdsCluster("api-cluster", service_name="api", api_type="DELTA_GRPC")],
        5678,
        routes={"/": "web", "/api": "api-cluster"},
        prefix_rewrite=True,
    )
    xds, api = boot["static_resources"]["clusters"]
    h2 = xds["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "explicit_http_config"
    ]["http2_protocol_options"]
    assert h2["connection_keepalive"] == {"interval": "30s", "timeout": "5s"}
    eds = api["eds_cluster_config"]
    assert eds["service_name"] == "api"
    source = eds["eds_config"]["api_config_source"]
    assert source["api_type"] == "DELTA_GRPC"
    retry = {"retry_back_off": {"base_interval": "0.25s", "max_interval": "2s"}}  # as the shipped configs
    assert source["grpc_services"] == [{"envoy_grpc": {"cluster_name": "xds_cluster", "retry_policy": retry}}]
    own = envoy_bootstrap(1234, [EdsCluster("web")], xds_retry_back_off=None)  # Envoy's own back-off
    own_source = own["static_resources"]["clusters"][1]["eds_cluster_config"]["eds_config"]["api_config_source"]
    assert own_source["grpc_services"] == [{"envoy_grpc": {"cluster_name": "xds_cluster"}}]
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["match"]["prefix"] for r in routes] == ["/api", "/"]  # longest prefix first
    assert routes[0]["route"] == {"cluster": "api-cluster", "prefix_rewrite": "/"}


@pytest.mark.parametrize("api_type", ["GRPC", "DELTA_GRPC", "REST"])
def test_bootstrap_passes_envoy_validation(api_type: str, tmp_path: Path) -> None:
    boot = envoy_bootstrap(
        free_port(),
        [EdsCluster("web", "svc", api_type=api_type)],  # type: ignore[arg-type]
        free_port(),
        {"/": "web"},
        static_clusters={"static": [free_port()]},
    )
    config = tmp_path / "bootstrap.yaml"
    config.write_text(yaml.safe_dump(boot))
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config), "-l", "warning"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_static_cluster_traffic_stats_and_teardown() -> None:
    async with http_backends(2) as backends:
        boot = envoy_bootstrap(
            free_port(),
            [],
            free_port(),
            {"/": "static"},
            static_clusters={"static": [b.port for b in backends]},
        )
        async with EnvoyProcess(boot) as envoy:
            await envoy.wait_live()
            hosts = await envoy.hosts("static")
            assert sorted(h.port for h in hosts) == sorted(b.port for b in backends)
            assert {(h.address, h.health, h.weight, h.priority) for h in hosts} == {("127.0.0.1", "HEALTHY", 1, 0)}
            bodies = [await envoy.get(f"/hello/{i}") for i in range(4)]
            assert {status for status, _ in bodies} == {200}
            assert {body for _, body in bodies} == {"backend-0", "backend-1"}
            assert sum(b.hits for b in backends) == 4
            stats = await envoy.stats(r"^cluster\.static\.upstream_rq_")
            assert stats["cluster.static.upstream_rq_total"] == 4
            assert stats["cluster.static.upstream_rq_200"] == 4
            with pytest.raises(KeyError):
                await envoy.hosts("no-such-cluster")
            assert envoy.proc is not None
            pid = envoy.proc.pid
        assert envoy.proc.returncode == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_eds_cluster_without_server_times_out_empty() -> None:
    xds_port = free_port()  # nothing listens here
    boot = envoy_bootstrap(xds_port, [EdsCluster("web")], free_port(), {"/": "web"}, initial_fetch_timeout="0.5s")
    async with EnvoyProcess(boot) as envoy:
        await envoy.wait_live()
        assert await envoy.hosts("web") == []
        stats = await envoy.stats(r"^cluster\.web\.(init_fetch_timeout|version_text)$")
        assert stats == {"cluster.web.init_fetch_timeout": 1, "cluster.web.version_text": ""}
        assert await envoy.version_text("web") == ""
        assert await envoy.update_rejected("web") == 0
        status, body = await envoy.get("/")
        assert (status, body) == (503, "no healthy upstream")


async def test_rest_eds_hosts_are_parsed_and_rejections_counted() -> None:
    async with http_backends(3) as b:
        state: dict[str, Any] = {"version": "v1", "resources": {"svc": _assignment(b)}}
        async with rest_eds(state) as rest_port:
            boot = envoy_bootstrap(
                free_port(),
                [EdsCluster("web", service_name="svc", api_type="REST")],
                free_port(),
                {"/web": "web"},
                prefix_rewrite=True,
                rest_port=rest_port,
            )
            async with EnvoyProcess(boot) as envoy:
                await envoy.wait_live()
                assert await envoy.version_text("web") == "v1"
                hosts = sorted(await envoy.hosts("web"), key=lambda h: (h.priority, h.weight))
                eu = Locality("eu", "eu-1a", "rack1")
                assert hosts == [
                    Host("127.0.0.1", b[1].port, 1, "DRAINING", 0, eu, ""),
                    Host("127.0.0.1", b[0].port, 3, "HEALTHY", 0, eu, "b0.local"),
                    Host("127.0.0.1", b[2].port, 1, "HEALTHY", 1, Locality("us"), ""),
                ]
                # Only backend-0 is healthy at priority 0.
                assert await envoy.get("/web/x") == (200, "backend-0")

                # An invalid assignment is rejected; the previous one stays.
                state["version"] = "v2"
                state["resources"]["svc"] = {"endpoints": [{"lb_endpoints": [_lb_endpoint(70000)]}]}
                await envoy.wait_for(lambda: envoy.update_rejected("web"), timeout=10)
                assert await envoy.version_text("web") == "v1"
                assert len(await envoy.hosts("web")) == 3


def _assignment(b: list[Backend]) -> dict[str, Any]:
    eu = {"region": "eu", "zone": "eu-1a", "sub_zone": "rack1"}
    return {
        "endpoints": [
            {
                "locality": eu,
                "lb_endpoints": [
                    _lb_endpoint(b[0].port, endpoint={"hostname": "b0.local"}, load_balancing_weight=3),
                    _lb_endpoint(b[1].port, health_status="DRAINING"),
                ],
            },
            {
                "locality": {"region": "us"},
                "priority": 1,
                "lb_endpoints": [_lb_endpoint(b[2].port)],
            },
        ]
    }


async def test_startup_failure_raises_with_log_tail() -> None:
    boot = envoy_bootstrap(free_port(), [EdsCluster("web", lb_policy="NO_SUCH_POLICY")])
    with pytest.raises(RuntimeError, match="NO_SUCH_POLICY"):
        async with EnvoyProcess(boot):
            pass  # pragma: no cover


async def test_unexpected_exit_is_reported() -> None:
    with pytest.raises(RuntimeError, match="exited on its own"):
        async with EnvoyProcess(envoy_bootstrap(free_port(), [])) as envoy:
            assert envoy.proc is not None
            envoy.proc.kill()
            await envoy.proc.wait()


async def test_wait_for_reports_last_value() -> None:
    async def probe() -> int:
        return 1

    assert await wait_for(probe, lambda v: v == 1) == 1
    with pytest.raises(AssertionError, match="last observed: 1"):
        await wait_for(probe, lambda v: v == 2, timeout=0.2, interval=0.05)
