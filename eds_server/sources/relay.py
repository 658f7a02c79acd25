"""The relay source: groups taken from another eds-server over delta xDS (`--upstream-eds`).

One mechanism for every tier: a relay in front of thousands of Envoys, and each worker process
of `--workers N` fed by the process that owns the sources, are both this source. It asks its
upstream only for the names its own streams follow, and serves what the upstream sent byte for
byte, versions included: an Envoy that moves between relays, workers or the origin keeps its
versions, and nothing is sent to it again.

Fail static, as every source: a name the upstream has not answered yet is not answered at all
(the store withholds it); while the upstream is away the last state is served, marked stale, and
the reconnect says which versions the relay holds (`initial_resource_versions`), so only what
changed meanwhile comes back. An upstream that stops answering with the connection open (a frozen
process) is found by a heartbeat: a gRPC health check, two seconds to answer, once the upstream was
quiet for a second.

Only real answers count: a DeltaDiscoveryResponse of the ClusterLoadAssignment type, with a nonce,
whose every resource is an assignment for a name the relay asked for, under that name. Anything else
is NACKed and nothing of it is applied; an upstream that keeps sending such things is dropped and
retried after a backoff. The relay is loaded (ready) only after a real answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..decode import DecodeError, decode_group
from ..protowire import fields, length_delimited, string_field, text, varint
from ..ratelimit import LogBudget
from ..store import Relayed
from ..xds.common import EDS_TYPE_URL
from .base import Backoff, Heartbeat, Hung, Liveness, RelayFeed, SourceStatus, reconnect

if TYPE_CHECKING:
    from grpclib.client import Channel, Stream
    from grpclib.config import Configuration
    from grpclib.encoding.base import CodecBase

log = logging.getLogger("eds_server.sources.relay")

DELTA_PATH = "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
LINGER = 60.0  # seconds a name stays subscribed upstream after its last follower left
NACK_CODE_INVALID_ARGUMENT = 3
REFUSED_IN_A_ROW = 3  # responses refused one after another before the connection is dropped


class Junk(Exception):
    """The upstream keeps sending what is not an EDS answer: the connection is dropped."""


@dataclass(frozen=True)
class UpstreamOptions:
    """Where the upstream eds-server is, and how to reach it. TLS is on when a CA is given."""

    host: str
    port: int
    path: str | None = None  # a Unix socket instead of host and port (a worker's link to its owner)
    ca: str | None = None  # CA certificates to verify the upstream's certificate
    cert: str | None = None  # client certificate (mTLS), PEM
    key: str | None = None  # its key (default: in `cert`)

    @property
    def target(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context, or None for plaintext; raises OSError or ssl.SSLError for unusable files."""
        if self.ca is None and self.cert is None:
            return None
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["h2"])
        if self.cert is not None:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


class Subscriptions:
    """Which names to ask the upstream for, without IO: those the relay's streams follow, and those
    dropped less than `linger` ago (a reconnecting Envoy finds them still held).

    `request()` says what the upstream has not been told yet on the current connection;
    `reconnected()` forgets what was told, so the next request subscribes everything again.
    """

    def __init__(self, linger: float = LINGER) -> None:
        self.linger = linger
        self.wanted: dict[str, None] = {}  # subscribed upstream, or to be (ordered set)
        self.dropped: dict[str, float] = {}  # name -> when its last follower left
        self._told: set[str] = set()  # subscribed on the current connection
        self._untold_removals: set[str] = set()  # unsubscribed here, not yet upstream
        self.asked: set[str] = set()  # ever subscribed on the current connection (answers may cross removals)

    def follow(self, added: Iterable[str], removed: Iterable[str], now: float) -> None:
        for name in added:
            self.dropped.pop(name, None)
            self.wanted[name] = None
        for name in removed:
            if name in self.wanted:
                self.dropped[name] = now

    def expire(self, now: float) -> list[str]:
        """Names whose linger ran out: no longer wanted (the caller drops what it held of them)."""
        gone = [name for name, since in self.dropped.items() if now - since >= self.linger]
        for name in gone:
            del self.dropped[name]
            del self.wanted[name]
            if name in self._told:
                self._told.discard(name)
                self._untold_removals.add(name)
        return gone

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the next name's linger runs out (None: nothing lingers)."""
        if not self.dropped:
            return None
        return max(0.0, min(self.dropped.values()) + self.linger - now)

    def request(self) -> tuple[list[str], list[str]]:
        """(subscribe, unsubscribe) the upstream has not been told yet; counts them as told."""
        subscribe = [n for n in self.wanted if n not in self._told]
        unsubscribe = sorted(self._untold_removals)
        self._told.update(subscribe)
        self.asked.update(subscribe)
        self._untold_removals.clear()
        return subscribe, unsubscribe

    def reconnected(self) -> None:
        self._told.clear()
        self._untold_removals.clear()
        self.asked.clear()


