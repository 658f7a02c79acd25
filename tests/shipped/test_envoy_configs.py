"""The shipped Envoy configs (envoy/*.yaml) are valid for the bundled Envoy."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.backends import Backend, http_backends, serve_backend
from tests.support.envoy_harness import EnvoyProcess, envoy_binary
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


def _demo_bootstrap(xds_port: int, retries: bool) -> dict[str, Any]:
    """envoy.yaml on free ports, pointed at `xds_port`; without its retry policy if not `retries`."""
    boot = yaml.safe_load((CONFIG_DIR / "envoy.yaml").read_text())
    for sock in _socket_addresses(boot):
        port = sock["port_value"]
        sock["port_value"] = 0 if port == 9901 else xds_port if port == 18000 else free_port()
    vhost = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]  # fmt: skip
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
        upstreams.write_text(f"groups:\n  web:\n    endpoints: [127.0.0.1:{kept.port}, 127.0.0.1:{leaving.port}]\n"
                             f"  api:\n    endpoints: [127.0.0.1:{kept.port}]\n")  # fmt: skip
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
