"""Kubernetes discovery end to end: a real kube-apiserver (+ the real EndpointSlice controller),
eds-server --kubernetes as a process, a real Envoy, and HTTP requests through it.

No kubelet runs: Pods are bound to a Node object by name and their status (a podIP, the Ready
condition) is written through `pods/status`, as a kubelet would. kube-apiserver refuses loopback
addresses in EndpointSlices, so Pod IPs are TEST-NET-1 addresses (192.0.2.N, never routed) and Envoy
reaches them through a CONNECT proxy on 127.0.0.1 that maps 192.0.2.N to 127.0.0.N, where HTTPS test
backends listen (tests/connect_proxy.py): no socket is opened to anything but 127.0.0.0/8. The one
exception is the test of health checks, which eds-server sends to the Pod's own address: that Pod is
a backend in a network namespace the test makes, on a veth pair of its own (tests/support/netns.py),
and every packet stays on that pair.
Skipped, with the reason, without kube-apiserver binaries (see tests/kube_apiserver.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import re
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.backends import Backend, serve_backend
from tests.support.connect_proxy import ConnectProxy, http11_proxy_socket, loopback_for, pod_ip
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, Host, envoy_bootstrap
from tests.support.feeds import alone
from tests.support.hung_peer import HUNG_WAIT, frozen_is_said, wait_source
from tests.support.kube_apiserver import KubeApi, KubeCluster, kube
from tests.support.netns import private_link
from tests.support.paths import ROOT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.tls import CertAuthority
from tests.support.watch_stall_proxy import WatchStallProxy

pytestmark = pytest.mark.envoy
__all__ = ["kube"]  # the module-scoped fixture

DEPLOY = ROOT / "deploy" / "kubernetes"


def pod(name: str, port: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {"app": "web"}},
        "spec": {
            "nodeName": "node-a",
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {"name": "web", "image": "registry.invalid/web:1", "ports": [{"name": "http", "containerPort": port}]}
            ],
        },
    }


def pod_status(ip: str, ready: bool) -> dict[str, Any]:
    return {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
    }


def service(name: str, annotations: dict[str, str], port: int, selector: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"ports": [{"name": "http", "port": 80, "targetPort": port}]}
    if selector:
        spec["selector"] = {"app": "web"}
    return {"metadata": {"name": name, "annotations": annotations}, "spec": spec}


def endpoint_slice(name: str, service_name: str, port: int, ips: list[str]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/service-name": service_name,
                "endpointslice.kubernetes.io/managed-by": "tests.eds-server",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
    }


@dataclass
class Stack:
    api: KubeApi
    server: EdsServerProcess
    envoy: EnvoyProcess

    async def hosts(self, cluster: str = "web") -> dict[str, Host]:
        return {h.address: h for h in await self.envoy.hosts(cluster)}

    async def wait_hosts(self, check: Any, cluster: str = "web", timeout: float = 20.0) -> dict[str, Host]:
        return await self.envoy.wait_for(lambda: self.hosts(cluster), check, timeout=timeout)

    async def source(self) -> dict[str, Any]:
        sources = await self.server.admin("/v1/sources")
        items = sources if isinstance(sources, list) else sources.get("sources", [])
        return next(s for s in items if s["name"] == "kubernetes")


@contextlib.asynccontextmanager
async def stack(
    kube: KubeCluster,
    tmp_path: Path,
    *args: str,
    clusters: tuple[str, ...] = ("web",),
    kubeconfig: Path | None = None,
    proxy: ConnectProxy | None = None,
) -> AsyncIterator[Stack]:
    async with (
        KubeApi(kube) as api,
        EdsServerProcess(
            None, "--kubernetes", "--kubeconfig", str(kubeconfig or kube.kubeconfig), *args, workdir=tmp_path
        ) as server,
    ):
        bootstrap = envoy_bootstrap(server.port, [EdsCluster(c) for c in clusters], free_port(), routes={"/": "web"})
        for cluster in bootstrap["static_resources"]["clusters"]:
            if proxy is not None and cluster["name"] in clusters:
                cluster["transport_socket"] = http11_proxy_socket(proxy.port)
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live()
            yield Stack(api, server, envoy)
            for c in clusters:
                assert await envoy.update_rejected(c) == 0


@contextlib.asynccontextmanager
async def serving_web(source: Any, store: Any) -> AsyncIterator[None]:
    """`source` running (in-process) until the block ends, entered once the store serves "web"."""
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        for _ in range(200):
            if store.ready and "web" in store.resources():
                break
            await asyncio.sleep(0.1)
        assert store.ready and source.connected
        yield
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def hits_through(envoy: EnvoyProcess, n: int) -> dict[str, int]:
    """Send `n` requests through Envoy (bounded); count which backend answered each."""
    seen: dict[str, int] = {}
    for _ in range(n):
        status, body = await asyncio.wait_for(envoy.get("/"), 5)
        assert status == 200, body
        seen[body] = seen.get(body, 0) + 1
    return seen


async def test_pods_through_the_endpointslice_controller(kube: KubeCluster, tmp_path: Path) -> None:
    kube.start_controller_manager()
    ns, port = "e2e", free_port()
    ips = [pod_ip(i) for i in range(2, 6)]
    ca = CertAuthority("backends", tmp_path)
    cert = ca.issue(tmp_path / "backend", dns=["web"])
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert.cert, cert.key)
    async with contextlib.AsyncExitStack() as backends:
        # Envoy names an endpoint by its hostname (the Pod's name) in CONNECT when it has one
        proxy = await backends.enter_async_context(ConnectProxy({f"web-{i}": ip for i, ip in enumerate(ips)}))
        for i, ip in enumerate(ips):
            local = loopback_for(ip)
            assert local is not None
            await backends.enter_async_context(serve_backend(Backend(f"web-{i}", port, local, ssl=tls)))
        async with KubeApi(kube) as api:
            await api.namespace(ns)
            node = {
                "metadata": {
                    "name": "node-a",
                    "labels": {"topology.kubernetes.io/zone": "zone-a", "topology.kubernetes.io/region": "region-1"},
                }
            }
            await api.request("POST", "/api/v1/nodes", node, ok=(201, 409))
            await api.create(
                f"/api/v1/namespaces/{ns}/services", service("web", {"eds.group": "web", "eds.port": "http"}, port)
            )

            async def add_pod(i: int, ready: bool = True) -> None:
                await api.create(f"/api/v1/namespaces/{ns}/pods", pod(f"web-{i}", port))
                await api.merge(f"/api/v1/namespaces/{ns}/pods/web-{i}/status", pod_status(ips[i], ready))

            await add_pod(0)
            await add_pod(1)
        async with stack(
            kube,
            tmp_path,
            "--kubernetes-namespace",
            ns,
            "--kubernetes-node-regions",
            clusters=("web", "web2"),
            proxy=proxy,
        ) as s:
            pods = f"/api/v1/namespaces/{ns}/pods"
            hosts = await s.wait_hosts(lambda h: set(h) == {ips[0], ips[1]})
            assert {h.health for h in hosts.values()} == {"HEALTHY"}
            assert hosts[ips[0]].hostname == "web-0" and hosts[ips[0]].port == port
            assert hosts[ips[0]].locality[:2] == ("region-1", "zone-a")
            assert set(await hits_through(s.envoy, 20)) == {"web-0", "web-1"}

            # scale up, then down (a Pod removed at once)
            await s.api.create(pods, pod("web-2", port))
            await s.api.merge(f"{pods}/web-2/status", pod_status(ips[2], True))
            await s.wait_hosts(lambda h: set(h) == set(ips[:3]))
            await s.api.delete(f"{pods}/web-2", gracePeriodSeconds=0)
            await s.wait_hosts(lambda h: set(h) == set(ips[:2]))

            # readiness flips: a Pod that is not ready is left out, and comes back
            await s.api.merge(f"{pods}/web-1/status", pod_status(ips[1], False))
            await s.wait_hosts(lambda h: set(h) == {ips[0]})
            await s.api.merge(f"{pods}/web-1/status", pod_status(ips[1], True))
            await s.wait_hosts(lambda h: set(h) == {ips[0], ips[1]})

            # graceful delete: terminating and still serving -> DRAINING (no new requests), then gone
            await s.api.delete(f"{pods}/web-1", gracePeriodSeconds=30)
            hosts = await s.wait_hosts(lambda h: h.get(ips[1]) is not None and h[ips[1]].health == "DRAINING")
            assert hosts[ips[0]].health == "HEALTHY"
            assert set(await hits_through(s.envoy, 10)) == {"web-0"}
            await s.api.delete(f"{pods}/web-1", gracePeriodSeconds=0)  # what the kubelet does at the end
            await s.wait_hosts(lambda h: set(h) == {ips[0]})

            # annotation changes: weight, then the group itself
            await s.api.merge(
                f"/api/v1/namespaces/{ns}/services/web", {"metadata": {"annotations": {"eds.weight": "7"}}}
            )
            await s.wait_hosts(lambda h: [x.weight for x in h.values()] == [7])
            await s.api.merge(
                f"/api/v1/namespaces/{ns}/services/web", {"metadata": {"annotations": {"eds.group": "web2"}}}
            )
            await s.wait_hosts(lambda h: set(h) == {ips[0]}, cluster="web2")
            await s.wait_hosts(lambda h: h == {})
            # an invalid annotation: the Service is skipped with a warning naming it; the rest goes on
            await s.api.merge(
                f"/api/v1/namespaces/{ns}/services/web", {"metadata": {"annotations": {"eds.weight": "0"}}}
            )
            await s.wait_hosts(lambda h: h == {}, cluster="web2")
            assert "Service e2e/web: annotation eds.weight: '0' is not a weight" in s.server.log_text()
            await s.api.merge(
                f"/api/v1/namespaces/{ns}/services/web", {"metadata": {"annotations": {"eds.weight": "3"}}}
            )
            await s.wait_hosts(lambda h: set(h) == {ips[0]}, cluster="web2")

            # Service deleted: its group is emptied
            await s.api.delete(f"/api/v1/namespaces/{ns}/services/web")
            await s.wait_hosts(lambda h: h == {}, cluster="web2")
            source = await s.source()
            assert source["connected"] and source["watches"] == 3  # one per kind (Nodes too), one namespace
            await s.api.delete(f"{pods}/web-0", gracePeriodSeconds=0)
            assert proxy.refused == [] and set(proxy.targets) <= {f"web-{i}:{port}" for i in range(len(ips))}


async def test_apiserver_restart_and_outage_keep_endpoints(kube: KubeCluster, tmp_path: Path) -> None:
    """kube-apiserver restarted, then away for 30 s: Envoy keeps every endpoint, eds-server stays
    ready and marks the source stale; afterwards the watch re-lists (410) and follows changes again."""
    ns, port = "restart", free_port()
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("api", {"eds.group": "web"}, port, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("api-1", "api", port, [pod_ip(2), pod_ip(3), pod_ip(4)]),
        )
    async with stack(kube, tmp_path, "--kubernetes-namespace", ns) as s:
        await s.wait_hosts(lambda h: len(h) == 3)
        version = await s.envoy.version_text("web")
        before = await s.source()

        kube.stop_apiserver()  # a restart, as SIGHUP to the start script does
        kube.start_apiserver()
        await s.envoy.wait_for(
            s.source, lambda src: src["connected"] and src["relists"] > before["relists"], timeout=60
        )
        assert len(await s.hosts()) == 3 and await s.envoy.version_text("web") == version

        kube.stop_apiserver()
        for _ in range(30):  # 30 s without an API server
            await asyncio.sleep(1)
            assert len(await s.hosts()) == 3
        source = await s.source()
        assert source["stale"] and not source["connected"]
        assert (await s.server.admin("/readyz"))["ready"] is True  # readiness unaffected once loaded
        assert await s.envoy.version_text("web") == version  # nothing was pushed meanwhile
        kube.start_apiserver()
        await s.envoy.wait_for(s.source, lambda src: src["connected"], timeout=60)
        async with KubeApi(kube) as api:
            await api.merge(
                f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/api-1",
                {"endpoints": [{"addresses": [pod_ip(2)], "conditions": {"ready": True}}]},
            )
        await s.wait_hosts(lambda h: set(h) == {pod_ip(2)})
        said = failure_lines(s.server.log_text())
        assert said and all("reconnecting in" in line for line in said), said


SLICE_WATCH_RV = re.compile(r"/endpointslices\?watch=1&\S*resourceVersion=(\d+)")
REPR = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|<\w+")  # an exception's class name or repr


def failure_lines(log: str) -> list[str]:
    """What eds-server said when the API server went away: in words, without an exception's repr."""
    lines = [line for line in log.splitlines() if "kubernetes: " in line and "reconnecting in" in line]
    assert not any(REPR.search(line) for line in lines), lines
    return lines