def encode_request(
    node_id: str,
    *,
    subscribe: Iterable[str] = (),
    unsubscribe: Iterable[str] = (),
    initial_versions: Mapping[str, str] | None = None,
    nonce: str = "",
    error: str | None = None,
    node: bool = False,
) -> bytes:
    """A DeltaDiscoveryRequest for EDS (field numbers of envoy.service.discovery.v3)."""
    out = (
        [
            length_delimited(
                1, string_field(1, node_id) + string_field(2, "eds-server-relay") + string_field(6, "eds-server")
            )
        ]
        if node
        else []
    )
    out.append(string_field(2, EDS_TYPE_URL))
    out.extend(length_delimited(3, n.encode()) for n in subscribe)
    out.extend(length_delimited(4, n.encode()) for n in unsubscribe)
    for name, version in (initial_versions or {}).items():
        out.append(length_delimited(5, string_field(1, name) + string_field(2, version)))
    out.append(string_field(6, nonce))
    if error is not None:  # google.rpc.Status{code, message}
        out.append(length_delimited(7, varint(1 << 3) + varint(NACK_CODE_INVALID_ARGUMENT) + string_field(2, error)))
    return b"".join(out)


@dataclass(frozen=True, slots=True)
class Received:
    """One DeltaDiscoveryResponse: (name, version, CLA bytes) for each resource, removals, nonce."""

    resources: tuple[tuple[str, str, bytes], ...]
    removed: tuple[str, ...]
    nonce: str


def decode_response(data: bytes) -> Received:
    """ValueError (DecodeError) for a response that is not a well-formed EDS delta response: a type
    other than ClusterLoadAssignment or none, no nonce, a resource without a name, a version or an
    assignment, or an assignment whose cluster_name is not the resource's name (Envoy would reject it)."""
    resources: list[tuple[str, str, bytes]] = []
    removed: list[str] = []
    nonce, type_url = "", None
    for number, value in fields(data):
        if number == 2:
            resources.append(_resource(_bytes(value)))
        elif number == 4:
            type_url = text(value)
        elif number == 6:
            removed.append(text(value))
        elif number == 5:
            nonce = text(value)
    if type_url != EDS_TYPE_URL:
        raise DecodeError(f"response of type {type_url!r}, not EDS" if type_url else "response without a type_url")
    if not nonce:
        raise DecodeError("response without a nonce")
    return Received(tuple(resources), tuple(removed), nonce)


def _resource(data: memoryview) -> tuple[str, str, bytes]:
    """One Resource{name (3), version (1), resource (2): Any{type_url, value}} -> (name, version, CLA)."""
    name, version, body, type_url = "", "", None, None
    for number, value in fields(data):
        if number == 3:
            name = text(value)
        elif number == 1:
            version = text(value)
        elif number == 2:
            for n2, v2 in fields(_bytes(value)):
                if n2 == 1:
                    type_url = text(v2)
                elif n2 == 2:
                    body = bytes(_bytes(v2))
    if not name:
        raise DecodeError("a resource without a name")
    if type_url != EDS_TYPE_URL:
        raise DecodeError(f"resource {name}: type {type_url!r}, not EDS" if type_url else f"resource {name}: no type")
    if not version or body is None:
        raise DecodeError(f"resource {name}: no {'version' if not version else 'assignment'}")
    cluster_name = ""
    for number, value in fields(body):  # the whole top level: a truncated assignment is refused here
        if number == 1:
            cluster_name = text(value)
    if cluster_name != name:
        raise DecodeError(f"resource {name}: its assignment is for cluster {cluster_name!r}")
    return name, version, body


def _bytes(value: int | memoryview) -> memoryview:
    if isinstance(value, int):
        raise DecodeError("expected a message, found a varint")
    return value


