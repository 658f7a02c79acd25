"""One check each: HTTP GET, TCP connect, gRPC health (grpc.health.v1), to an endpoint's own address.

Bounded by construction: the whole check runs under its timeout (a hung or drip-feeding backend costs
one timeout, then its connection is aborted, never a slot held); only the status line of an HTTP
answer is read, at most MAX_HEAD bytes of it, and a redirect is a status like any other (nothing is
followed, nothing else is contacted); a gRPC answer is read through a fixed buffer, MAX_GRPC_READ
bytes per check at most, its message refused past MAX_ANSWER and its headers past MAX_HEADERS, the
connection reset at once. Every probe returns a Result and never raises for the target's faults.
The checker sends HTTP checks, `tls: true` or not, through keepalive.py instead (a connection kept
between checks); TCP and gRPC checks come here, as every check did before keep-alive.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time

from grpclib.const import Status
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, ResponseReceived, StreamEnded, StreamReset, TrailersReceived
from h2.exceptions import DenialOfServiceError, FlowControlError, ProtocolError
from h2.settings import SettingCodes, Settings
from hpack.exceptions import OversizedHeaderListError

from .spec import HealthSpec
from .tracker import Result

MAX_HEAD = 8192  # bytes of the status line read at most
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
# gRPC: a HealthCheckResponse is 2 bytes (one enum field). 1 KiB leaves room for fields a later
# version may add; the stream's flow-control window is this (plus the 5-byte prefix), so a
# well-behaved backend cannot even send more, and a larger announced length is refused from its prefix.
MAX_ANSWER = 1024
# gRPC: the decoded headers (or trailers) of the answer, announced as SETTINGS_MAX_HEADER_LIST_SIZE
# and enforced by hpack while it decodes (an HPACK bomb stops here): a real block is ~100 bytes.
MAX_HEADERS = 4096
# gRPC: every byte read from the socket per check, frames and headers included. A whole answer is
# ~200 bytes (SETTINGS, HEADERS, one DATA, trailers); reads go into a fixed buffer, so nothing past
# this is ever read: the connection is reset there. 64 KiB is also HTTP/2's default connection window.
MAX_GRPC_READ = 65536


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


def request_head(address: str, port: int, path: str, keep: bool = False) -> bytes:
    """The GET of a check; `keep`: on a connection kept for the next check (keepalive.py)."""
    host = f"[{address}]" if ":" in address else address
    close = "" if keep else "Connection: close\r\n"
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: eds-server-health-check\r\n"
        f"Accept: */*\r\n{close}\r\n"
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
def tls_context(alpn: str = "http/1.1") -> ssl.SSLContext:
    """`tls: true`: encrypted, not verified. A check asks whether the backend answers; an endpoint is
    an IP whose certificate rarely names it, and what is checked is where Envoy is told to go. `alpn`:
    `h2` for gRPC, which servers over TLS require."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([alpn])
    return ctx


def _retrieved(future: asyncio.Future[bytes]) -> None:
    if not future.cancelled():
        future.exception()


async def _http(address: str, port: int, spec: HealthSpec, start: float, wall: float) -> Result:
    loop = asyncio.get_running_loop()
    line: asyncio.Future[bytes] = loop.create_future()
    # A timeout that ends create_connection after the connection was made leaves no one to await
    # `line`, which the connection's loss still fails: read it here, or asyncio logs "Future
    # exception was never retrieved" for a check already counted as timed out.
    line.add_done_callback(_retrieved)
    request = request_head(address, port, spec.path)
    tls = tls_context() if spec.tls else None
    transport, _ = await loop.create_connection(lambda: _StatusLine(request, line), address, port, ssl=tls)
    try:
        status = status_of(await line)
    finally:
        transport.abort()  # the rest of the answer is not read: reset, nothing lingers
    ok = spec.expects(status)
    return Result(ok, f"HTTP {status}", time.perf_counter() - start, wall)


def health_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + bytes([len(raw)]) + raw if raw else b""  # field 1 (service), names < 128 bytes


def serving_status(data: bytes) -> int:
    """HealthCheckResponse.status (field 1, varint); 0 (UNKNOWN) when absent."""
    if len(data) >= 2 and data[0] == 0x08:
        return data[1] & 0x7F
    return 0


_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_GRPC_CODES = frozenset(s.value for s in Status)
_H2_CONFIG = H2Configuration(client_side=True, header_encoding=None)
_H2_SETTINGS = {
    SettingCodes.ENABLE_PUSH: 0,
    SettingCodes.MAX_CONCURRENT_STREAMS: 0,  # the backend opens no stream of its own
    SettingCodes.INITIAL_WINDOW_SIZE: 5 + MAX_ANSWER,
    SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADERS,
}
_CHUNK = 4096  # bytes read from the socket at a time (a whole answer fits in one)


def _h2_why(e: ProtocolError) -> str:
    if isinstance(e, DenialOfServiceError) and isinstance(e.__cause__, OversizedHeaderListError):
        return f"gRPC: header list over {MAX_HEADERS} bytes"
    if isinstance(e, FlowControlError):
        return "gRPC: sent past the flow-control window"
    return f"gRPC: HTTP/2 {type(e).__name__}" + (f": {str(e)[:60]}" if str(e) else "")