async def test_a_change_right_after_an_outage_arrives_within_seconds(kube: KubeCluster, tmp_path: Path) -> None:
    """The API server away for ~10 s, then back: the backoff (grown to several seconds by then) is
    cut short once /readyz answers, so a change made right after it returns reaches Envoy within
    a few seconds; meanwhile every endpoint is kept (fail static)."""
    ns, port = "outage", free_port()
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("api", {"eds.group": "web"}, port, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("api-1", "api", port, [pod_ip(2), pod_ip(3)]),
        )
    async with stack(kube, tmp_path, "--kubernetes-namespace", ns) as s:
        await s.wait_hosts(lambda h: set(h) == {pod_ip(2), pod_ip(3)})
        loop = asyncio.get_running_loop()
        kube.stop_apiserver()
        away = loop.time()
        while loop.time() - away < 10:
            await asyncio.sleep(1)
            assert set(await s.hosts()) == {pod_ip(2), pod_ip(3)}
        assert (await s.source())["stale"]
        kube.start_apiserver()
        async with KubeApi(kube) as api:
            back = loop.time()
            await api.merge(
                f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/api-1",
                {"endpoints": [{"addresses": [pod_ip(4)], "conditions": {"ready": True}}]},
            )
        await s.wait_hosts(lambda h: set(h) == {pod_ip(4)}, timeout=6)
        print(f"change after the outage reached Envoy {loop.time() - back:.1f} s after the API server was back")
        await s.envoy.wait_for(s.source, lambda src: src["connected"] and not src["stale"], timeout=5)
        said = failure_lines(s.server.log_text())
        assert 1 <= len(said) <= 3 and all("the API server" in line for line in said), said  # not one per retry


