"""State-of-the-world EDS stream logic, without sockets: requests and store changes in, responses out.

One `SotwStream` per gRPC stream. It keeps at most one response in flight: changes that arrive
while Envoy has not yet ACKed coalesce into the next response, so a slow client costs nothing extra.

Where a stream stands is one value, its `Phase`, changed only through `TRANSITIONS` (as h11 runs a
connection's state through its table): every change of phase is looked up there, and a step the
table does not list from the phase the stream is in raises `PhaseError` (a bug, never a client's
doing). The rules first, the code after them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from ..encoded import Resource
from .common import (
    WILDCARD,
    Ack,
    Event,
    Nack,
    PhaseError,
    StaleNonce,
    StreamState,
    Subscribed,
    check_node,
    check_request,
    illegal,
    moved,
    moves_of,
    response_version,
)


class Phase(enum.Enum):
    """Where a SotW stream stands. Per-name state (sent, accepted, rejected, suspect) is data beside it."""

    NEW = "new"  # no request read yet
    OWES_EMPTY = "owes empty"  # the first request named nothing ("*", or the legacy empty list): an answer is due
    RESUMING = "resuming"  # the first request named the version it holds (a reconnect): see SotwStream._holds
    IDLE = "idle"  # nothing in flight: a change makes a response due
    IN_FLIGHT = "in flight"  # a response awaits its ACK or NACK; changes meanwhile coalesce into the next
    IN_FLIGHT_DROPPED = "in flight, names dropped"  # and stale requests left names out: see _asked_again

    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (Enum's hashes the name)


class Step(enum.Enum):
    """What moves a stream from one phase to another."""

    FIRST = "first request naming resources"
    FIRST_RESUMING = "first request naming resources and the version it holds"
    FIRST_EMPTY = "first request naming nothing"
    STALE = "a request with an old nonce, leaving out no name while a response is in flight"
    STALE_DROPPING = "a request with an old nonce, leaving out names while a response is in flight"
    ANSWER = "the ACK or NACK of the response in flight (the latest nonce)"
    REQUEST = "a request with the latest nonce, nothing in flight, names unchanged"
    RESUBSCRIBE = "a request with the latest nonce, nothing in flight, names changed"
    SEND = "poll: a response goes out"
    RESUMED = "poll: the reconnecting client holds the current version, nothing is sent"
    NOTHING_DUE = "poll: the resume checked, nothing due"

    __hash__ = object.__hash__


# (phase, step) -> the phase after it. Anything else does not happen: a request with an old nonce and
# nothing in flight, or a poll with nothing due, changes no phase (the same phase, not listed).
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.NEW, Step.FIRST): Phase.IDLE,
    (Phase.NEW, Step.FIRST_RESUMING): Phase.RESUMING,
    (Phase.NEW, Step.FIRST_EMPTY): Phase.OWES_EMPTY,
    (Phase.OWES_EMPTY, Step.REQUEST): Phase.OWES_EMPTY,
    (Phase.OWES_EMPTY, Step.RESUBSCRIBE): Phase.OWES_EMPTY,  # an answer is still owed: the new names, or empty
    (Phase.OWES_EMPTY, Step.SEND): Phase.IN_FLIGHT,
    (Phase.RESUMING, Step.REQUEST): Phase.RESUMING,
    (Phase.RESUMING, Step.RESUBSCRIBE): Phase.IDLE,  # the version it named described other names
    (Phase.RESUMING, Step.RESUMED): Phase.IDLE,
    (Phase.RESUMING, Step.NOTHING_DUE): Phase.IDLE,
    (Phase.RESUMING, Step.SEND): Phase.IN_FLIGHT,
    (Phase.IDLE, Step.REQUEST): Phase.IDLE,
    (Phase.IDLE, Step.RESUBSCRIBE): Phase.IDLE,
    (Phase.IDLE, Step.SEND): Phase.IN_FLIGHT,
    (Phase.IN_FLIGHT, Step.STALE): Phase.IN_FLIGHT,
    (Phase.IN_FLIGHT, Step.STALE_DROPPING): Phase.IN_FLIGHT_DROPPED,
    (Phase.IN_FLIGHT, Step.ANSWER): Phase.IDLE,
    (Phase.IN_FLIGHT_DROPPED, Step.STALE): Phase.IN_FLIGHT_DROPPED,
    (Phase.IN_FLIGHT_DROPPED, Step.STALE_DROPPING): Phase.IN_FLIGHT_DROPPED,
    (Phase.IN_FLIGHT_DROPPED, Step.ANSWER): Phase.IDLE,  # names dropped and asked for again are resent
}


MOVES = moves_of(TRANSITIONS)
_ON_ANSWER, _ON_SEND = MOVES[Step.ANSWER], MOVES[Step.SEND]


def _illegal(phase: Phase, step: Step) -> PhaseError:
    return illegal("SotW", phase, step)


# read once per stream per change: module constants, not Enum attribute lookups
_NEW, _OWES_EMPTY, _RESUMING, _IDLE = Phase.NEW, Phase.OWES_EMPTY, Phase.RESUMING, Phase.IDLE


class Request(NamedTuple):  # a NamedTuple: one is made per ACK, at a third of a frozen dataclass's cost
    version_info: str = ""
    has_node: bool = False
    resource_names: tuple[str, ...] = ()
    type_url: str = ""
    response_nonce: str = ""
    error_message: str | None = None  # set on a NACK (error_detail present)


class Response(NamedTuple):
    version_info: str
    resources: tuple[Resource, ...]
    nonce: str


@dataclass
class SotwStream(StreamState[Response]):
    phase: Phase = Phase.NEW
    _resume_version: str = ""  # RESUMING: the version the reconnecting client named
    _last_nonce: str = ""
    # IN_FLIGHT_DROPPED: what stale requests (written before the client read the response in flight)
    # left out of the subscribed names: any of them (`_dropped`), and the latest (`_unwanted`, what
    # the client did not want when it read the response). See `_asked_again`.
    # Frozen, replaced whole: most streams never drop a name, and share the one empty set.
    _dropped: frozenset[str] = frozenset()
    _unwanted: frozenset[str] = frozenset()

    def _move(self, step: Step) -> None:
        self.phase = moved(MOVES, self.phase, step, "SotW")

    @property
    def wants_poll(self) -> bool:
        phase = self.phase
        return phase is _OWES_EMPTY or ((phase is _IDLE or phase is _RESUMING) and bool(self._dirty))

    def receive(self, req: Request) -> list[Event]:
        """Take one request from Envoy; raise ProtocolError to end the stream."""
        check_request(req.type_url, req.resource_names, self.limits)
        events: list[Event] = []
        answered: tuple[Resource, ...] = ()
        first = self.phase is _NEW
        if first:
            check_node(req.has_node)
        elif req.response_nonce != self._last_nonce:
            # Written before the client saw our latest response (an empty nonce too: it had seen
            # none): stale, and that response's answer will carry its current names. As in the
            # protocol doc; go-control-plane likewise only acts on a request whose nonce is its latest.
            # What it left out still counts (see `_asked_again`), if a response is on its way: with
            # none, the client has read every response, so it has no reason to send an old nonce.
            if self.in_flight is not None:
                listed = set(req.resource_names)
                self._unwanted = frozenset(n for n in self.subscribed if n not in listed)
                self._dropped = self._dropped | self._unwanted
                self._move(Step.STALE_DROPPING if self._dropped else Step.STALE)
            return [StaleNonce(req.response_nonce)]
        elif self.in_flight is not None:  # the latest nonce: this answers the response in flight
            answered = self.in_flight.resources
            names = (answered[0].name,) if len(answered) == 1 else tuple(r.name for r in answered)
            self._settle(self.in_flight.resources, req.error_message)
            if req.error_message is not None:
                events.append(Nack(self.in_flight.version_info, names, req.error_message))
            else:
                events.append(Ack(req.version_info, names))
            self.in_flight = None
            after = _ON_ANSWER.get(self.phase)  # IDLE (and the dropped names are settled below)
            if after is None:
                raise _illegal(self.phase, Step.ANSWER)
            self.phase = after
        names = req.resource_names
        one = len(names) == 1 and len(self.subscribed) == 1
        if one and not first and not self._dropped and names[0] in self.subscribed:
            return events  # Envoy's usual request: the one name it follows, as before
        wanted = dict.fromkeys(names)
        wanted.pop(WILDCARD, None)
        added = tuple(n for n in wanted if n not in self.subscribed)
        removed = tuple(n for n in self.subscribed if n not in wanted)
        again = self._asked_again(wanted, answered)
        for name in removed:
            self._forget(name)
        for name in added:
            self._resend(name)
        if first:
            if not wanted:
                self._move(Step.FIRST_EMPTY)  # "*" or the legacy empty list: no names, but an answer
            elif req.version_info:
                self._move(Step.FIRST_RESUMING)
                self._resume_version = req.version_info
            else:
                self._move(Step.FIRST)
        elif (added or removed or again) and self.phase is _RESUMING:
            self._move(Step.RESUBSCRIBE)  # the version described the names the stream started with
            self._resume_version = ""
        self.subscribed = wanted
        if added or removed:
            events.append(Subscribed(added, removed))
        return events

    def _asked_again(self, wanted: dict[str, None], answered: tuple[Resource, ...]) -> tuple[str, ...]:
        """Names stale requests dropped that the answer to `answered` lists again, and the client lacks.

        The protocol: "The client will silently ignore any supplied resources that were not
        explicitly requested. When the client sends a new request that changes the set of resources
        being requested, the server must resend any newly requested resources". Every stale request
        was written before the client read `answered`, so the latest one says what it wanted then.
        A name it did not want then was ignored in `answered`, although the ACK covers the whole
        response. A name it dropped and asked for again before reading `answered` lost its old copy,
        and only got a new one if `answered` held it. Either way the client lacks it, though to us it
        looks like a client that kept it: it is sent again (even if unchanged or rejected before).
        Costs at most one resend per name dropped and listed again.
        """
        if not self._dropped:
            return ()
        dropped, unwanted = self._dropped, self._unwanted
        self._dropped = self._unwanted = frozenset()
        got = {r.name for r in answered}
        subscribed = self.subscribed
        again = tuple(n for n in wanted if n in dropped and n in subscribed and (n in unwanted or n not in got))
        for name in again:
            self.acked.pop(name, None)  # it may hold nothing (it ignored our copy)
            self._resend(name)
        return again

    def changed_due(self, names: frozenset[str] | None) -> bool:
        """`changed(names)`, then `wants_poll`, in one call: the fan-out asks both of every stream of
        every change. The same answer and state as the two calls (a property test compares them)."""
        if names is not None and self.phase is _IDLE and len(names) == 1 and len(self.subscribed) == 1:
            for name in names:
                if name in self.subscribed:
                    self._dirty.add(name)
                    return True
            return bool(self._dirty)
        self.changed(names)
        return self.wants_poll

    def poll(self) -> Response | None:
        """The next response to send, if one is due; it stays in flight until Envoy answers it."""
        if self.phase is _IDLE and len(self.subscribed) == 1 and not self._suspects:
            return self._poll_one()
        return self._poll_any()

    def _poll_one(self) -> Response | None:
        """`_poll_any` for an idle stream that follows one name, no suspects (the fan-out's stream),
        in one step: its rules inlined, the same result and state (a property test compares them),
        the phase still moved through TRANSITIONS."""
        dirty = self._dirty
        if not dirty:
            return None  # wants_poll says no
        view = self.view
        if not view.ready:
            return None
        (name,) = self.subscribed
        due = name in dirty
        dirty.clear()
        if not due or (view.withholds and name not in view.resources()):
            return None
        r = view.get(name)
        version = r.version
        if self.sent.get(name) == version or self.nacked.get(name) == version:
            return None
        self.sent[name] = version
        self._last_nonce = nonce = self._next_nonce()
        self.in_flight = response = Response(version, (r,), nonce)
        after = _ON_SEND.get(_IDLE)
        if after is None:
            raise _illegal(_IDLE, Step.SEND)
        self.phase = after
        return response

    def ack_one(self) -> tuple[str, ...] | None:
        """The plain ACK of the one-resource response in flight, on a stream following that one name
        and nothing dropped, taken as `receive` takes it (the caller recognised its bytes: see
        xds/session.py `sotw_ack`): the names acked, or None (nothing changed) for any other case.
        The ACK's read and settle in one step."""
        flight = self.in_flight
        if flight is None or self._dropped or len(self.subscribed) != 1 or len(flight.resources) != 1:
            return None
        r = flight.resources[0]
        name = r.name
        if name not in self.subscribed:
            return None
        self.acked[name] = r.version
        if self.nacked:
            self.nacked.pop(name, None)
        if self._suspects:
            self._suspects.pop(name, None)
        self.in_flight = None
        after = _ON_ANSWER.get(self.phase)
        if after is None:
            raise _illegal(self.phase, Step.ANSWER)
        self.phase = after
        return (name,)

    def _poll_any(self) -> Response | None:
        """`poll`, for every phase and any names."""
        current = self._take_dirty()
        if current is None:
            return None
        if self.phase is _RESUMING and current:  # (none: withheld by a relay; the resume waits for it)
            resume, self._resume_version = self._resume_version, ""
            holds = self._holds(current, resume)
            self._move(Step.RESUMED if holds else Step.NOTHING_DUE)  # IDLE: a response may still go below
            if holds:
                for r in current:
                    self.sent[r.name] = self.acked[r.name] = r.version
                return None
        due = self._due(current)
        if not due and self.phase is not _OWES_EMPTY:
            return None
        self._last_nonce = self._next_nonce()
        version = response_version(due, digest=len(self.subscribed) > 1) if due else ""
        self.in_flight = Response(version, due, self._last_nonce)
        after = _ON_SEND.get(self.phase)
        if after is None:
            raise _illegal(self.phase, Step.SEND)
        self.phase = after
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
