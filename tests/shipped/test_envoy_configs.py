"""The shipped Envoy configs (envoy/*.yaml) are valid for the bundled Envoy."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.backends import Backend, http_backends, serve_backend
from tests.support.envoy_harness import SHIPPED_XDS_BACK_OFF, EnvoyProcess, envoy_binary
from tests.support.paths import ROOT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.tls import CertAuthority

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

CONFIG_DIR = ROOT / "envoy"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
DEMO_COPY = ROOT / "eds_server" / "demo_files" / "envoy.yaml"  # what `eds-server demo` runs
TLS_DIR = "/etc/envoy/tls/"  # where envoy-mtls.yaml reads Envoy's certificate, key and the server CA


def test_demo_config_is_shipped() -> None:
    assert CONFIG_DIR / "envoy.yaml" in CONFIGS


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_validates(config: Path, tmp_path: Path) -> None:
    text = config.read_text()
    if TLS_DIR in text:  # Envoy reads these files even to validate: validate with test ones in their place
        ca = CertAuthority("validation CA", tmp_path)
        ca.issue(tmp_path / "envoy")  # envoy.pem, envoy-key.pem
        (tmp_path / "server-ca.pem").write_bytes(ca.cert_path.read_bytes())
        config = tmp_path / config.name
        config.write_text(text.replace(TLS_DIR, f"{tmp_path}/"))
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config), "-l", "warning"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _socket_addresses(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, list):
        return [s for item in node for s in _socket_addresses(item)]
    if not isinstance(node, dict):
        return []
    found = [node["socket_address"]] if "socket_address" in node else []
    return found + [s for v in node.values() for s in _socket_addresses(v)]


async def test_demo_config_runs() -> None:
    """envoy.yaml really starts (on free ports instead of 9901/10000/18000)."""
    boot = yaml.safe_load((CONFIG_DIR / "envoy.yaml").read_text())
    for sock in _socket_addresses(boot):
        assert sock["address"] == "127.0.0.1"
        sock["port_value"] = 0 if sock["port_value"] == 9901 else free_port()
    async with EnvoyProcess(boot) as envoy:
        assert await envoy.hosts("web") == []
        assert await envoy.hosts("api-cluster") == []
        config_dump = await envoy.admin_get("/config_dump?resource=static_clusters")
        assert '"service_name": "api"' in config_dump


@pytest.mark.parametrize("config", [*CONFIGS, DEMO_COPY], ids=lambda p: str(p.relative_to(ROOT)))
def test_admin_is_on_loopback(config: Path) -> None:
    """Envoy's admin has no authentication: whoever reaches it reads /config_dump and can POST
    /quitquitquit. In the compose stack the backends share a network with Envoy, so 0.0.0.0 there
    would hand it to every backend."""
    admin = yaml.safe_load(config.read_text())["admin"]["address"]["socket_address"]
    assert ipaddress.ip_address(admin["address"]).is_loopback, f"{config.name}: admin on {admin['address']}"


def _on_free_ports(config: Path) -> dict[str, Any]:
    """A shipped config with every port free and everything on 127.0.0.1, except the admin, whose
    address is kept as shipped (port 0: the harness learns it)."""
    boot = yaml.safe_load(config.read_text())
    admin = boot["admin"]["address"]["socket_address"]
    for sock in _socket_addresses(boot):
        if sock is admin:
            sock["port_value"] = 0
        else:
            sock["address"], sock["port_value"] = "127.0.0.1", free_port()  # compose's "eds-server", 0.0.0.0
    return boot


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.mark.parametrize("name", ["envoy.yaml", "compose-envoy.yaml"])
async def test_admin_answers_on_loopback_and_nowhere_else(name: str) -> None:
    """A real Envoy from the shipped config: the admin answers on 127.0.0.1, and another address of
    the same host (127.0.0.2 is on lo too) is refused, as a container's network address would be."""
    async with EnvoyProcess(_on_free_ports(CONFIG_DIR / name)) as envoy:
        host, _, port = envoy.admin_url.removeprefix("http://").rpartition(":")
        assert host == "127.0.0.1"
        assert "state" in await envoy.admin_get("/server_info")
        assert not _connects("127.0.0.2", int(port))
        assert _connects("127.0.0.1", int(port))


def _compose_healthcheck(admin_port: int) -> list[str]:
    test = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["envoy"]["healthcheck"]["test"]
    assert test[0] == "CMD" and "127.0.0.1/9901" in test[-1]
    return [*test[1:-1], test[-1].replace("127.0.0.1/9901", f"127.0.0.1/{admin_port}")]