async def test_a_rewritten_kubeconfig_is_used_at_the_next_attempt(kube: KubeCluster, tmp_path: Path) -> None:
    """A revoked token: 401s, backed off for a while; the kubeconfig rewritten with a new valid token
    ends the backoff and is used at once, not after the next delay."""
    ns, sa, port = "rotate", "eds", free_port()
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.create(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}})
        for doc in _manifests("rbac-namespaced.yaml"):
            doc["metadata"]["namespace"] = ns
            if doc["kind"] == "RoleBinding":
                doc["subjects"] = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
            await apply(api, doc, dry_run=False)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("web", {"eds.group": "web"}, port, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("web-1", "web", port, [pod_ip(2)]),
        )
        token_a = await bound_token(api, ns, sa, "token-a")
        token_b = await bound_token(api, ns, sa, "token-b")
    config = tmp_path / "rotating.kubeconfig"
    config.write_text(kube.kubeconfig_for(token_a, sa))
    async with stack(kube, tmp_path, "--kubernetes-namespace", ns, kubeconfig=config) as s:
        await s.wait_hosts(lambda h: set(h) == {pod_ip(2)})
        await s.api.delete(f"/api/v1/namespaces/{ns}/secrets/token-a")  # token A revoked...
        kube.stop_apiserver()  # ...and the watches made with it ended (a restart clears the token cache too)
        kube.start_apiserver()
        await s.envoy.wait_for(s.source, lambda src: "401" in str(src["last_error"]), timeout=30)
        await asyncio.sleep(8)  # refused for a while: the backoff has grown to seconds
        assert not (await s.source())["connected"]
        loop = asyncio.get_running_loop()
        new = tmp_path / "rotating.kubeconfig.new"
        new.write_text(kube.kubeconfig_for(token_b, sa))
        new.replace(config)  # as kubectl and mounted Secrets do
        rotated = loop.time()
        await s.api.merge(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/web-1",
            {"endpoints": [{"addresses": [pod_ip(3)], "conditions": {"ready": True}}]},
        )
        await s.wait_hosts(lambda h: set(h) == {pod_ip(3)}, timeout=5)
        print(f"rewritten kubeconfig used; the change reached Envoy {loop.time() - rotated:.1f} s after the rewrite")
        assert "configuration loaded again (its files changed)" in s.server.log_text()
        said = failure_lines(s.server.log_text())
        assert any("the API server refused our credentials (401)" in line for line in said), said
        await s.envoy.wait_for(s.source, lambda src: src["connected"] and src["last_error"] is None, timeout=3)


