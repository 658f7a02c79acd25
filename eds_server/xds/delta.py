"""Incremental (delta) EDS stream logic, without sockets: requests and store changes in, responses out.

Differences from SotW that shape this: subscriptions change by deltas and must be honoured even on
a request with a stale nonce; a reconnecting Envoy says which versions it already has
(`initial_resource_versions`) and only the others are sent; versions are per resource. An unknown or
removed group is sent as a CLA with no endpoints, never as a removal: a delta removal leaves
Envoy's old hosts in place, and it must look to Envoy exactly as in SotW.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..store import Resource
from .common import (
    Ack,
    Event,
    Limits,
    Nack,
    ProtocolError,
    ResourceView,
    StaleNonce,
    Subscribed,
    check_request,
    response_version,
)

WILDCARD = "*"  # EDS is never wildcard: Envoy always names its clusters


@dataclass(frozen=True, slots=True)
class DeltaRequest:
    has_node: bool = False
    type_url: str = ""
    subscribe: tuple[str, ...] = ()
    unsubscribe: tuple[str, ...] = ()
    initial_versions: Mapping[str, str] = field(default_factory=dict)
    response_nonce: str = ""
    error_message: str | None = None


@dataclass(frozen=True, slots=True)
class DeltaResponse:
    system_version_info: str  # for debugging only; Envoy tracks versions per resource
    resources: tuple[Resource, ...]
    nonce: str


@dataclass
class DeltaStream:
    view: ResourceView
    limits: Limits = field(default_factory=Limits)

    subscribed: dict[str, None] = field(default_factory=dict)  # ordered set
    sent: dict[str, str] = field(default_factory=dict)  # name -> version Envoy has or is being sent
    nacked: dict[str, str] = field(default_factory=dict)  # name -> version Envoy rejected
    in_flight: DeltaResponse | None = None
    _dirty: set[str] = field(default_factory=set)
    _started: bool = False
    _nonces: int = 0

    def receive(self, req: DeltaRequest) -> list[Event]:
        """Take one request from Envoy; raise ProtocolError to end the stream."""
        check_request(req.type_url, [*req.subscribe, *req.unsubscribe, *req.initial_versions], self.limits)
        events: list[Event] = []
        first = not self._started
        if first:
            if not req.has_node:
                raise ProtocolError("INVALID_ARGUMENT", "the first request of a stream must carry a node")
            self._started = True
        if req.response_nonce:
            if self.in_flight is not None and req.response_nonce == self.in_flight.nonce:
                events.append(self._answered(self.in_flight, req.error_message))
                self.in_flight = None
            else:
                events.append(StaleNonce(req.response_nonce))  # subscriptions still count
        added = tuple(n for n in dict.fromkeys(req.subscribe) if n != WILDCARD and n not in self.subscribed)
        removed = tuple(n for n in dict.fromkeys(req.unsubscribe) if n in self.subscribed)
        for name in removed:
            del self.subscribed[name]
            self.sent.pop(name, None)
            self.nacked.pop(name, None)
            self._dirty.discard(name)
        for name in dict.fromkeys(req.subscribe):
            if name == WILDCARD:
                continue
            self.subscribed[name] = None
            self._dirty.add(name)
            if first and name in req.initial_versions:
                self.sent[name] = req.initial_versions[name]  # what it has: resend only if stale
            else:
                self.sent.pop(name, None)  # subscribed on a live stream: always sent
        if added or removed:
            events.append(Subscribed(added, removed))
        return events

    def _answered(self, response: DeltaResponse, error: str | None) -> Event:
        names = tuple(r.name for r in response.resources)
        for r in response.resources:
            if r.name not in self.subscribed:
                continue
            if error is None:
                self.nacked.pop(r.name, None)
            else:
                self.nacked[r.name] = r.version
        if error is None:
            return Ack(response.system_version_info, names)
        return Nack(response.system_version_info, names, error)

    def changed(self, names: Iterable[str] | None) -> None:
        """The store changed these names (None: anything may have changed)."""
        if names is None:
            self._dirty.update(self.subscribed)
        else:
            self._dirty.update(n for n in names if n in self.subscribed)

    @property
    def wants_poll(self) -> bool:
        return bool(self._dirty) and self.in_flight is None and self._started

    def poll(self) -> DeltaResponse | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        if not self.wants_poll or not self.view.ready:
            return None
        names = [n for n in self.subscribed if n in self._dirty]
        self._dirty.clear()
        due = tuple(
            r
            for r in (self.view.get(n) for n in names)
            if self.sent.get(r.name) != r.version and self.nacked.get(r.name) != r.version
        )
        if not due:
            return None
        self._nonces += 1
        response = DeltaResponse(response_version(due), due, str(self._nonces))
        for r in due:
            self.sent[r.name] = r.version
        self.in_flight = response
        return response
