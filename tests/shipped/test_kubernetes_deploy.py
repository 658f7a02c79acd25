"""deploy/kubernetes: the example Envoy configs validate with the bundled Envoy, and the manifests
parse and keep the security settings the docs promise. (They are applied to a real kube-apiserver
in e2e/kubernetes/test_kubernetes_real.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.envoy_harness import envoy_binary
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _validate(config: Path) -> None:
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config), "--service-node", "x", "-l", "warning"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.envoy
def test_envoy_outside_validates() -> None:
    _validate(DEPLOY / "envoy-outside.yaml")


@pytest.mark.envoy
def test_envoy_inside_validates(tmp_path: Path) -> None:
    config_map = next(d for d in docs("envoy-inside.yaml") if d["kind"] == "ConfigMap")
    path = tmp_path / "envoy.yaml"
    path.write_text(config_map["data"]["envoy.yaml"])
    _validate(path)


def test_rbac_is_read_only_on_what_is_read() -> None:
    for name in ("rbac.yaml", "rbac-namespaced.yaml"):
        roles = [d for d in docs(name) if d["kind"] in ("ClusterRole", "Role")]
        assert roles
        for role in roles:
            assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in role["rules"]} == {
                (("",), ("services",)),
                (("discovery.k8s.io",), ("endpointslices",)),
            }
            assert all(r["verbs"] == ["get", "list", "watch"] for r in role["rules"])


def test_node_access_is_separate_and_read_only() -> None:
    (role,) = [d for d in docs("rbac-nodes.yaml") if d["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]


def test_deployment_is_locked_down_and_probed() -> None:
    deployment = next(d for d in docs("deployment.yaml") if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--kubernetes" in container["args"]
    assert "--listen=0.0.0.0:18000" in container["args"]  # the default is the Pod's loopback
    # the probes ask the read-only port; the admin API (and its writes) stays on the Pod's loopback
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["port"] == container["livenessProbe"]["httpGet"]["port"] == "probes"
    assert f"--metrics-listen=0.0.0.0:{ports['probes']}" in container["args"]
    assert "--admin=127.0.0.1:18001" in container["args"] and 18001 not in ports.values()