async def test_readyz_stays_ok_while_the_apiserver_is_away(kube: KubeCluster, tmp_path: Path) -> None:
    """Readiness is about having loaded once, not about the API server being up now."""
    ns = "ready"
    async with KubeApi(kube) as api:
        await api.namespace(ns)
    async with stack(kube, tmp_path, "--kubernetes-namespace", ns) as s:
        kube.stop_apiserver()
        try:
            await s.envoy.wait_for(s.source, lambda src: src["stale"], timeout=60)
            await s.server.wait_ready(timeout=2)  # /readyz still 200
        finally:
            kube.start_apiserver()


def _manifests(*names: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in names:
        docs.extend(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return docs


_PLURAL = {
    "Namespace": "namespaces",
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Service": "services",
    "ConfigMap": "configmaps",
}


def _path(doc: dict[str, Any]) -> str:
    group = doc["apiVersion"]
    base = "/api/v1" if group == "v1" else f"/apis/{group}"
    ns = doc["metadata"].get("namespace")
    where = f"/namespaces/{ns}" if ns else ""
    return f"{base}{where}/{_PLURAL[doc['kind']]}/{doc['metadata']['name']}"


async def apply(api: KubeApi, doc: dict[str, Any], dry_run: bool) -> None:
    """Server-side apply, with strict field validation (an unknown or misspelt field fails)."""
    params = {"fieldManager": "eds-server-tests", "fieldValidation": "Strict", "force": "true"}
    if dry_run:
        params["dryRun"] = "All"
    await api.request("PATCH", _path(doc), json.dumps(doc), content_type="application/apply-patch+yaml", **params)


async def test_manifests_apply_to_a_real_apiserver(kube: KubeCluster) -> None:
    files = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name not in ("kustomization.yaml", "envoy-outside.yaml"))
    kustomized = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert set(kustomized) <= set(files)
    async with KubeApi(kube) as api:
        for ns in ("eds-system", "shop"):  # dry runs of namespaced objects need the namespace
            await api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}}, ok=(201, 409))
        for doc in _manifests(*files):
            await apply(api, doc, dry_run=True)