class RelaySource:
    """Follows an upstream eds-server's DeltaEndpoints; the only source of its store."""

    def __init__(
        self,
        feed: RelayFeed,
        options: UpstreamOptions,
        *,
        codec: CodecBase,
        config: Configuration,
        linger: float = LINGER,
        node_id: str | None = None,
    ) -> None:
        """`codec` and `config`: the gRPC client's, from the transport that owns them (one that sends
        `bytes` as they are, and keepalive through grpclib's private keywords)."""
        self.feed = feed
        self.options = options
        self.codec, self.config = codec, config
        self.name = f"upstream-eds:{options.target}"
        self.node_id = node_id or f"eds-server-relay/{socket.gethostname()}/{os.getpid()}"
        self.subs = Subscriptions(linger)
        self.liveness = Liveness(feed, self.name, f"upstream eds-server {options.target}")
        self.responses = 0  # answers taken from the upstream, for tests and status
        self.nacks = 0
        self.heartbeat: Heartbeat | None = None  # the current connection's
        self._subscribed = False  # the current connection's first request was sent
        self._refusals = LogBudget(log)  # a junk upstream sends thousands a second: a few lines a minute
        self._wake = asyncio.Event()
        self.subs.follow(feed.withhold(self._interest), (), time.monotonic())

    def _interest(self, added: tuple[str, ...], removed: tuple[str, ...]) -> None:
        self.subs.follow(added, removed, time.monotonic())
        if added:
            self._wake.set()

    async def start(self) -> None:
        """Unusable TLS files refuse the start, named by their flags, not the first connection."""
        o = self.options
        given = [
            (flag, path)
            for flag, path in (
                ("--upstream-eds-ca", o.ca),
                ("--upstream-eds-cert", o.cert),
                ("--upstream-eds-key", o.key),
            )
            if path
        ]
        for flag, path in given:
            if not os.path.isfile(path):
                raise OSError(f"{flag} {path}: no such file")
        try:
            o.ssl_context()
        except OSError as e:  # ssl.SSLError included: not PEM, a key that does not match
            raise OSError(f"{', '.join(f'{flag} {path}' for flag, path in given)}: cannot be used: {e}") from None

    def status(self) -> SourceStatus:
        return self.liveness.status(upstream=self.options.target, names=len(self.subs.wanted), responses=self.responses)

    async def run(self, stop: asyncio.Event) -> None:
        from grpclib.client import Channel

        backoff = Backoff(initial=0.2, cap=5.0)
        o = self.options
        where: dict[str, Any] = {"path": o.path} if o.path is not None else {"host": o.host, "port": o.port}

        async def connect() -> str:
            channel = Channel(**where, ssl=o.ssl_context(), codec=self.codec, config=self.config)
            self._subscribed = False
            self.heartbeat = Heartbeat(
                _health_check(channel), f"the upstream eds-server {o.target}", replied=self._vouched
            )
            try:
                async with self.heartbeat.watching():
                    await self._follow(channel, stop, backoff)
                return "the upstream ended the stream"
            finally:
                channel.close()

        await reconnect(
            stop,
            connect,
            backoff=backoff,
            why=lambda e: str(e) if isinstance(e, Hung | Junk) else _why(e),
            lost=lambda reason, _: self.liveness.lost(reason),
        )

    async def _follow(self, channel: Channel, stop: asyncio.Event, backoff: Backoff) -> None:
        from grpclib.const import Cardinality

        self.subs.reconnected()
        refused = 0  # responses refused one after another on this connection
        outbox: list[bytes] = []  # ACKs and NACKs, sent by the one writer (messages must not interleave)
        async with channel.request(DELTA_PATH, Cardinality.STREAM_STREAM, bytes, bytes) as stream:
            subscribe, _ = self.subs.request()
            await stream.send_message(
                encode_request(self.node_id, subscribe=subscribe, initial_versions=self._held(subscribe), node=True)
            )
            self._subscribed = True
            writer = asyncio.create_task(self._write(stream, stop, outbox))
            try:
                while True:
                    reading = asyncio.ensure_future(stream.recv_message())
                    done, _ = await asyncio.wait({reading, writer}, return_when=asyncio.FIRST_COMPLETED)
                    if reading not in done:
                        reading.cancel()
                        writer.result()  # raises what stopped it
                        return  # stopped
                    data = reading.result()
                    if data is None:
                        return
                    if self.heartbeat is not None:
                        self.heartbeat.beat()
                    nonce, nack = self._take(data)
                    if nack is None:
                        refused = 0
                        backoff.reset()
                        self.liveness.live()
                    else:
                        refused += 1
                        if refused >= REFUSED_IN_A_ROW:
                            raise Junk(f"{refused} responses in a row were not EDS answers, the last: {nack}")
                    outbox.append(encode_request(self.node_id, nonce=nonce, error=nack))
                    self._wake.set()
            finally:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await stream.cancel()  # ends our half: grpclib refuses to leave a stream open

    async def _write(self, stream: Stream[bytes, bytes], stop: asyncio.Event, outbox: list[bytes]) -> None:
        """Everything sent after the first request: answers, subscription changes as they come,
        lingering names dropped when their time is up. Returns on stop."""
        while not stop.is_set():
            self._wake.clear()
            while outbox:
                await stream.send_message(outbox.pop(0))
            gone = self.subs.expire(time.monotonic())
            if gone:
                self.feed.publish_resources(self.name, {}, removed=gone)
            subscribe, unsubscribe = self.subs.request()
            if subscribe or unsubscribe:
                await stream.send_message(
                    encode_request(
                        self.node_id,
                        subscribe=subscribe,
                        unsubscribe=unsubscribe,
                        initial_versions=self._held(subscribe),
                    )
                )
            if outbox:
                continue
            waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(
                    waits, timeout=self.subs.next_expiry(time.monotonic()), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for w in waits:
                    w.cancel()

    def _vouched(self) -> None:
        """The upstream replied to a health check sent after our subscriptions on the same connection:
        it read them, and owes no answer for the versions held (they are current). Without this a
        reconnect to an upstream with nothing new stays stale until the next change."""
        if self._subscribed and self.liveness.loaded and not self.liveness.live_now:
            self.liveness.live()

    def _held(self, names: Iterable[str]) -> dict[str, str]:
        """The versions held of `names`: told to the upstream, which sends only those that differ."""
        held = self.feed.held()
        return {n: held[n].version for n in names if n in held}

    def _take(self, data: bytes) -> tuple[str, str | None]:
        """Put one response into the store: (its nonce, the NACK message if it cannot be served,
        in which case nothing of it is applied)."""
        try:
            received = decode_response(data)
            unasked = [name for name, _, _ in received.resources if name not in self.subs.asked]
            if unasked:
                raise DecodeError(f"resources the relay did not ask for: {', '.join(sorted(unasked)[:5])}")
        except ValueError as e:
            return "", self._rejected(e)
        now = time.monotonic()
        resources = {
            name: Relayed.make(name, version, body, now, decode_group) for name, version, body in received.resources
        }
        self.responses += 1
        wanted = self.subs.wanted
        self.feed.publish_resources(
            self.name,
            {n: r for n, r in resources.items() if n in wanted},
            removed=[n for n in received.removed if n in wanted],
        )
        return received.nonce, None

    def _rejected(self, e: Exception) -> str:
        self.nacks += 1
        reason = f"refused a response of the upstream: {e}"
        self.liveness.refused(reason)
        self._refusals.log(logging.WARNING, "%s: %s (nothing of it is applied)", self.name, reason)
        return str(e)


def _health_check(channel: Channel) -> Callable[[], Awaitable[object]]:
    """grpc.health.v1 Check on the relay's own connection: any answer, NOT_SERVING or an error
    status included, says the upstream is there."""
    from grpclib.client import UnaryUnaryMethod

    check: UnaryUnaryMethod[bytes, bytes] = UnaryUnaryMethod(channel, HEALTH_CHECK_PATH, bytes, bytes)

    async def probe() -> object:
        return await check(b"")

    return probe


def _why(e: BaseException) -> str:
    """A connection failure in words (no exception reprs in logs)."""
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    if isinstance(e, GRPCError):
        return f"the upstream answered {e.status.name}: {e.message or ''}".rstrip(": ")
    if isinstance(e, StreamTerminatedError):  # its words: "Connection lost", "Received RST_STREAM ..."
        return f"the upstream ended the stream ({e})" if str(e) else "the upstream reset the stream"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if isinstance(e, OSError):
        return e.strerror or str(e) or type(e).__name__
    return str(e) or type(e).__name__
