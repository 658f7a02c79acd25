"""The gRPC probe against hostile backends on 127.0.0.1: a huge answer, a drip-fed one, a huge or
endless header block, none at all. Each check fails within its timeout with its reason, and what
the probe read stays under its bounds while the backend sent more than them.

The backends write HTTP/2 frames by hand (hyperframe, hpack): they break the rules h2 would keep.
The probe's own count of bytes read is the measure; each backend counts what the kernel took of
what it wrote before the probe could read it (the floor: the attack really sent past the bound).
Most run again over TLS (`tls: true`): the same bounds hold on the decrypted answer."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hpack import Encoder
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, SettingsFrame

from eds_server.health import probes
from eds_server.health.keepalive import KeptConnections
from eds_server.health.spec import HealthSpec
from tests.support.tls import CertAuthority, Issued
from tests.support.waiting import wait_for

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
SPEC = HealthSpec("grpc", interval=1.0, timeout=0.5)
TEN_MIB = 10 * 1024 * 1024


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[probes._HealthCall]:
    """Every probe connection made, to read its count of bytes read."""
    made: list[probes._HealthCall] = []

    class Counted(probes._HealthCall):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(probes, "_HealthCall", Counted)
    return made


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    where = tmp_path_factory.mktemp("tls")
    return CertAuthority("backend CA", where).issue(where / "backend", dns=["backend.internal"])


@pytest.fixture(params=["plain", "tls"])
def tls(request: pytest.FixtureRequest, cert: Issued) -> ssl.SSLContext | None:
    """The backend's TLS context (ALPN h2), or None: the tests so marked run both ways."""
    if request.param == "plain":
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert.cert, cert.key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


def spec_for(tls: ssl.SSLContext | None) -> HealthSpec:
    return dataclasses.replace(SPEC, tls=tls is not None)


