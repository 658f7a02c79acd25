"""State-of-the-world EDS stream logic, without sockets: requests and store changes in, responses out.

One `SotwStream` per gRPC stream. It keeps at most one response in flight: changes that arrive
while Envoy has not yet ACKed coalesce into the next response, so a slow client costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..store import Resource
from .common import (
    WILDCARD,
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
        elif req.response_nonce != self._last_nonce:
            # Written before the client saw our latest response (an empty nonce too: it had seen
            # none): stale, and that response's answer will carry its current names. As in the
            # protocol doc; go-control-plane likewise only acts on a request whose nonce is its latest.
            return [StaleNonce(req.response_nonce)]
        elif self.in_flight is not None:  # the latest nonce: this answers the response in flight
            names = tuple(r.name for r in self.in_flight.resources)
            self._settle(self.in_flight.resources, req.error_message)
            if req.error_message is not None:
                events.append(Nack(self.in_flight.version_info, names, req.error_message))
            else:
                events.append(Ack(req.version_info, names))
            self.in_flight = None
        wanted = dict.fromkeys(req.resource_names)
        wanted.pop(WILDCARD, None)
        added = tuple(n for n in wanted if n not in self.subscribed)
        removed = tuple(n for n in self.subscribed if n not in wanted)
        for name in removed:
            self._forget(name)
        for name in added:
            self._resend(name)
        if (added or removed) and not first:
            self._resume_version = ""  # it described the names the stream started with
        self.subscribed = wanted
        if first and not wanted:
            self._owe_empty = True  # "*" or the legacy empty list: no names, but an answer
        if added or removed:
            events.append(Subscribed(added, removed))
        return events

    def poll(self) -> Response | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        current = self._take_dirty()
        if current is None:
            return None
        if self._resume_version:
            resume, self._resume_version = self._resume_version, ""
            if self._holds(current, resume):
                for r in current:
                    self.sent[r.name] = self.acked[r.name] = r.version
                return None
        due = self._due(current)
        if not due and not self._owe_empty:
            return None
        self._owe_empty = False
        self._last_nonce = self._next_nonce()
        version = response_version(due, digest=len(self.subscribed) > 1) if due else ""
        self.in_flight = Response(version, due, self._last_nonce)
        return self.in_flight

    def _holds(self, current: list[Resource], resume: str) -> bool:
        """Whether a reconnecting client provably holds the current version of everything it asks for.

        Only a stream that follows one name can tell: its `version_info` is then that resource's
        own version, which a response carries only when it held exactly that resource for a stream
        following nothing else (multi-name streams' responses carry a digest). A digest cannot say
        which names the client still holds (it may have dropped some since), so every name on a
        multi-name stream is answered again. The protocol doc allows skipping only when the server
        knows the client subscribes to nothing new.
        """
        return len(self.subscribed) == 1 and len(current) == 1 and current[0].version == resume
