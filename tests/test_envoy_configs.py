"""The shipped Envoy configs (envoy/*.yaml) are valid for the bundled Envoy."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy_harness import EnvoyProcess, envoy_binary, free_port
from tls import CertAuthority

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

CONFIG_DIR = Path(__file__).resolve().parent.parent / "envoy"
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
