"""State-of-the-world EDS stream logic, without sockets: requests and store changes in, responses out.

One `SotwStream` per gRPC stream. It keeps at most one response in flight: changes that arrive
while Envoy has not yet ACKed coalesce into the next response, so a slow client costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..store import Resource
from .common import (
    Ack,
    Event,
    Nack,
    StaleNonce,
    StreamState,
    Subscribed,
    check_request,
    response_version,
)


@dataclass(frozen=True, slots=True)
class Request:
    version_info: str = ""
    has_node: bool = False
    resource_names: tuple[str, ...] = ()
    type_url: str = ""
    response_nonce: str = ""
    error_message: str | None = None  # set on a NACK (error_detail present)


@dataclass(frozen=True, slots=True)
class Response:
    version_info: str
    resources: tuple[Resource, ...]
    nonce: str


@dataclass
class SotwStream(StreamState[Response]):
    acked: dict[str, str] = field(default_factory=dict)  # name -> version Envoy accepted
    _resume_version: str = ""
    _last_nonce: str = ""

    def receive(self, req: Request) -> list[Event]:
        """Take one request from Envoy; raise ProtocolError to end the stream."""
        check_request(req.type_url, req.resource_names, self.limits)
        events: list[Event] = []
        first = not self._started
        if first:
            self._start(req.has_node)
            self._resume_version = req.version_info
        elif req.response_nonce and req.response_nonce != self._last_nonce:
            return [StaleNonce(req.response_nonce)]  # superseded: a newer response is on its way
        elif self.in_flight is not None and req.response_nonce == self.in_flight.nonce:
            names = tuple(r.name for r in self.in_flight.resources)
            if req.error_message is not None:
                for r in self.in_flight.resources:
                    if r.name in self.subscribed:  # not one unsubscribed meanwhile
                        self.nacked[r.name] = r.version
                events.append(Nack(self.in_flight.version_info, names, req.error_message))
            else:
                for r in self.in_flight.resources:
                    self.acked[r.name] = r.version
                    self.nacked.pop(r.name, None)
                events.append(Ack(req.version_info, names))
            self.in_flight = None
        wanted = dict.fromkeys(req.resource_names)
        added = tuple(n for n in wanted if n not in self.subscribed)
        removed = tuple(n for n in self.subscribed if n not in wanted)
        for name in removed:
            self._forget(name)
            self.acked.pop(name, None)
        for name in added:
            self.sent.pop(name, None)  # answered even if unchanged (or rejected before)
            self.nacked.pop(name, None)
        if (added or removed) and not first:
            self._resume_version = ""  # it described the names the stream started with
        self._dirty.update(added)
        self.subscribed = wanted
        if added or removed:
            events.append(Subscribed(added, removed))
        return events

    def acked_version(self, name: str) -> str | None:
        return self.acked.get(name)

    def poll(self) -> Response | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        current = self._take_dirty()
        if current is None:
            return None
        if self._resume_version:
            # A reconnecting Envoy tells us what it has; content-derived versions make this exact.
            resume, self._resume_version = self._resume_version, ""
            if len(current) == len(self.subscribed) and response_version(current) == resume:
                for r in current:
                    self.sent[r.name] = self.acked[r.name] = r.version
                return None
        due = self._due(current)
        if not due:
            return None
        self._last_nonce = self._next_nonce()
        self.in_flight = Response(response_version(due), due, self._last_nonce)
        return self.in_flight
