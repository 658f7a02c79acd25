"""The probes against real sockets on 127.0.0.1: what passes, what fails, and that a hung or
drip-feeding backend costs one timeout."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.server import Server

from eds_server.health import probes
from eds_server.health.spec import HealthSpec
from tests.support.ports import free_port
from tests.support.tls import CertAuthority

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@asynccontextmanager
async def web_backend(tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/health":
            return web.Response(text="ok")
        if request.path == "/moved":
            raise web.HTTPFound("http://127.0.0.9:1/elsewhere")
        return web.Response(status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()
        assert "/elsewhere" not in seen


async def test_http_statuses_and_no_redirects() -> None:
    async with web_backend() as port:
        ok = await probes.check("127.0.0.1", port, HealthSpec("http", path="/health"))
        assert ok.ok and ok.reason == "HTTP 200" and ok.latency > 0
        bad = await probes.check("127.0.0.1", port, HealthSpec("http", path="/broken"))
        assert not bad.ok and bad.reason == "HTTP 500"
        moved = await probes.check("127.0.0.1", port, HealthSpec("http", path="/moved"))
        assert not moved.ok and moved.reason == "HTTP 302"
        expected = HealthSpec("http", path="/moved", expected_statuses=((200, 399),))
        assert (await probes.check("127.0.0.1", port, expected)).ok


async def test_spec_port_replaces_the_endpoints() -> None:
    async with web_backend() as port:
        assert (await probes.check("127.0.0.1", free_port(), HealthSpec("http", path="/health", port=port))).ok


async def test_refused_and_tcp() -> None:
    closed = free_port()
    refused = await probes.check("127.0.0.1", closed, HealthSpec("http", path="/"))
    assert not refused.ok and refused.reason == "connection refused"
    assert not (await probes.check("127.0.0.1", closed, HealthSpec("tcp"))).ok
    async with web_backend() as port:
        assert (await probes.check("127.0.0.1", port, HealthSpec("tcp"))).reason == "connected"


async def test_hung_and_drip_feeding_backends_cost_one_timeout() -> None:
    closed = asyncio.Event()

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the request arrives, nothing answers; EOF when the probe gives up
        await reader.read()
        closed.set()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(50):  # bounded: 5 s at most
            writer.write(b"H")
            await writer.drain()
            await asyncio.sleep(0.1)

    spec = HealthSpec("http", path="/", interval=1.0, timeout=0.3)
    async with raw_server(hung) as port:
        r = await probes.check("127.0.0.1", port, spec)
        assert not r.ok and r.reason == "timed out after 0.3s"
        await asyncio.wait_for(closed.wait(), 5)  # its connection was closed, not held
    async with raw_server(drip) as port:
        r = await probes.check("127.0.0.1", port, spec)
        assert not r.ok and r.reason == "timed out after 0.3s"


async def test_endless_status_line_and_garbage() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 " + b"x" * (2 * probes.MAX_HEAD))
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n")
        await writer.drain()

    async with raw_server(endless) as port:
        r = await probes.check("127.0.0.1", port, HealthSpec("http"))
        assert not r.ok and "longer than" in r.reason
    async with raw_server(garbage) as port:
        r = await probes.check("127.0.0.1", port, HealthSpec("http"))
        assert not r.ok and "not an HTTP status line" in r.reason


class Cart:
    """A service by name only: what grpclib's Health service reports on."""

    def __mapping__(self) -> dict[str, object]:
        return {"/shop.Cart/Get": None}


async def test_grpc_health_v1() -> None:
    status = ServiceStatus()
    status.set(True)
    server = Server([Health({Cart(): [status]})])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        whole = await probes.check("127.0.0.1", port, HealthSpec("grpc"))
        assert whole.ok and whole.reason == "gRPC SERVING", whole
        named = await probes.check("127.0.0.1", port, HealthSpec("grpc", service="shop.Cart"))
        assert named.ok, named
        status.set(False)
        down = await probes.check("127.0.0.1", port, HealthSpec("grpc", service="shop.Cart"))
        assert not down.ok and down.reason == "gRPC NOT_SERVING", down
        unknown = await probes.check("127.0.0.1", port, HealthSpec("grpc", service="nope"))
        assert not unknown.ok and unknown.reason == "gRPC status NOT_FOUND", unknown  # Check's answer to it
    finally:
        server.close()
        await server.wait_closed()
    assert not (await probes.check("127.0.0.1", port, HealthSpec("grpc"))).ok


