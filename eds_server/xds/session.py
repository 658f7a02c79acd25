"""One xDS stream's protocol without IO: the session driver. Requests come in as bytes, store
changes as names; what the state machine says becomes store subscriptions, access checks and
observer events; responses are polled out. The transport (transport/grpc.py) adds the IO: reading
requests, pushing responses, waking on changes. Unit-testable without a socket.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import protowire
from ..observe import Observers, clip, names_shown
from . import wire
from .common import Ack, Event, Nack, Nonces, ProtocolError, Resources, Subscribed, SubscriptionLimits
from .delta import DeltaStream
from .sotw import SotwStream

STREAM_NAMES_SHOWN = 100  # per stream in /v1/streams; Envoy follows one name per stream
# A plain ACK (version, one name, type URL, nonce) is well under this; a longer request, such as one
# carrying Envoy's Node (tens of kilobytes), is not tried against it and goes straight to the decode.
PLAIN_ACK_MOST = 2048


class Machine(Protocol):
    """What SotwStream and DeltaStream have in common, as a session drives them."""

    subscribed: dict[str, None]
    sent: dict[str, str]
    nacked: dict[str, str]

    def receive(self, req: Any) -> list[Event]: ...
    def changed_due(self, names: frozenset[str] | None) -> bool: ...
    def acked_version(self, name: str) -> str | None: ...
    def changed(self, names: Iterable[str] | None) -> None: ...
    @property
    def wants_poll(self) -> bool: ...
    def poll(self) -> Any: ...


@dataclass(frozen=True)
class StreamKind:
    """What differs between a StreamEndpoints and a DeltaEndpoints call."""

    name: str
    decode: Callable[[bytes | memoryview, int], tuple[Any, memoryview | None]]  # (bytes, max names) -> (request, node)
    machine: Callable[[Resources, SubscriptionLimits, Nonces], Machine]
    encode: Callable[[Any, wire.Responses], bytes]  # the state machine's response -> wire bytes
    version: Callable[[Any], str]  # the response's version
    # (machine, request bytes) -> the names a plain ACK settled, or None (nothing done: `receive` reads it)
    ack: Callable[[Any, bytes | memoryview], tuple[str, ...] | None] | None = None


def sotw_ack(sm: SotwStream, data: bytes | memoryview) -> tuple[str, ...] | None:
    """A request that is, byte for byte, the plain ACK of the one-resource response in flight
    (`wire.plain_ack`), settled without a decode: a bytes comparison instead of a parse, a Request
    and the general `receive`. None for anything else, which is read the usual way."""
    flight = sm.in_flight
    if flight is None or len(flight.resources) != 1:
        return None
    if data != wire.plain_ack(flight.version_info, flight.resources[0].name, flight.nonce):
        return None
    return sm.ack_one()


SOTW = StreamKind(
    "sotw",
    wire.sotw_request,
    SotwStream,
    lambda r, enc: enc.discovery_response(r.version_info, r.resources, r.nonce),
    lambda r: r.version_info,
    sotw_ack,
)
DELTA = StreamKind(
    "delta",
    wire.delta_request,
    DeltaStream,
    lambda r, enc: enc.delta_discovery_response(r.system_version_info, r.resources, r.nonce),
    lambda r: r.system_version_info,
)


def decode_request(
    decode: Callable[[bytes | memoryview, int], tuple[Any, memoryview | None]],
    data: bytes | memoryview,
    limits: SubscriptionLimits,
) -> tuple[Any, memoryview | None]:
    """A request and its raw Node; ProtocolError (INVALID_ARGUMENT, or past a limit) if it cannot be."""
    try:
        return decode(data, limits.max_names)
    except ValueError as e:  # malformed protobuf, or a string that is not UTF-8
        raise ProtocolError("INVALID_ARGUMENT", f"cannot parse request: {e}") from None


def node_fields(raw: memoryview | None) -> tuple[str, str]:
    """The node's id and cluster as sent ("" if absent), read without parsing the whole Node."""
    try:
        found = protowire.string_fields(raw, {1, 2}, in_order=True) if raw else {}
    except ValueError:
        raise ProtocolError("INVALID_ARGUMENT", "cannot parse node") from None
    return found.get(1, ""), found.get(2, "")


def shown(node_id: str, cluster: str) -> tuple[str, str]:
    """The same, bounded and escaped for logs."""
    return clip(node_id or "?", 200), clip(cluster or "?", 200)