async def test_compose_healthcheck_asks_the_loopback_admin() -> None:
    """The compose healthcheck runs inside the Envoy container, the one place that reaches its
    admin: 0 once Envoy is LIVE, 1 (never Docker's reserved 2) before, when /ready answers 503, and with
    nothing listening."""
    async with EnvoyProcess(_on_free_ports(CONFIG_DIR / "compose-envoy.yaml")) as envoy:
        port = int(envoy.admin_url.rpartition(":")[2])
        if not await envoy.is_live():  # initial_fetch_timeout: eds-server is not there
            assert subprocess.run(_compose_healthcheck(port), timeout=30).returncode == 1
        await envoy.wait_live()
        assert subprocess.run(_compose_healthcheck(port), timeout=30).returncode == 0
    assert subprocess.run(_compose_healthcheck(free_port()), capture_output=True, timeout=30).returncode == 1


def _demo_bootstrap(xds_port: int, retries: bool) -> dict[str, Any]:
    """envoy.yaml on free ports, pointed at `xds_port`; without its retry policy if not `retries`."""
    boot = yaml.safe_load((CONFIG_DIR / "envoy.yaml").read_text())
    for sock in _socket_addresses(boot):
        port = sock["port_value"]
        sock["port_value"] = 0 if port == 9901 else xds_port if port == 18000 else free_port()
    vhost = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ][0]
    assert "retry_policy" in vhost
    if not retries:
        del vhost["retry_policy"]
    return boot


@pytest.mark.parametrize("retries", [True, False], ids=["shipped retry policy", "without it"])
async def test_a_backend_gone_before_eds_says_so_fails_no_request(retries: bool, tmp_path: Path) -> None:
    """A backend that exits on SIGTERM stops listening before its DRAINING update reaches Envoy (a
    scale-down). With envoy.yaml's retry policy, 200 requests through a real Envoy in that window all
    succeed (retried on the other host); without it, some fail: the policy is what makes it lossless."""
    async with http_backends(1, "kept") as (kept,), contextlib.AsyncExitStack() as stack:
        leaving = await stack.enter_async_context(serve_backend(Backend("leaving")))
        upstreams = tmp_path / "upstreams.yaml"
        upstreams.write_text(
            f"groups:\n  web:\n    endpoints: [127.0.0.1:{kept.port}, 127.0.0.1:{leaving.port}]\n"
            f"  api:\n    endpoints: [127.0.0.1:{kept.port}]\n"
        )
        async with EdsServerProcess(upstreams) as server, EnvoyProcess(_demo_bootstrap(server.port, retries)) as envoy:
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hosts: len(hosts) == 2, timeout=30)
            await stack.aclose()  # `leaving` stops listening; eds-server still lists it: nothing told it
            statuses = [(await envoy.get("/"))[0] for _ in range(200)]  # bounded: 200 requests
    failed = sum(1 for s in statuses if s != 200)
    print(f"retries={retries}: {failed} of {len(statuses)} requests failed")
    if retries:
        assert failed == 0, statuses
    else:
        assert failed > 0  # the host is picked about half the time, and nothing retries


def _api_config_sources(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, list):
        return [s for item in node for s in _api_config_sources(item)]
    if not isinstance(node, dict):
        return []
    found = [node["api_config_source"]] if "api_config_source" in node else []
    return found + [s for v in node.values() for s in _api_config_sources(v)]


@pytest.mark.parametrize("config", [*CONFIGS, DEMO_COPY], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_xds_stream_comes_back_within_2s(config: Path) -> None:
    """Envoy's own back-off for a broken xDS stream grows to 30 s: each gRPC EDS cluster's stream
    sets its own, at most 2 s between tries (docs/fail-static.md: "Envoy back within seconds")."""
    sources = [s for s in _api_config_sources(yaml.safe_load(config.read_text())) if "grpc_services" in s]
    for source in sources:
        back_off = source["grpc_services"][0]["envoy_grpc"]["retry_policy"]["retry_back_off"]
        assert back_off == SHIPPED_XDS_BACK_OFF, (config.name, back_off)  # the tests' Envoys reconnect alike
    assert sources or "REST" in config.read_text()


@pytest.mark.parametrize("name", ["envoy-inside.yaml", "envoy-outside.yaml"])
def test_the_kubernetes_envoys_come_back_within_2s_too(name: str) -> None:
    """The Envoys of deploy/kubernetes (one a ConfigMap's file, one a file of its own) set the same back-off."""
    configs = []
    for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()):
        if doc and doc.get("kind") == "ConfigMap":
            configs += [yaml.safe_load(text) for text in doc["data"].values()]
        elif doc and "static_resources" in doc:
            configs.append(doc)
    sources = [s for config in configs for s in _api_config_sources(config) if "grpc_services" in s]
    assert sources, name
    for source in sources:
        assert source["grpc_services"][0]["envoy_grpc"]["retry_policy"]["retry_back_off"] == SHIPPED_XDS_BACK_OFF
