"""An HTTP CONNECT proxy on 127.0.0.1 that reaches "Pod IPs" by mapping them onto loopback addresses.

kube-apiserver refuses loopback addresses in EndpointSlices ("may not be in the loopback range"), so the
Kubernetes tests give Pods addresses from TEST-NET-1 (192.0.2.0/24, RFC 5737: documentation only, never
routed). Envoy's `web` cluster then reaches every endpoint through this proxy (the `http_11_proxy`
transport socket with a default proxy address, around upstream TLS, which is when Envoy sends CONNECT):
it sends `CONNECT 192.0.2.N:PORT`, naming exactly the address eds-server gave it (or, when the endpoint
has a hostname, `CONNECT HOSTNAME:PORT`: `names` maps those to Pod IPs), and the proxy connects to
127.0.0.N:PORT, where a test backend listens (HTTPS; Envoy does not verify its certificate here).
Any other target is refused. So no socket is ever opened to anything but 127.0.0.0/8, and every request
still proves which endpoint Envoy picked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from typing import Any

POD_NET = ipaddress.ip_network("192.0.2.0/24")


def pod_ip(n: int) -> str:
    return str(POD_NET[n])


def loopback_for(address: str) -> str | None:
    """192.0.2.N -> 127.0.0.N; anything else -> None (refused)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip not in POD_NET:
        return None
    return f"127.0.0.{int(ip) - int(POD_NET.network_address)}"


_TYPES = "type.googleapis.com/envoy.extensions.transport_sockets"


def http11_proxy_socket(port: int) -> dict[str, Any]:
    """The Envoy cluster `transport_socket` that sends every upstream connection through this proxy."""
    return {
        "name": "envoy.transport_sockets.http_11_proxy",
        "typed_config": {
            "@type": f"{_TYPES}.http_11_proxy.v3.Http11ProxyUpstreamTransport",
            "default_proxy_address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "transport_socket": {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {"@type": f"{_TYPES}.tls.v3.UpstreamTlsContext"},
            },
        },
    }


class ConnectProxy:
    def __init__(self, names: dict[str, str] | None = None) -> None:
        self.names = names if names is not None else {}  # endpoint hostname -> Pod IP
        self.port = 0
        self.targets: list[str] = []  # every CONNECT target asked for, in order
        self.refused: list[str] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode().split()
            host, _, port = target.rpartition(":")
            self.targets.append(target)
            host = self.names.get(host, host)
            local = loopback_for(host.strip("[]")) if method == "CONNECT" and port.isdigit() else None
            if local is None:
                self.refused.append(target)
                writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(local, int(port)), 5)
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
            await writer.drain()
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
            with contextlib.suppress(OSError):
                writer.close()

    async def __aenter__(self) -> ConnectProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)


@contextlib.asynccontextmanager
async def connect_proxy() -> AsyncIterator[ConnectProxy]:
    async with ConnectProxy() as proxy:
        yield proxy