# (peer certificate as ssl's getpeercert() gives it, or None; node id; node cluster) -> whether that client
# may read a name. `str()` of the returned check is logged on a denial. security.Policy.for_client is one.
Authorize = Callable[[dict[str, Any] | None, str, str], Callable[[str], bool]]


class SessionDriver:
    """One stream's protocol: `receive` a request, be told of store changes (`on_change`), `poll`
    the response due. It is the StreamView observers see."""

    def __init__(
        self,
        kind: StreamKind,
        store: Resources,
        limits: SubscriptionLimits,
        nonces: Nonces,
        observers: Observers,
        peer: str,
        cert: Callable[[], dict[str, Any] | None],
        authorize: Authorize | None = None,
    ) -> None:
        self.kind = kind
        self.store = store
        self.limits = limits
        self.observers = observers
        self.sm = kind.machine(store, limits, nonces)
        self.peer = peer
        self._cert = cert
        self._authorize = authorize
        self.node = "?"
        self.cluster = "?"
        self.opened_at = time.monotonic()
        self.id = 0  # set once the service takes the stream: ids grow with opening order
        self.requested = False  # its first request was read
        self.last_nack: str | None = None
        self.acks_read_whole = 0  # plain ACKs recognised by their bytes (`sotw_ack`), never decoded
        self.access: Callable[[str], bool] | None = None  # set from the first request, with authorize

    @property
    def transport(self) -> str:
        return self.kind.name

    @property
    def subscribed(self) -> Iterable[str]:
        return self.sm.subscribed

    def fields(self, event: str) -> dict[str, str]:
        """Structured fields for JSON logs."""
        return {
            "event": event,
            "transport": self.kind.name,
            "node": self.node,
            "node_cluster": self.cluster,
            "peer": self.peer,
        }

    def describe(self) -> dict[str, Any]:
        """What /v1/streams shows of this client: at most STREAM_NAMES_SHOWN of its names."""
        names = {
            name: {
                "sent": self.sm.sent.get(name),
                "acked": self.sm.acked_version(name),
                "nacked": self.sm.nacked.get(name),
            }
            for name in itertools.islice(self.sm.subscribed, STREAM_NAMES_SHOWN)
        }
        return {
            "id": self.id,
            "node": self.node,
            "cluster": self.cluster,
            "peer": self.peer,
            "transport": self.kind.name,
            "names": names,
            "names_total": len(self.sm.subscribed),
            "last_nack": self.last_nack,
            "acks_read_whole": self.acks_read_whole,
        }

    def on_change(self, names: frozenset[str] | None) -> None:
        """The store changed `names` (None: anything): the transport also sends what is due."""
        self.sm.changed(names)

    def receive(self, data: bytes | memoryview, first: bool) -> None:
        """One request; raises ProtocolError when the stream must end."""
        observers = self.observers
        observers.request(self)
        if (
            not first
            and len(data) <= PLAIN_ACK_MOST
            and (ack := self.kind.ack) is not None
            and (acked := ack(self.sm, data)) is not None
        ):
            self.acks_read_whole += 1
            observers.ack(self, acked)  # Envoy's usual request, recognised whole: as below, in one step
            return
        request, node = decode_request(self.kind.decode, data, self.limits)
        if first:
            node_id, cluster = node_fields(node)
            self.node, self.cluster = shown(node_id, cluster)
            if self._authorize is not None:
                self.access = self._authorize(self._cert(), node_id, cluster)
        for event in self.sm.receive(request):
            if isinstance(event, Nack):
                self.last_nack = clip(event.message)
                known = self.store.resources()
                groups = [name if name in known else "(unknown name)" for name in event.names]
                observers.nack(self, event.names, groups, event.version_info, self.last_nack)
            elif isinstance(event, Ack):
                observers.ack(self, event.names)
            elif isinstance(event, Subscribed):
                self._check_access(event.added)
                self.store.follow(self.on_change, event.added, event.removed)
                if not first:
                    observers.subscribed(self, event.added, event.removed)
        if first:
            self.requested = True
            observers.opened(self)

    def _check_access(self, names: Iterable[str]) -> None:
        """End the stream (PERMISSION_DENIED) before anything is sent if a name may not be read."""
        if self.access is None:
            return
        refused = [n for n in names if not self.access(n)]
        if refused:
            self.observers.access_denied(self, refused, str(self.access))
            raise ProtocolError("PERMISSION_DENIED", f"not allowed to read {names_shown(refused)}")