async def bound_token(api: KubeApi, namespace: str, account: str, secret: str) -> str:
    """A token that a deleted Secret revokes."""
    made = await api.create(f"/api/v1/namespaces/{namespace}/secrets", {"metadata": {"name": secret}})
    ref = {"kind": "Secret", "apiVersion": "v1", "name": secret, "uid": made["metadata"]["uid"]}
    got = await api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"spec": {"expirationSeconds": 3600, "boundObjectRef": ref}},
    )
    return str(got["status"]["token"])


async def token_for(api: KubeApi, namespace: str, account: str) -> str:
    got = await api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", {"spec": {"expirationSeconds": 3600}}
    )
    return str(got["status"]["token"])


async def test_least_privilege_rbac_from_the_manifests(kube: KubeCluster, tmp_path: Path) -> None:
    """The shipped RBAC, applied for real: the namespaced Role is enough for --kubernetes-namespace
    (and not for a cluster-wide watch); the ClusterRole is enough cluster-wide."""
    port = free_port()
    async with KubeApi(kube) as api:
        for ns in ("eds-system", "shop"):
            await api.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}}, ok=(201, 409))
        sa, *_ = _manifests("rbac.yaml")
        await apply(api, sa, dry_run=False)
        for doc in _manifests("rbac-namespaced.yaml"):
            await apply(api, doc, dry_run=False)
        await api.create("/api/v1/namespaces/shop/services", service("web", {"eds.group": "web"}, port, False))
        await api.create(
            "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices",
            endpoint_slice("web-1", "web", port, [pod_ip(2)]),
        )
        token = await token_for(api, "eds-system", "eds-server")
    config = tmp_path / "sa.kubeconfig"
    config.write_text(kube.kubeconfig_for(token, "eds-server"))
    async with stack(kube, tmp_path, "--kubernetes-namespace", "shop", kubeconfig=config) as s:
        await s.wait_hosts(lambda h: set(h) == {pod_ip(2)})
    # the same account, cluster-wide: forbidden, so never loaded (and it says why)
    server = EdsServerProcess(
        None, "--kubernetes", "--kubeconfig", str(config), "--startup-timeout", "60s", workdir=tmp_path
    )
    await server.start(wait_ready=False)
    try:
        with pytest.raises(RuntimeError, match="not ready"):
            await server.wait_ready(timeout=3)
        sources = await server.admin("/v1/sources")
        items = sources if isinstance(sources, list) else sources.get("sources", [])
        k8s = next(x for x in items if x["name"] == "kubernetes")
        assert not k8s["loaded"] and "403" in str(k8s["last_error"])
    finally:
        await server.__aexit__(None, None, None)
    # the ClusterRole: cluster-wide works
    async with KubeApi(kube) as api:
        for doc in _manifests("rbac.yaml"):
            await apply(api, doc, dry_run=False)
    async with stack(kube, tmp_path, kubeconfig=config) as s:
        await s.wait_hosts(lambda h: pod_ip(2) in h)


