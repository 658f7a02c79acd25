"""Incremental (delta) EDS stream logic, without sockets: requests and store changes in, responses out.

Differences from SotW that shape this: subscriptions change by deltas and must be honoured even on
a request with a stale nonce; a reconnecting Envoy says which versions it already has
(`initial_resource_versions`) and only the others are sent; versions are per resource. An unknown or
removed group is sent as a CLA with no endpoints, never as a removal: a delta removal leaves
Envoy's old hosts in place, and it must look to Envoy exactly as in SotW.

Where a stream stands is one `DeltaPhase`, moved only through `TRANSITIONS` (looked up at each step;
`PhaseError` on a step it does not list), as the SotW stream's is. Subscriptions change by deltas in
any phase and move none.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..encoded import Resource
from .common import (
    EDS_TYPE_URL,
    WILDCARD,
    Ack,
    Event,
    Nack,
    PhaseError,
    ProtocolError,
    StaleNonce,
    StreamState,
    Subscribed,
    check_count,
    check_lengths,
    check_node,
    illegal,
    moved,
    moves_of,
    response_version,
)


class DeltaPhase(enum.Enum):
    """Where a delta stream stands; per-name state (sent, accepted, rejected) is data beside it."""

    NEW = "new"  # no request read yet
    OWES_EMPTY = "owes empty"  # the first request named nothing ("*" or no name): an answer is due
    IDLE = "idle"  # nothing in flight: a change makes a response due
    IN_FLIGHT = "in flight"  # a response awaits its ACK or NACK; changes meanwhile coalesce into the next

    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C


class DeltaStep(enum.Enum):
    FIRST = "first request naming resources"
    FIRST_EMPTY = "first request naming nothing"
    ANSWER = "the ACK or NACK of the response in flight"
    SEND = "poll: a response goes out"

    __hash__ = object.__hash__


# (phase, step) -> the phase after it. A stale nonce and a change of subscriptions move no phase.
TRANSITIONS: dict[tuple[DeltaPhase, DeltaStep], DeltaPhase] = {
    (DeltaPhase.NEW, DeltaStep.FIRST): DeltaPhase.IDLE,
    (DeltaPhase.NEW, DeltaStep.FIRST_EMPTY): DeltaPhase.OWES_EMPTY,
    (DeltaPhase.OWES_EMPTY, DeltaStep.SEND): DeltaPhase.IN_FLIGHT,
    (DeltaPhase.IDLE, DeltaStep.SEND): DeltaPhase.IN_FLIGHT,
    (DeltaPhase.IN_FLIGHT, DeltaStep.ANSWER): DeltaPhase.IDLE,
}
MOVES = moves_of(TRANSITIONS)
_ON_ANSWER, _ON_SEND = MOVES[DeltaStep.ANSWER], MOVES[DeltaStep.SEND]
_NEW, _OWES_EMPTY, _IDLE = DeltaPhase.NEW, DeltaPhase.OWES_EMPTY, DeltaPhase.IDLE


def _illegal(phase: DeltaPhase, step: DeltaStep) -> PhaseError:
    return illegal("delta", phase, step)


@dataclass(frozen=True, slots=True)
class DeltaRequest:
    has_node: bool = False
    type_url: str = ""
    subscribe: tuple[str, ...] = ()
    unsubscribe: tuple[str, ...] = ()
    initial_versions: Mapping[str, str] = field(default_factory=dict)
    response_nonce: str = ""
    error_message: str | None = None


class DeltaResponse(NamedTuple):
    system_version_info: str  # for debugging only; Envoy tracks versions per resource
    resources: tuple[Resource, ...]
    nonce: str


@dataclass
class DeltaStream(StreamState[DeltaResponse]):
    phase: DeltaPhase = DeltaPhase.NEW

    def _move(self, step: DeltaStep) -> None:
        self.phase = moved(MOVES, self.phase, step, "delta")

    @property
    def wants_poll(self) -> bool:
        phase = self.phase
        return phase is _OWES_EMPTY or (phase is _IDLE and bool(self._dirty))

    def receive(self, req: DeltaRequest) -> list[Event]:
        """Take one request from Envoy; raise ProtocolError to end the stream."""
        if req.type_url not in ("", EDS_TYPE_URL):
            raise ProtocolError("INVALID_ARGUMENT", f"type_url {req.type_url!r} is not served here")
        subscribe = dict.fromkeys(req.subscribe)
        subscribe.pop(WILDCARD, None)
        unsubscribe = dict.fromkeys(req.unsubscribe)
        if subscribe or unsubscribe or req.initial_versions:  # not on a plain ACK: the fan-out path
            self._check(req, subscribe, unsubscribe)
        events: list[Event] = []
        first = self.phase is _NEW
        if first:
            check_node(req.has_node)
        if req.response_nonce:
            if self.in_flight is not None and req.response_nonce == self.in_flight.nonce:
                events.append(self._answered(self.in_flight, req.error_message))
                self.in_flight = None
                after = _ON_ANSWER.get(self.phase)
                if after is None:
                    raise _illegal(self.phase, DeltaStep.ANSWER)
                self.phase = after
            else:
                events.append(StaleNonce(req.response_nonce))  # subscriptions still count
        # Subscribes first, then unsubscribes (the protocol doc's order, and go-control-plane's):
        # a name in both lists ends up unsubscribed, and the store is told the same net change.
        if not (subscribe or unsubscribe):
            if first:
                self._move(DeltaStep.FIRST_EMPTY)  # "*" or nothing: no names, but an answer
            return events
        added = tuple(n for n in subscribe if n not in self.subscribed and n not in unsubscribe)
        removed = tuple(n for n in unsubscribe if n in self.subscribed)
        for name in removed:
            self._forget(name)
        for name in subscribe:
            if name in unsubscribe:
                continue
            self.subscribed[name] = None
            if first and name in req.initial_versions:
                self._dirty.add(name)
                self.sent[name] = self.acked[name] = req.initial_versions[name]  # resent only if stale
            else:
                self._resend(name)  # subscribed on a live stream: always sent, even if rejected before
        if first:  # "*" or names all unsubscribed again: no names, but an answer
            self._move(DeltaStep.FIRST if self.subscribed else DeltaStep.FIRST_EMPTY)
        if added or removed:
            events.append(Subscribed(added, removed))
        return events

    def _check(self, req: DeltaRequest, subscribe: dict[str, None], unsubscribe: dict[str, None]) -> None:
        """Name lengths, and `max_names` as a total of names subscribed on this stream.

        A reconnecting client lists its names in `subscribe` and again in `initial_versions`: counted once.
        """
        check_count(len(subscribe.keys() | req.initial_versions.keys()), "resource names in one request", self.limits)
        check_count(len(unsubscribe), "names to unsubscribe in one request", self.limits)
        check_lengths(itertools.chain(subscribe, unsubscribe, req.initial_versions), self.limits)
        total = len(self.subscribed)
        total += sum(1 for n in subscribe if n not in self.subscribed and n not in unsubscribe)
        total -= sum(1 for n in unsubscribe if n in self.subscribed)
        check_count(total, "resource names subscribed on one stream", self.limits)

    def _answered(self, response: DeltaResponse, error: str | None) -> Event:
        names = tuple(r.name for r in response.resources)
        self._settle(response.resources, error)
        if error is None:
            return Ack(response.system_version_info, names)
        return Nack(response.system_version_info, names, error)

    def poll(self) -> DeltaResponse | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        current = self._take_dirty()
        if current is None:
            return None
        due = self._due(current)
        if not due and self.phase is not _OWES_EMPTY:
            return None
        version = response_version(due, digest=len(self.subscribed) > 1) if due else ""
        self.in_flight = DeltaResponse(version, due, self._next_nonce())
        after = _ON_SEND.get(self.phase)
        if after is None:
            raise _illegal(self.phase, DeltaStep.SEND)
        self.phase = after
        return self.in_flight
