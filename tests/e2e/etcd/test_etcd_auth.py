"""eds-server on an etcd that asks for TLS and a password, as a user whose role may read and write
its prefix only (the role docs/registration-api.md tells operators to create)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.etcd_cluster import EtcdCluster, etcd_binary
from tests.support.server_process import EdsServerProcess
from tests.support.tls import CertAuthority
from tests.support.waiting import wait_for

TOKEN = "etcd-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def secure_etcd(tmp_path: Path) -> tuple[EtcdCluster, Path]:
    """One TLS member with auth on: root, and a user `eds` whose role reads and writes /eds/ only."""
    ca = CertAuthority("etcd test CA", tmp_path / "pki")
    server = ca.issue(tmp_path / "pki" / "etcd", ips=["127.0.0.1"], dns=["localhost"])
    cluster = EtcdCluster(tmp_path / "etcd", size=1, tls=(server.cert, server.key, ca.cert_path))
    await cluster.start()
    for path, body in [
        ("/v3/auth/user/add", {"name": "root", "password": "root-password"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": "eds-server"}),
        (
            "/v3/auth/role/grant",
            {"name": "eds-server", "perm": {"permType": "READWRITE", "key": b64("/eds/"), "range_end": b64("/eds0")}},
        ),
        ("/v3/auth/user/add", {"name": "eds", "password": "eds-password"}),
        ("/v3/auth/user/grant", {"user": "eds", "role": "eds-server"}),
        ("/v3/auth/enable", {}),
    ]:
        await cluster.any_call(path, body)
    return cluster, ca.cert_path


async def test_tls_and_a_user_limited_to_the_prefix(tmp_path: Path) -> None:
    etcd_binary()
    cluster, ca = await secure_etcd(tmp_path)
    try:
        (tmp_path / "password").write_text("eds-password\n")
        state = f"etcd://127.0.0.1:{cluster.members[0].client_port}/eds"
        args = (
            "--state",
            state,
            "--etcd-ca",
            str(ca),
            "--etcd-user",
            "eds",
            "--etcd-password-file",
            str(tmp_path / "password"),
            "--admin-token",
            TOKEN,
            "--registration-allow-cidr",
            "127.0.0.0/8",
        )
        async with EdsServerProcess(None, *args, workdir=tmp_path) as server, aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{server.admin_port}/v1/groups/web/endpoints"
            for body, status in [
                ({"address": "127.0.0.1", "port": 1, "ttl": 30}, 201),  # a lease granted, a txn
                ({"address": "127.0.0.1", "port": 1, "ttl": 30}, 200),  # a keep-alive
                ({"address": "127.0.0.1", "port": 2, "ttl": 20}, 200),  # a new lease, the old revoked
            ]:
                async with http.put(f"{base}/a", json=body, headers=AUTH) as r:
                    assert r.status == status, await r.text()
            async with http.delete(f"{base}/a", headers=AUTH) as r:
                assert r.status == 204, await r.text()
            async with http.put(f"{base}/b", json={"address": "127.0.0.1", "port": 3}, headers=AUTH) as r:
                assert r.status == 201
            assert [r["id"] for r in (await server.admin("/v1/registrations"))["registrations"]] == ["b"]
            assert "ERROR" not in server.log_text() and "WARNING" not in server.log_text()

        # the role is what the docs say it is: nothing outside the prefix
        reply = await cluster.any_call("/v3/auth/authenticate", {"name": "eds", "password": "eds-password"})
        cluster.token = reply["token"]
        with pytest.raises(RuntimeError, match="permission denied"):
            await cluster.any_call("/v3/kv/range", {"key": b64("/other")})

        # a wrong password: not ready, and /readyz says why
        (tmp_path / "password").write_text("wrong")
        wrong = EdsServerProcess(None, *args, workdir=tmp_path)
        await wrong.start(wait_ready=False)
        try:
            ready = await wait_for(
                lambda: _readyz(wrong), lambda r: r and r["waiting_for"][0]["last_error"], timeout=5, interval=0.1
            )
            assert ready is not None and not ready["ready"]
            assert "authentication failed" in ready["waiting_for"][0]["last_error"]
        finally:
            await wrong.stop()
    finally:
        await cluster.stop()


async def _readyz(server: EdsServerProcess) -> dict[str, Any] | None:
    try:
        return await server.admin("/readyz")  # type: ignore[no-any-return]
    except aiohttp.ClientError:
        return None


async def test_a_client_certificate_for_an_etcd_that_requires_one(tmp_path: Path) -> None:
    etcd_binary()
    ca = CertAuthority("etcd test CA", tmp_path / "pki")
    server = ca.issue(tmp_path / "pki" / "etcd", ips=["127.0.0.1"], dns=["localhost"])
    client = ca.issue(tmp_path / "pki" / "eds-server", common_name="eds-server")
    cluster = EtcdCluster(
        tmp_path / "etcd", size=1, tls=(server.cert, server.key, ca.cert_path), client_ca=ca.cert_path
    )
    try:
        await cluster.start(client=(client.cert, client.key))
        state = f"etcd://127.0.0.1:{cluster.members[0].client_port}/eds"
        common = ("--state", state, "--admin-token", TOKEN, "--registration-allow-cidr", "127.0.0.0/8")
        ca_file = str(ca.cert_path)
        with_cert = (*common, "--etcd-ca", ca_file, "--etcd-cert", str(client.cert), "--etcd-key", str(client.key))
        async with EdsServerProcess(None, *with_cert, workdir=tmp_path) as server, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{server.admin_port}/v1/groups/web/endpoints/a"
            async with http.put(url, json={"address": "127.0.0.1", "port": 1, "ttl": 30}, headers=AUTH) as r:
                assert r.status == 201, await r.text()
        without = EdsServerProcess(None, *common, "--etcd-ca", ca_file, workdir=tmp_path)
        await without.start(wait_ready=False)
        try:
            ready = await wait_for(
                lambda: _readyz(without), lambda r: r and r["waiting_for"][0]["last_error"], timeout=5, interval=0.1
            )
            assert ready is not None and not ready["ready"]  # refused at the handshake: nothing served
        finally:
            await without.stop()
    finally:
        await cluster.stop()
