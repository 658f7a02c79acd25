"""Incremental (delta) EDS stream logic, without sockets: requests and store changes in, responses out.

Differences from SotW that shape this: subscriptions change by deltas and must be honoured even on
a request with a stale nonce; a reconnecting Envoy says which versions it already has
(`initial_resource_versions`) and only the others are sent; versions are per resource. An unknown or
removed group is sent as a CLA with no endpoints, never as a removal: a delta removal leaves
Envoy's old hosts in place, and it must look to Envoy exactly as in SotW.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..store import Resource
from .common import Ack, Event, Nack, StaleNonce, StreamState, Subscribed, check_request, response_version

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
class DeltaStream(StreamState[DeltaResponse]):
    def receive(self, req: DeltaRequest) -> list[Event]:
        """Take one request from Envoy; raise ProtocolError to end the stream."""
        check_request(req.type_url, [*req.subscribe, *req.unsubscribe, *req.initial_versions], self.limits)
        events: list[Event] = []
        first = not self._started
        if first:
            self._start(req.has_node)
        if req.response_nonce:
            if self.in_flight is not None and req.response_nonce == self.in_flight.nonce:
                events.append(self._answered(self.in_flight, req.error_message))
                self.in_flight = None
            else:
                events.append(StaleNonce(req.response_nonce))  # subscriptions still count
        added = tuple(n for n in dict.fromkeys(req.subscribe) if n != WILDCARD and n not in self.subscribed)
        removed = tuple(n for n in dict.fromkeys(req.unsubscribe) if n in self.subscribed)
        for name in removed:
            self._forget(name)
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

    def poll(self) -> DeltaResponse | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        current = self._take_dirty()
        due = self._due(current) if current else ()
        if not due:
            return None
        self.in_flight = DeltaResponse(response_version(due), due, self._next_nonce())
        return self.in_flight