async def test_https_checks_encrypt_without_verifying(tmp_path: Path) -> None:
    ca = CertAuthority("backend CA", tmp_path)
    issued = ca.issue(tmp_path / "backend", dns=["backend.internal"])  # names no IP, as usual
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(issued.cert, issued.key)
    async with web_backend(server_tls) as port:
        ok = await probes.check("127.0.0.1", port, HealthSpec("http", path="/health", tls=True))
        assert ok.ok and ok.reason == "HTTP 200", ok
        plain = await probes.check("127.0.0.1", port, HealthSpec("http", path="/health"))
        assert not plain.ok, plain  # plain HTTP to a TLS port
    async with web_backend() as port:
        r = await probes.check("127.0.0.1", port, HealthSpec("http", path="/health", tls=True))
        assert not r.ok and r.reason.startswith("TLS"), r


async def test_grpc_checks_over_tls_encrypt_without_verifying_over_ipv4_and_ipv6(tmp_path: Path) -> None:
    ca = CertAuthority("backend CA", tmp_path)
    issued = ca.issue(tmp_path / "backend", dns=["backend.internal"])  # names no IP, as usual
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(issued.cert, issued.key)
    server_tls.set_alpn_protocols(["h2"])  # as gRPC servers over TLS ask
    names: list[str | None] = []
    server_tls.sni_callback = lambda _sock, name, _ctx: names.append(name)
    status = ServiceStatus()
    status.set(True)
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        for tls in (server_tls, None):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            server = Server([Health({Cart(): [status]})])
            await server.start(sock=sock, ssl=tls)
            try:
                secure = await probes.check(host, port, HealthSpec("grpc", service="shop.Cart", tls=True))
                plain = await probes.check(host, port, HealthSpec("grpc", service="shop.Cart"))
            finally:
                server.close()
                await server.wait_closed()
            if tls is not None:
                assert secure.ok and secure.reason == "gRPC SERVING", secure
                assert not plain.ok, plain  # plain HTTP/2 to a TLS port
            else:
                assert not secure.ok and secure.reason.startswith("TLS"), secure
                assert plain.ok, plain
    assert names == [None, None], names  # an IP is no server name: none sent, as for HTTPS


async def test_a_timeout_as_the_connection_is_made_leaves_no_unretrieved_failure() -> None:
    """The check's timeout may end create_connection after the connection was made: the connection,
    closed then, still fails the status-line future that no one awaits any more. asyncio would log
    "Future exception was never retrieved" for a check already counted as timed out."""
    loop = asyncio.get_running_loop()
    real = loop.create_connection
    made: list[asyncio.BaseTransport] = []

    async def made_then_timed_out(*args: Any, **kwargs: Any) -> Any:
        transport, _ = await real(*args, **kwargs)
        made.append(transport)
        transport.abort()  # what the cancelled create_connection does with it
        raise TimeoutError

    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    try:
        async with raw_server(hung) as port:
            setattr(loop, "create_connection", made_then_timed_out)  # noqa: B010 (this loop only)
            try:
                r = await probes.check("127.0.0.1", port, HealthSpec("http", path="/", interval=1.0, timeout=1.0))
            finally:
                delattr(loop, "create_connection")
            assert not r.ok and r.reason == "timed out after 1s" and made
            for _ in range(3):
                await asyncio.sleep(0)  # the connection's loss runs
            gc.collect()  # an unretrieved failure is logged as its future goes
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in unretrieved if "never retrieved" in c.get("message", "")], unretrieved