@asynccontextmanager
async def backend(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def headers(block: list[tuple[str, str]], end_headers: bool = True, end: bool = False) -> bytes:
    frame = HeadersFrame(1, Encoder().encode(block))
    if end_headers:
        frame.flags.add("END_HEADERS")
    if end:
        frame.flags.add("END_STREAM")
    return frame.serialize()


def data(payload: bytes, end: bool = False) -> bytes:
    frame = DataFrame(1, payload)
    if end:
        frame.flags.add("END_STREAM")
    return frame.serialize()


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def write_now(writer: asyncio.StreamWriter, raw: bytes) -> int:
    """Write `raw`; the bytes the kernel took at once, before the probe (same loop) could read any."""
    writer.write(raw)
    return len(raw) - writer.transport.get_write_buffer_size()


async def finish(reader: asyncio.StreamReader, closed: asyncio.Event) -> None:
    """Read until the probe closes the connection (bounded: 5 s)."""
    try:
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass
    except (OSError, TimeoutError):
        pass
    closed.set()


async def test_a_huge_answer_is_refused_from_its_length(
    calls: list[probes._HealthCall], tls: ssl.SSLContext | None
) -> None:
    sent: list[int] = []
    closed = asyncio.Event()

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the request
        writer.transport.set_write_buffer_limits(high=64 * 1024 * 1024)
        first = b"\0" + TEN_MIB.to_bytes(4, "big") + b"x" * probes.MAX_ANSWER  # fits the window
        rest = b"".join(data(b"x" * 16384) for _ in range((TEN_MIB - probes.MAX_ANSWER) // 16384))
        sent.append(write_now(writer, SettingsFrame(0).serialize() + headers(OK_HEADERS) + data(first) + rest))
        await finish(reader, closed)

    async with backend(huge, tls) as port:
        r = await probes.check("127.0.0.1", port, spec_for(tls))
        await asyncio.wait_for(closed.wait(), 5)
    assert not r.ok and r.reason == f"gRPC: answer of {TEN_MIB} bytes (limit 1024)", r
    assert sent[0] > probes.MAX_GRPC_READ  # the backend did send past the bound (TLS: to its TLS layer)
    assert 0 < calls[0].read <= probes.MAX_GRPC_READ


async def test_data_past_the_window_is_refused(calls: list[probes._HealthCall]) -> None:
    sent: list[int] = []

    closed = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.transport.set_write_buffer_limits(high=64 * 1024 * 1024)
        message = b"\0" + TEN_MIB.to_bytes(4, "big") + b"x" * 16379  # a whole frame, past the window
        frames = data(message) + b"".join(data(b"x" * 16384) for _ in range(64))
        sent.append(write_now(writer, SettingsFrame(0).serialize() + headers(OK_HEADERS) + frames))
        await finish(reader, closed)

    async with backend(flood) as port:
        r = await probes.check("127.0.0.1", port, SPEC)
        await asyncio.wait_for(closed.wait(), 5)  # the probe closed its connection
    assert not r.ok and r.reason == "gRPC: sent past the flow-control window", r
    assert sent[0] > probes.MAX_GRPC_READ
    assert 0 < calls[0].read <= probes.MAX_GRPC_READ


async def test_a_drip_fed_answer_costs_one_timeout(calls: list[probes._HealthCall], tls: ssl.SSLContext | None) -> None:
    answer = (
        SettingsFrame(0).serialize()
        + headers(OK_HEADERS)
        + data(b"\0\0\0\0\x02\x08\x01")
        + headers([("grpc-status", "0")], end=True)
    )
    dripped = 0
    closed = asyncio.Event()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dripped
        await reader.read(1)
        watch = asyncio.create_task(finish(reader, closed))
        for byte in answer[:50]:  # bounded: 50 bytes, 5 s at most
            if closed.is_set():
                break
            writer.write(bytes([byte]))
            dripped += 1
            await asyncio.sleep(0.1)
        await watch

    # over TLS the timeout covers a handshake first: 1 s leaves room for a slow one on a busy host
    spec = spec_for(tls) if tls is None else dataclasses.replace(spec_for(tls), timeout=1.0)
    async with backend(drip, tls) as port:
        r = await probes.check("127.0.0.1", port, spec)
        await asyncio.wait_for(closed.wait(), 5)  # its connection was closed, not held
    assert not r.ok and r.reason == f"timed out after {spec.timeout:g}s", r
    assert 2 <= dripped < len(answer)  # it did drip, and never got to finish
    assert calls[0].read <= dripped


async def test_an_endless_header_block_stops_at_the_read_bound(
    calls: list[probes._HealthCall], tls: ssl.SSLContext | None
) -> None:
    sent: list[int] = []

    closed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.transport.set_write_buffer_limits(high=64 * 1024 * 1024)
        more = b"".join(ContinuationFrame(1, b"v" * 16384).serialize() for _ in range(64))  # no END_HEADERS
        sent.append(write_now(writer, SettingsFrame(0).serialize() + headers(OK_HEADERS, end_headers=False) + more))
        await finish(reader, closed)

    async with backend(endless, tls) as port:
        r = await probes.check("127.0.0.1", port, spec_for(tls))
        await asyncio.wait_for(closed.wait(), 5)  # the probe closed its connection
    assert not r.ok and r.reason == f"gRPC: {probes.MAX_GRPC_READ} bytes read and no answer (limit)", r
    assert sent[0] > probes.MAX_GRPC_READ
    assert calls[0].read == probes.MAX_GRPC_READ


@pytest.mark.parametrize(
    "block",
    [
        [*OK_HEADERS, *((f"x-pad-{i}", "v" * 1000) for i in range(12))],  # 12 KiB, written out
        [*OK_HEADERS, *[("x-bomb", "v" * 4000)] * 1000],  # 4 MB from ~4 KiB: one table entry, 999 references
    ],
    ids=["long", "hpack-bomb"],
)
async def test_a_huge_header_list_is_refused(calls: list[probes._HealthCall], block: list[tuple[str, str]]) -> None:
    decoded = sum(len(k) + len(v) for k, v in block)
    assert decoded > 2 * probes.MAX_HEADERS  # the floor: what the block would make

    closed = asyncio.Event()

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(SettingsFrame(0).serialize() + headers(block))
        await finish(reader, closed)

    async with backend(big) as port:
        r = await probes.check("127.0.0.1", port, SPEC)
        await asyncio.wait_for(closed.wait(), 5)  # the probe closed its connection
    assert not r.ok and r.reason == f"gRPC: header list over {probes.MAX_HEADERS} bytes", r
    assert calls[0].read <= probes.MAX_GRPC_READ


async def test_a_backend_that_never_answers_costs_one_timeout(
    calls: list[probes._HealthCall], tls: ssl.SSLContext | None
) -> None:
    closed = asyncio.Event()

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await finish(reader, closed)  # reads the request, answers nothing

    async with backend(hung, tls) as port:
        r = await probes.check("127.0.0.1", port, spec_for(tls))
        await asyncio.wait_for(closed.wait(), 5)
    assert not r.ok and r.reason == "timed out after 0.5s", r
    assert calls[0].read == 0


@pytest.mark.parametrize(("status", "ok", "reason"), [(1, True, "gRPC SERVING"), (3, False, "gRPC SERVICE_UNKNOWN")])
async def test_a_hand_written_answer_reads_as_grpc_does(
    calls: list[probes._HealthCall], tls: ssl.SSLContext | None, status: int, ok: bool, reason: str
) -> None:
    """The answer a Watch-style server gives for an unknown service (SERVICE_UNKNOWN in the message),
    and a plain pass, written frame by frame: the probe reads to the trailers and no further."""

    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        message = b"\x08" + bytes([status])
        writer.write(
            SettingsFrame(0).serialize()
            + headers(OK_HEADERS)
            + data(b"\0" + len(message).to_bytes(4, "big") + message)
            + headers([("grpc-status", "0")], end=True)
        )
        await finish(reader, closed)

    async with backend(answer, tls) as port:
        r = await probes.check("127.0.0.1", port, spec_for(tls))
        await asyncio.wait_for(closed.wait(), 5)  # the probe closed its connection
    assert (r.ok, r.reason) == (ok, reason), r
    assert 0 < calls[0].read < 200


async def test_a_check_over_tls_waits_for_a_handshake_slot_before_it_connects(
    calls: list[probes._HealthCall], cert: Issued
) -> None:
    """The checker's probe (keepalive.KeptConnections) bounds TLS handshakes in flight for gRPC too:
    a check that finds the one slot held past its interval is not sent, nor counted, nor connected."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert.cert, cert.key)
    ctx.set_alpn_protocols(["h2"])
    closed = asyncio.Event()

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await finish(reader, closed)

    pool = KeptConnections(max_handshakes=1, slot_wait=0.0)
    async with backend(hung, ctx) as port:
        holder = asyncio.create_task(pool.check("127.0.0.1", port, spec_for(ctx)))
        await wait_for(lambda: pool.handshaking, timeout=5)
        brief = dataclasses.replace(spec_for(ctx), interval=0.1, timeout=0.1)
        missed = await pool.check("127.0.0.1", port, brief)
        assert not missed.ok and missed.starved and missed.reason.startswith("not sent: no TLS handshake slot")
        held = await holder
        await asyncio.wait_for(closed.wait(), 5)
    assert (held.ok, held.reason, held.starved) == (False, "timed out after 0.5s", False)
    assert len(calls) == 1  # the check not sent never connected
    assert (pool.slot_waits, pool.handshakes_peak, pool.handshaking) == (1, 1, 0)