class _HealthCall(asyncio.BufferedProtocol):
    """One grpc.health.v1 Check on a fresh HTTP/2 connection, every byte read counted (over TLS, every
    decrypted byte; the TLS layer below holds no more than the socket reads it made before the reset):
    h2 on our own transport rather than grpclib's Channel, which buffers a
    message of any announced length (up to 4 GiB) and headers of any size. The answer (ok, reason) is
    set once; then the connection is reset."""

    def __init__(
        self, authority: bytes, service: str, answer: asyncio.Future[tuple[bool, str]], scheme: bytes = b"http"
    ) -> None:
        self.authority = authority
        self.scheme = scheme  # https over TLS
        self.service = service
        self.answer = answer
        self.buffer = bytearray(_CHUNK)
        self.read = 0  # bytes read from the socket: MAX_GRPC_READ at most
        self.body = bytearray()
        self.headers: dict[bytes, bytes] = {}
        self.transport: asyncio.Transport | None = None
        self.h2 = H2Connection(_H2_CONFIG)
        self.h2.local_settings = Settings(client=True, initial_values=_H2_SETTINGS)
        self.h2.decoder.max_header_list_size = MAX_HEADERS

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        h2 = self.h2
        h2.initiate_connection()
        h2.send_headers(
            1,
            [
                (b":method", b"POST"),
                (b":scheme", self.scheme),
                (b":path", b"/grpc.health.v1.Health/Check"),
                (b":authority", self.authority),
                (b"te", b"trailers"),
                (b"content-type", b"application/grpc"),
                (b"user-agent", b"eds-server-health-check"),
            ],
        )
        message = health_request(self.service)
        h2.send_data(1, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
        transport.write(h2.data_to_send())  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)[: max(1, min(_CHUNK, MAX_GRPC_READ - self.read))]

    def buffer_updated(self, nbytes: int) -> None:
        self.read += nbytes
        if self.answer.done():
            return
        try:
            events = self.h2.receive_data(bytes(self.buffer[:nbytes]))
        except ProtocolError as e:
            return self._end(False, _h2_why(e))
        for event in events:
            if isinstance(event, ResponseReceived | TrailersReceived):
                self.headers.update(event.headers or ())
            elif isinstance(event, DataReceived):
                self._data(event.data)
            elif isinstance(event, StreamEnded):
                self._ended()
            elif isinstance(event, StreamReset):
                self._end(False, f"gRPC: stream reset (HTTP/2 error {int(event.error_code or 0)})")
            elif isinstance(event, ConnectionTerminated):
                self._end(False, f"gRPC: GOAWAY (HTTP/2 error {int(event.error_code or 0)})")
            if self.answer.done():
                return
        if self.read >= MAX_GRPC_READ:
            return self._end(False, f"gRPC: {MAX_GRPC_READ} bytes read and no answer (limit)")
        out = self.h2.data_to_send()  # SETTINGS and PING acknowledgements
        if out and self.transport is not None:
            self.transport.write(out)

    def _data(self, data: bytes | None) -> None:
        self.body += data or b""
        if len(self.body) < 5:
            return
        if self.body[0]:
            return self._end(False, "gRPC: compressed answer (none was asked for)")
        size = int.from_bytes(self.body[1:5], "big")
        if size > MAX_ANSWER:
            return self._end(False, f"gRPC: answer of {size} bytes (limit {MAX_ANSWER})")
        if len(self.body) > 5 + size:
            return self._end(False, "gRPC: more than one answer")

    def _ended(self) -> None:
        status = self.headers.get(b":status", b"")
        if status != b"200":
            return self._end(False, f"gRPC: HTTP {status.decode('ascii', 'replace')[:3]}")
        code = self.headers.get(b"grpc-status")
        if code is None:
            return self._end(False, "gRPC: no grpc-status")
        if code != b"0":
            n = int(code) if code.isdigit() and len(code) < 3 else -1
            name = Status(n).name if n in _GRPC_CODES else code[:8].decode("ascii", "replace")
            return self._end(False, f"gRPC status {name}")
        size = int.from_bytes(self.body[1:5], "big")
        if len(self.body) < 5 or len(self.body) != 5 + size:
            return self._end(False, "gRPC: no answer" if not self.body else "gRPC: answer cut short")
        value = serving_status(bytes(self.body[5:]))
        self._end(value == SERVING, f"gRPC {_STATUS_NAMES.get(value, value)}")

    def _end(self, ok: bool, reason: str) -> None:
        if not self.answer.done():
            self.answer.set_result((ok, reason))
        if self.transport is not None:
            self.transport.abort()  # nothing more is read, nothing lingers

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_result((False, "gRPC: connection closed before an answer"))


async def _grpc(address: str, port: int, spec: HealthSpec, start: float, wall: float) -> Result:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[tuple[bool, str]] = loop.create_future()
    authority = (f"[{address}]:{port}" if ":" in address else f"{address}:{port}").encode("ascii")
    scheme, tls = (b"https", tls_context("h2")) if spec.tls else (b"http", None)
    transport, _ = await loop.create_connection(
        lambda: _HealthCall(authority, spec.service, answer, scheme), address, port, ssl=tls
    )
    try:
        ok, reason = await answer
    finally:
        transport.abort()
    return Result(ok, reason, time.perf_counter() - start, wall)