async def test_in_cluster_token_is_read_again(
    kube: KubeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-cluster credentials: the token file is read again, so a rotated token is used by the next
    request and the old one can be revoked without an error (in-process, with the library's refresh
    period shortened from 60 s to 1 s and the service account files in a temporary directory)."""
    from kubernetes_asyncio.config import incluster_config

    from eds_server.encode import encode_group
    from eds_server.sources.kubernetes import KubernetesSource
    from eds_server.sources.kubernetes_map import KubernetesOptions
    from eds_server.store import Store

    ns, sa = "tokens", "eds"
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.create(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}})
        role = _manifests("rbac-namespaced.yaml")
        for doc in role:
            doc["metadata"]["namespace"] = ns
            if doc["kind"] == "RoleBinding":
                doc["subjects"] = [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
            await apply(api, doc, dry_run=False)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("web", {"eds.group": "web"}, 8080, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("web-1", "web", 8080, [pod_ip(2)]),
        )

        async def bound_token(secret: str) -> str:
            made = await api.create(f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": secret}})
            got = await api.create(
                f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                {
                    "spec": {
                        "expirationSeconds": 3600,
                        "boundObjectRef": {
                            "kind": "Secret",
                            "apiVersion": "v1",
                            "name": secret,
                            "uid": made["metadata"]["uid"],
                        },
                    }
                },
            )
            return str(got["status"]["token"])

        token_file = tmp_path / "token"
        token_a = await bound_token("token-a")
        token_file.write_text(token_a)
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(kube.ca))
        monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(seconds=1))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        monkeypatch.delenv("KUBECONFIG", raising=False)

        store = Store(encode_group)
        source = alone(KubernetesSource, store, KubernetesOptions(namespaces=(ns,)), watch_timeout=1)
        async with serving_web(source, store):
            loads = source.loads
            # rotate: a new token in the file, then the old one revoked (its Secret deleted)
            token_file.write_text(await bound_token("token-b"))
            await asyncio.sleep(1.5)
            await api.delete(f"/api/v1/namespaces/{ns}/secrets/token-a")
            review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
            async with KubeApi(kube, token_a) as old:
                for _ in range(30):  # the API server's token cache keeps it valid for up to ~10 s
                    answer = await old.request(
                        "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review, ok=(201, 401)
                    )
                    if answer.get("code") == 401:
                        break
                    await asyncio.sleep(1)
                assert answer.get("code") == 401, "token A was not revoked"
            events_before = source.events
            await asyncio.sleep(3)  # watches end every second and resume with the token of the moment
            await api.merge(
                f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/web-1",
                {"endpoints": [{"addresses": [pod_ip(3)], "conditions": {"ready": True}}]},
            )
            for _ in range(100):
                group = store.resources()["web"].group
                if {ep.address for ep in group.endpoints} == {pod_ip(3)}:
                    break
                await asyncio.sleep(0.1)
            assert {ep.address for ep in store.resources()["web"].group.endpoints} == {pod_ip(3)}
            assert source.connected and source.last_error is None, source.last_error
            assert source.loads == loads  # no 401 and reload: the hook read the new token
            assert source.events > events_before


async def test_a_frozen_apiserver_is_said_stale_within_the_bound_and_envoy_keeps_its_hosts(
    kube: KubeCluster, tmp_path: Path
) -> None:
    """kube-apiserver SIGSTOPped: its port accepts and the watches stay open, nothing answers (the
    watch read timeout alone would take minutes). The source is said stale within the stated bound
    (/v1/sources, /readyz, /metrics), Envoy keeps every host meanwhile, and after SIGCONT the source
    follows again and a change reaches Envoy."""
    ns, port = "frozen", free_port()
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("api", {"eds.group": "web"}, port, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("api-1", "api", port, [pod_ip(2), pod_ip(3)]),
        )
    async with stack(kube, tmp_path, "--kubernetes-namespace", ns) as s:
        await s.wait_hosts(lambda h: len(h) == 2)
        await wait_source(s.server, "kubernetes", stale=False, timeout=20)
        version = await s.envoy.version_text("web")
        with kube.apiserver_frozen():
            frozen_at = time.monotonic()
            took = await frozen_is_said(s.server, "kubernetes", frozen_at)
            print(f"\nsaid stale {took:.1f} s after kube-apiserver was frozen")
            for _ in range(5):  # frozen for 5 s more: Envoy keeps both hosts, nothing is pushed
                await asyncio.sleep(1)
                assert len(await s.hosts()) == 2
        await wait_source(s.server, "kubernetes", stale=False, timeout=30)
        assert await s.envoy.version_text("web") == version
        async with KubeApi(kube) as api:
            await api.merge(
                f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/api-1",
                {"endpoints": [{"addresses": [pod_ip(2)], "conditions": {"ready": True}}]},
            )
        await s.wait_hosts(lambda h: set(h) == {pod_ip(2)})
        said = failure_lines(s.server.log_text())
        assert any("did not answer within" in line for line in said), said


async def test_a_stalled_watch_connection_is_opened_again_while_the_apiserver_answers(
    kube: KubeCluster, tmp_path: Path
) -> None:
    """eds-server reaches kube-apiserver through a proxy that stalls the EndpointSlices watch in
    flight (no byte either way, nothing closed) while every other connection, the heartbeat's
    /livez included, goes through. A change made right after each stall reaches Envoy within the
    hung-peer wait (the old 60-120 s watches waited their read timeout, 90-150 s), the source is never
    said stale, and it does not list again: the short watches resume from the bookmark the watch
    cache sends before each ends, while another namespace's EndpointSlices keep changing (the cache
    moves on) and this one stays quiet between the changes."""
    ns, busy, port = "stalled", "busy", free_port()
    async with KubeApi(kube) as api:
        for name in (ns, busy):
            await api.namespace(name)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("api", {"eds.group": "web"}, port, False))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            endpoint_slice("api-1", "api", port, [pod_ip(2), pod_ip(3)]),
        )
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{busy}/endpointslices",
            endpoint_slice("other-1", "other", port, [pod_ip(20)]),
        )
    loop = asyncio.get_running_loop()
    async with WatchStallProxy(kube.port, kube.ca, tmp_path / "proxy") as proxy:
        config = tmp_path / "proxied.kubeconfig"
        config.write_text(proxy.kubeconfig(kube.token))
        async with stack(kube, tmp_path, "--kubernetes-namespace", ns, kubeconfig=config) as s, KubeApi(kube) as api:

            async def churn() -> None:  # elsewhere: a change every 0.5 s, bounded
                for i in range(400):
                    await api.merge(
                        f"/apis/discovery.k8s.io/v1/namespaces/{busy}/endpointslices/other-1",
                        {"endpoints": [{"addresses": [pod_ip(20 + i % 50)], "conditions": {"ready": True}}]},
                    )
                    await asyncio.sleep(0.5)

            async def slice_watches() -> int:
                return sum("/endpointslices?" in line and "watch=1" in line for line in proxy.lines)

            churning = asyncio.create_task(churn())
            try:
                await s.wait_hosts(lambda h: set(h) == {pod_ip(2), pod_ip(3)})
                first = await s.source()
                # quiet here for 12 s: the watches are renewed, nothing is listed again
                counted, since, seen = Counter(proxy.requests), loop.time(), len(proxy.lines)
                await asyncio.sleep(12)
                quiet = await s.source()
                spent = proxy.requests - counted
                print(
                    f"\nquiet, {loop.time() - since:.0f} s: {dict(spent)} requests through the proxy, "
                    f"{quiet['renewals'] - first['renewals']} renewals"
                )
                assert quiet["renewals"] - first["renewals"] >= 4 and quiet["relists"] == first["relists"]
                assert spent["list"] == 0 and spent["watch"] >= 4
                # the EndpointSlices watches resumed from newer versions, with nothing new here: the
                # bookmarks' (the other namespace moved the cache on)
                versions = [int(v) for v in SLICE_WATCH_RV.findall("\n".join(proxy.lines[seen:]))]
                assert versions == sorted(versions) and len(set(versions)) >= 2, versions

                for n in range(3):
                    stalled: list[str] = []
                    for _ in range(100):  # the EndpointSlices watch in flight (it is renewed every 4 s)
                        stalled = proxy.stall_watches("/endpointslices?")
                        if stalled:
                            break
                        await asyncio.sleep(0.05)
                    assert len(stalled) == 1 and "watch=1" in stalled[0], stalled
                    stalled_at, asked = loop.time(), await slice_watches()
                    ip = pod_ip(4 + n)
                    await api.merge(
                        f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/api-1",
                        {"endpoints": [{"addresses": [ip], "conditions": {"ready": True}}]},
                    )

                    async def arrived(ip: str = ip) -> bool:  # never stale on the way
                        source = await s.source()
                        assert source["connected"] and not source["stale"], source
                        return set(await s.hosts()) == {ip}

                    await s.envoy.wait_for(arrived, lambda done: done, timeout=HUNG_WAIT)
                    print(f"change {n + 1} reached Envoy {loop.time() - stalled_at:.1f} s after its watch stalled")
                    # the next stall comes after the re-opened watch's proper end (one opened again that
                    # stalls too is a failure, by design): the watch after it asked
                    await s.envoy.wait_for(slice_watches, lambda n, asked=asked: n >= asked + 2, timeout=HUNG_WAIT)
            finally:
                churning.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await churning
            last = await s.source()
            assert len(proxy.stalled) == 3 and last["reopened"] - first["reopened"] == 3, (proxy.stalled, last)
            assert last["relists"] == first["relists"] and last["connected"] and not last["stale"]
            assert failure_lines(s.server.log_text()) == []  # never said failing


async def expired(api: KubeApi, path: str, version: str) -> bool:
    """Whether a watch from `version` without bookmarks gets 410 Gone: the watch cache no longer holds it."""
    assert api.session is not None
    params = {"watch": "1", "resourceVersion": version, "timeoutSeconds": "1"}
    async with api.session.get(api.url + path, params=params, ssl=api.ssl) as r:
        text = await r.text()
    return r.status == 410 or '"code":410' in text


async def test_a_quiet_namespace_is_not_listed_again_when_the_watch_cache_moves_past_its_listing(
    kube: KubeCluster,
) -> None:
    """Another namespace's EndpointSlices change about five times a second until the watch cache no
    longer holds the version this namespace was listed at (it keeps 75 s of history, then drops the
    oldest: a watch from that version gets 410), and a few seconds more. This namespace's watches,
    renewed every 4 s meanwhile with nothing new here, resume from the bookmarks' versions and never
    list again (watches without bookmarks would resume from the listing's version, and list again)."""
    from eds_server.encode import encode_group
    from eds_server.sources.kubernetes import KubernetesSource
    from eds_server.sources.kubernetes_map import KubernetesOptions
    from eds_server.store import Store

    ns, busy = "window", "window-busy"
    slices = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    async with KubeApi(kube) as api:
        for name in (ns, busy):
            await api.namespace(name)
        await api.create(f"/api/v1/namespaces/{ns}/services", service("web", {"eds.group": "web"}, 8080, False))
        await api.create(slices, endpoint_slice("web-1", "web", 8080, [pod_ip(2)]))
        await api.create(
            f"/apis/discovery.k8s.io/v1/namespaces/{busy}/endpointslices",
            endpoint_slice("other-1", "other", 8080, [pod_ip(20)]),
        )
        store = Store(encode_group)
        source = alone(KubernetesSource, store, KubernetesOptions(kubeconfig=str(kube.kubeconfig), namespaces=(ns,)))
        async with serving_web(source, store):
            listed = str((await api.get(slices))["metadata"]["resourceVersion"])  # not older than the source's
            renewals, loop = source.renewals, asyncio.get_running_loop()
            started, writes, gone = loop.time(), 0, False

            async def write() -> None:
                nonlocal writes
                await api.merge(
                    f"/apis/discovery.k8s.io/v1/namespaces/{busy}/endpointslices/other-1",
                    {"endpoints": [{"addresses": [pod_ip(20 + writes % 50)], "conditions": {"ready": True}}]},
                )
                writes += 1
                await asyncio.sleep(0.2)

            for _ in range(80):  # at most ~2,000 writes
                for _ in range(25):
                    await write()
                if await expired(api, slices, listed):
                    gone = True
                    break
            assert gone, "the watch cache still holds the listing's version"
            print(f"\nthe listing's version left the watch cache {loop.time() - started:.0f} s and {writes} writes on")
            for _ in range(30):  # ~6 s more: a renewal or more after that
                await write()
            print(f"{source.renewals - renewals} renewals, {source.relists} relists, {source.reopened} reopened")
            assert source.relists == 0 and source.renewals - renewals >= 20
            assert source.connected and "web" in store.resources()


async def test_a_health_check_annotated_on_a_service_takes_its_pod_out_and_back(
    kube: KubeCluster, tmp_path: Path
) -> None:
    """`eds.health.*` annotations on a Service: eds-server checks the Pod's own address (a backend in a
    network namespace this test makes, reached over a veth pair), and Envoy sees the Pod unhealthy
    while its /health answers 500, healthy again once it answers 200."""
    with private_link() as link:
        ns, port = "health", free_port()
        health = tmp_path / "health-status"
        health.write_text("200")
        backend = await asyncio.create_subprocess_exec(
            "ip",
            "netns",
            "exec",
            link.namespace,
            sys.executable,
            "-m",
            "tests.support.netns_backend",
            link.inside,
            str(port),
            "web-0",
            str(health),
            "300",  # it stops by itself after that, whatever happens here
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert backend.stdout is not None
            assert await asyncio.wait_for(backend.stdout.readline(), 30) == b"listening\n"
            annotations = {
                "eds.group": "web",
                "eds.health.http": "/health",
                "eds.health.interval": "500ms",
                "eds.health.timeout": "400ms",
                "eds.health.healthy_threshold": "2",
                "eds.health.unhealthy_threshold": "2",
            }
            async with KubeApi(kube) as api:
                await api.namespace(ns)
                await api.create(f"/api/v1/namespaces/{ns}/services", service("web", annotations, port, False))
                await api.create(
                    f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                    endpoint_slice("web-1", "web", port, [link.inside]),
                )
            async with stack(kube, tmp_path, "--kubernetes-namespace", ns) as s:

                async def served() -> dict[str, Any]:
                    group = await s.server.admin("/v1/groups/web")
                    return next(e for e in group["endpoints"] if e["address"] == link.inside)

                await s.wait_hosts(lambda h: set(h) == {link.inside})
                ep = await s.envoy.wait_for(served, lambda e: e.get("check", {}).get("checked") == "healthy")
                assert ep["check"]["spec"] == "http /health every 0.5s" and ep["check"]["reason"] == "HTTP 200"
                await s.wait_hosts(lambda h: h[link.inside].health == "HEALTHY")
                assert await hits_through(s.envoy, 5) == {"web-0": 5}

                health.write_text("500")
                await s.wait_hosts(lambda h: h[link.inside].health == "UNHEALTHY")
                ep = await served()
                assert ep["health"] == "unhealthy" and ep["check"]["checked"] == "unhealthy", ep
                assert ep["check"]["reason"] == "HTTP 500" and ep["check"]["in_a_row"] >= 2, ep

                health.write_text("200")
                await s.wait_hosts(lambda h: h[link.inside].health == "HEALTHY")
                ep = await served()
                assert ep["check"]["checked"] == "healthy" and ep["check"]["reason"] == "HTTP 200", ep
                assert (await s.source())["connected"]
        finally:
            if backend.returncode is None:
                backend.terminate()
            await asyncio.wait_for(backend.wait(), 10)
