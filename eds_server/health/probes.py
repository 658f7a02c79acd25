"""One check each: HTTP GET, TCP connect, gRPC health (grpc.health.v1), to an endpoint's own address.

Bounded by construction: the whole check runs under its timeout (a hung or drip-feeding backend costs
one timeout, then its connection is aborted, never a slot held); only the status line of an HTTP
answer is read, at most MAX_HEAD bytes of it, and a redirect is a status like any other (nothing is
followed, nothing else is contacted). Every probe returns a Result and never raises for the target's
faults.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.encoding.base import CodecBase

from .spec import HealthSpec
from .tracker import Result

MAX_HEAD = 8192  # bytes of the status line read at most
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING


def _fail(start: float, wall: float, why: str) -> Result:
    return Result(False, why, time.perf_counter() - start, wall)


def _why(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, asyncio.IncompleteReadError):
        return "connection closed before a status line"
    if isinstance(e, asyncio.LimitOverrunError):
        return f"status line longer than {MAX_HEAD} bytes"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def check(address: str, port: int, spec: HealthSpec) -> Result:
    """Run the check `spec` describes against address:port (spec.port, if set, replaces the port)."""
    port = spec.port or port
    start, wall = time.perf_counter(), time.time()
    try:
        async with asyncio.timeout(spec.timeout):
            if spec.kind == "http":
                return await _http(address, port, spec, start, wall)
            if spec.kind == "grpc":
                return await _grpc(address, port, spec, start, wall)
            transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, address, port)
            transport.abort()
            return Result(True, "connected", time.perf_counter() - start, wall)
    except TimeoutError:
        return _fail(start, wall, f"timed out after {spec.timeout:g}s")
    except (OSError, EOFError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        return _fail(start, wall, _why(e))


def request_head(address: str, port: int, path: str) -> bytes:
    host = f"[{address}]" if ":" in address else address
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: eds-server-health-check\r\n"
        "Accept: */*\r\nConnection: close\r\n\r\n"
    ).encode("ascii")


def status_of(line: bytes) -> int:
    """The status of an HTTP/1.x status line; ValueError for anything else."""
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise ValueError(f"not an HTTP status line: {line[:40]!r}")
    return int(parts[1])


class _StatusLine(asyncio.Protocol):
    """Sends the request, reads up to the first line break (MAX_HEAD bytes at most), then resets the
    connection: a protocol, not streams, as a check is mostly connect and close (half the CPU)."""

    def __init__(self, request: bytes, line: asyncio.Future[bytes]) -> None:
        self.request = request
        self.line = line
        self.head = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        self.head += data
        end = self.head.find(b"\n")
        if end >= 0 or len(self.head) > MAX_HEAD:
            if not self.line.done():
                if end >= 0 and end <= MAX_HEAD:
                    self.line.set_result(self.head[: end + 1])
                else:
                    self.line.set_exception(asyncio.LimitOverrunError("no line break", len(self.head)))
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.line.done():
            self.line.set_exception(asyncio.IncompleteReadError(self.head, None))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """`tls: true`: encrypted, not verified. A check asks whether the backend answers; an endpoint is
    an IP whose certificate rarely names it, and what is checked is where Envoy is told to go."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def _http(address: str, port: int, spec: HealthSpec, start: float, wall: float) -> Result:
    loop = asyncio.get_running_loop()
    line: asyncio.Future[bytes] = loop.create_future()
    request = request_head(address, port, spec.path)
    tls = tls_context() if spec.tls else None
    transport, _ = await loop.create_connection(lambda: _StatusLine(request, line), address, port, ssl=tls)
    try:
        status = status_of(await line)
    finally:
        transport.abort()  # the rest of the answer is not read: reset, nothing lingers
    ok = spec.expects(status)
    return Result(ok, f"HTTP {status}", time.perf_counter() - start, wall)


class _Bytes(CodecBase):
    """Messages as bytes: the two health messages are written and read by hand (no protobuf runtime)."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


def health_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + bytes([len(raw)]) + raw if raw else b""  # field 1 (service), names < 128 bytes


def serving_status(data: bytes) -> int:
    """HealthCheckResponse.status (field 1, varint); 0 (UNKNOWN) when absent."""
    if len(data) >= 2 and data[0] == 0x08:
        return data[1] & 0x7F
    return 0


async def _grpc(address: str, port: int, spec: HealthSpec, start: float, wall: float) -> Result:
    channel = Channel(address, port, codec=_Bytes())
    try:
        method = "/grpc.health.v1.Health/Check"
        async with channel.request(method, Cardinality.UNARY_UNARY, bytes, bytes) as stream:
            await stream.send_message(health_request(spec.service), end=True)
            reply = await stream.recv_message()
    except OSError:
        raise
    except Exception as e:  # grpclib's GRPCError, StreamTerminatedError, h2 protocol errors
        return _fail(start, wall, f"gRPC: {_why(e)}")
    finally:
        channel.close()
    status = serving_status(reply or b"")
    names = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
    return Result(status == SERVING, f"gRPC {names.get(status, status)}", time.perf_counter() - start, wall)
