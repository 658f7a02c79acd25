"""Every admin answer is JSON, errors included, and says what to do."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

import aiohttp

from tests.support.server_process import EdsServerProcess


async def test_admin_errors_are_json_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
    async with EdsServerProcess(path) as server, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.admin_port}"
        for method, where, status, hint in [
            ("GET", "/v1/registrations", 404, "--state FILE and/or --admin-token"),
            ("PUT", "/v1/groups/web/endpoints/vm-1", 404, "--state FILE and/or --admin-token"),
            ("GET", "/v1/nothing", 404, "/v1/groups"),
            ("GET", "/v1/groups/nope", 404, "GET /v1/groups"),
            ("POST", "/v1/groups", 405, "allowed: GET"),
        ]:
            async with s.request(method, base + where) as r:
                assert r.status == status, (method, where)
                assert r.content_type == "application/json", (method, where)
                body = await r.json()
                assert body["error"], body
                if hint is not None:
                    assert hint in body["hint"], body
        async with s.post(base + "/v1/groups") as r:
            assert r.headers["Allow"] == "GET,HEAD" or "GET" in r.headers["Allow"]


async def test_the_metrics_listener_serves_the_probes_and_nothing_else(tmp_path: Path) -> None:
    """--metrics-listen can be exposed to a scraper on another host: it answers /metrics, /healthz
    and /readyz, and nothing that names groups or clients, or writes (the registration API is on)."""
    from tests.support.ports import free_port

    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
    port = free_port()
    async with (
        EdsServerProcess(
            path,
            "--metrics-listen",
            f"127.0.0.1:{port}",
            "--state",
            str(tmp_path / "state.json"),
            "--admin-token",
            "t" * 32,
        ) as server,
        aiohttp.ClientSession() as s,
    ):
        base = f"http://127.0.0.1:{port}"
        async with s.get(base + "/metrics") as r:
            assert r.status == 200 and "eds_streams_open" in await r.text()
        for where in ("/healthz", "/readyz"):
            async with s.get(base + where) as r:
                assert r.status == 200, where
        for method, where in [
            ("GET", "/"),
            ("GET", "/v1/groups"),
            ("GET", "/v1/streams"),
            ("GET", "/v1/registrations"),
            ("PUT", "/v1/groups/web/endpoints/vm-1"),
            ("POST", "/metrics"),
        ]:
            async with s.request(method, base + where, headers={"Authorization": "Bearer " + "t" * 32}) as r:
                assert r.status in (404, 405), (method, where, r.status)
                body = await r.json()
                if r.status == 404:
                    assert body["hint"] == "paths: /metrics, /healthz, /readyz", body
        async with s.get(f"http://127.0.0.1:{server.admin_port}/v1/groups") as r:
            assert r.status == 200  # the admin port is as it was
    assert f"metrics and probes (read-only: /metrics, /healthz, /readyz) on http://127.0.0.1:{port}" in (
        server.log_text()
    )


async def test_the_metrics_listener_names_no_group_path_or_file_content(tmp_path: Path) -> None:
    """docs/security.md: the --metrics-listen port carries no group, stream or client names, no file
    paths and no file content, degraded or not; the admin port keeps them all."""
    from tests.support.ports import free_port
    from tests.support.server_process import write_atomically
    from tests.support.waiting import wait_for

    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  payments-7f3a:\n    endpoints: [127.0.0.1:8081]\n")
    port = free_port()
    async with (
        EdsServerProcess(path, "--metrics-listen", f"127.0.0.1:{port}") as server,
        aiohttp.ClientSession() as s,
    ):
        probes, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{server.admin_port}"

        async def get(url: str) -> str:
            async with s.get(url) as r:
                assert r.status == 200, url
                return await r.text()

        write_atomically(path, "groups:\n  payments-7f3a:\n    endpoints: [hunter2:99999]\n")  # degraded: quoted
        await wait_for(lambda: get(probes + "/readyz"), lambda text: '"degraded"' in text, timeout=30)
        # the file's refusal itself (a busy host's loop lag says degraded too, before the file is read)
        await wait_for(
            lambda: get(probes + "/metrics"),
            lambda text: 'eds_source_healthy{source="file"} 0.0' in text.splitlines(),
            timeout=30,
        )
        for where in ("/metrics", "/readyz"):
            text = await get(probes + where)
            for secret in ("payments-7f3a", "hunter2", str(tmp_path), "upstreams.yaml"):
                assert secret not in text, (where, secret, text)
        metrics = await get(probes + "/metrics")
        for line in ("eds_groups 1.0", "eds_endpoints 1.0", 'eds_source_healthy{source="file"} 0.0', "eds_state 2.0"):
            assert line in metrics.splitlines(), line
        assert "eds_group_info" not in metrics and "eds_group_endpoints" not in metrics
        readyz = json.loads(await get(probes + "/readyz"))
        assert readyz["state"] == "degraded" and readyz["degraded"] == [{"source": "file"}], readyz
        # the admin port, on loopback, keeps the names, the path and the reason
        assert 'eds_group_info{group="payments-7f3a"' in await get(admin + "/metrics")
        assert f'eds_source_healthy{{source="file:{path}"}} 0.0' in await get(admin + "/metrics")
        assert "hunter2" in (await get(admin + "/readyz"))


async def test_the_admin_port_over_tls_with_the_grpc_certificate(tmp_path: Path) -> None:
    import ssl

    from tests.support.ports import free_port
    from tests.support.tls import CertAuthority
    from tests.support.waiting import wait_for

    ca = CertAuthority("admin CA", tmp_path)
    first = ca.issue(tmp_path / "first", common_name="first", ips=["127.0.0.1"])
    second = ca.issue(tmp_path / "second", common_name="second", ips=["127.0.0.1"])
    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
    probes = free_port()
    server = EdsServerProcess(
        path,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--admin-tls",
        "--metrics-listen",
        f"127.0.0.1:{probes}",
        workdir=tmp_path,
    )
    await server.start(wait_ready=False)  # its readiness check speaks plain HTTP to the admin port
    try:
        async with aiohttp.ClientSession() as s:

            async def ready() -> int:
                async with s.get(f"http://127.0.0.1:{probes}/readyz") as r:
                    return r.status

            await wait_for(ready, lambda status: status == 200, timeout=15, what="ready")
            trusting = ssl.create_default_context(cafile=str(ca.cert_path))
            async with s.get(f"https://127.0.0.1:{server.admin_port}/v1/groups", ssl=trusting) as r:
                assert r.status == 200 and [g["name"] for g in (await r.json())["groups"]] == ["web"]
            try:
                async with s.get(f"http://127.0.0.1:{server.admin_port}/v1/groups") as r:
                    plain = r.status
            except aiohttp.ClientError:
                plain = None
            assert plain in (None, 400)  # plain HTTP gets no answer from the TLS port

            def admin_name() -> str:
                with (
                    socket.create_connection(("127.0.0.1", server.admin_port), timeout=10) as raw,
                    trusting.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
                ):
                    return str(dict(x[0] for x in tls.getpeercert()["subject"])["commonName"])

            assert await asyncio.to_thread(admin_name) == "first"
            cert.write_bytes(second.cert.read_bytes())  # rotated: SIGHUP, as for the gRPC port's
            key.write_bytes(second.key.read_bytes())
            assert server.proc is not None
            server.proc.send_signal(signal.SIGHUP)
            await wait_for(lambda: "SIGHUP: admin TLS certificate" in server.log_text(), timeout=10, what="reload")
            assert await asyncio.to_thread(admin_name) == "second"
    finally:
        assert await server.stop() == 0
    assert f"admin on https://127.0.0.1:{server.admin_port}" in server.log_text()


def test_admin_tls_without_a_certificate_is_one_line() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "eds_server", "serve", "--upstreams", "examples/upstreams.yaml", "--admin-tls"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--admin-tls needs --tls-cert" in out.stderr
    assert out.stderr.count("\n") == 1
