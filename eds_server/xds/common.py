"""What the SotW and delta stream state machines share: limits, errors, events, versions."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..encoded import Resource

EDS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# EDS has no wildcard: Envoy always names its clusters. "*" (and the legacy empty first list) asks for
# no named resource; it is never taken for a resource called "*". See docs/xds-behaviour.md.
WILDCARD = "*"


class ResourceView(Protocol):
    """What a stream reads: the store, or anything shaped like it."""

    @property
    def ready(self) -> bool: ...

    # True: a name with no resource is not answered yet (a relay before its upstream answered)
    withholds: bool

    def get(self, name: str) -> Resource: ...

    def resources(self) -> Mapping[str, Resource]: ...


Watcher = Callable[[frozenset[str] | None], None]  # told which names changed (None: any may have)


class Resources(ResourceView, Protocol):
    """The seam between the store and everything that serves streams (the xDS sessions, the gRPC,
    REST and health services): read what a name holds now, watch changes, follow names and stop.
    As go-control-plane's server sees its cache only as a ConfigWatcher, nothing past this seam
    knows how the state is merged, encoded or kept (`store.Store` is the one implementation)."""

    def unanswered(self, names: Iterable[str]) -> list[str]: ...

    def watch(self, watcher: Watcher) -> Callable[[], None]: ...

    def follow(self, watcher: Watcher, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None: ...

    def unfollow(self, watcher: Watcher) -> None: ...


class PhaseError(RuntimeError):
    """A step a stream's table (SotW's or delta's TRANSITIONS) does not list from the phase it is in:
    the code broke its own rules (never a client's doing)."""


P = TypeVar("P")
S = TypeVar("S")


def moves_of(transitions: Mapping[tuple[P, S], P]) -> dict[S, dict[P, P]]:
    """Each step's moves, phase -> the phase after it: one dict probe a step (phases and steps hash
    by identity, `__hash__ = object.__hash__`)."""
    out: dict[S, dict[P, P]] = {}
    for (before, step), after in transitions.items():
        out.setdefault(step, {})[before] = after
    return out


def illegal(kind: str, phase: Any, step: Any) -> PhaseError:
    return PhaseError(f"{kind} stream: {step.name} is no step from {phase.name} (TRANSITIONS)")


def moved(moves: Mapping[S, Mapping[P, P]], phase: P, step: S, kind: str) -> P:
    """The phase after `step`, as the table says; PhaseError if it says nothing. (The hottest moves,
    a send and its answer, are looked up inline by each stream.)"""
    after = moves.get(step, {}).get(phase)
    if after is None:
        raise illegal(kind, phase, step)
    return after


@dataclass(frozen=True, slots=True)
class SubscriptionLimits:
    """What one stream may subscribe to (--max-names, --max-name-length). "Limits" in this code
    always means what a client may take: these, ConnectionLimits (the gRPC port) and HttpLimits
    (the aiohttp ports)."""

    max_names: int = 10_000
    max_name_length: int = 1024


class ProtocolError(Exception):
    """The client broke the protocol; the stream ends with this gRPC status name and message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# What `receive` reports, for logs and counters.
@dataclass(slots=True)  # not frozen: one is made per ACK, and a frozen one costs twice as much
class Ack:
    version_info: str
    names: tuple[str, ...]


@dataclass(slots=True)
class Nack:
    version_info: str
    names: tuple[str, ...]
    message: str


@dataclass(slots=True)
class StaleNonce:
    nonce: str


@dataclass(slots=True)
class Subscribed:
    added: tuple[str, ...]
    removed: tuple[str, ...]


Event = Ack | Nack | StaleNonce | Subscribed


def response_version(resources: Iterable[Resource], *, digest: bool = False) -> str:
    """A response's version_info: the resource's own version for one, a digest of all for more.

    `digest`: use the digest even for one resource. Streams that follow several names do, so a
    resource's bare version only ever stands for a response that held exactly that resource on a
    stream that followed nothing else (what the SotW reconnect shortcut relies on).
    """
    if not digest and isinstance(resources, tuple) and len(resources) == 1:
        return resources[0].version  # the usual response: once per stream per change
    items = sorted((r.name, r.version) for r in resources)
    if len(items) == 1 and not digest:
        return items[0][1]
    hasher = hashlib.blake2b(digest_size=8)
    for name, version in items:
        hasher.update(f"{name}\0{version}\n".encode())
    return hasher.hexdigest()


def check_request(type_url: str, names: Collection[str], limits: SubscriptionLimits) -> None:
    """Refuse what no Envoy sends: another resource type, or names past the limits."""
    if type_url not in ("", EDS_TYPE_URL):
        raise ProtocolError("INVALID_ARGUMENT", f"type_url {type_url!r} is not served here")
    if len(names) > limits.max_names:
        check_count(len(names), "resource names in one request", limits)
    longest = limits.max_name_length
    for name in names:  # inline: every ACK of every stream comes through here
        if len(name) > longest:
            check_lengths((name,), limits)


def check_node(has_node: bool) -> None:
    """Only the first request of a stream is sure to carry the node; it must."""
    if not has_node:
        raise ProtocolError("INVALID_ARGUMENT", "the first request of a stream must carry a node")


def check_count(count: int, what: str, limits: SubscriptionLimits) -> None:
    if count > limits.max_names:
        raise ProtocolError("RESOURCE_EXHAUSTED", f"{count} {what} (limit {limits.max_names})")


def check_lengths(names: Iterable[str], limits: SubscriptionLimits) -> None:
    for name in names:
        if len(name) > limits.max_name_length:
            raise ProtocolError(
                "INVALID_ARGUMENT", f"resource name of {len(name)} characters (limit {limits.max_name_length})"
            )


class Nonces:
    """Where streams take their nonces from. Streams that share one give the same nonce to their
    responses to one change (each takes the shared value, moved past its own last one), so identical
    responses encode to identical bytes, once for all of them; a stream never sees a nonce twice."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def after(self, last: int) -> int:
        """A nonce for a stream whose last one was `last`."""
        if self.value <= last:
            self.value = last + 1
        return self.value


class SentResponse(Protocol):
    @property
    def resources(self) -> tuple[Resource, ...]: ...
    @property
    def nonce(self) -> str: ...


R = TypeVar("R", bound=SentResponse)


@dataclass
class StreamState(Generic[R]):
    """Bookkeeping both stream kinds share: subscriptions, what was sent, accepted or rejected, what is due.

    At most one response (`R`) is in flight; changes meanwhile only mark names dirty, so they
    coalesce into the next response.
    """

    view: ResourceView
    limits: SubscriptionLimits = field(default_factory=SubscriptionLimits)
    nonces: Nonces = field(default_factory=Nonces)

    subscribed: dict[str, None] = field(default_factory=dict)  # ordered set
    sent: dict[str, str] = field(default_factory=dict)  # name -> version sent (Envoy has it, or soon)
    acked: dict[str, str] = field(default_factory=dict)  # name -> version Envoy accepted (or said it has)
    nacked: dict[str, str] = field(default_factory=dict)  # name -> version Envoy rejected
    in_flight: R | None = None
    _dirty: set[str] = field(default_factory=set)
    # name -> version that was in a rejected response of several resources: which one was bad is
    # unknown, so each is sent again alone, once, and its own answer decides.
    _suspects: dict[str, str] = field(default_factory=dict)
    _nonces: int = 0

    def changed(self, names: Iterable[str] | None) -> None:
        """The store changed these names (None: anything may have changed)."""
        if names is None:
            self._dirty.update(self.subscribed)
        elif isinstance(names, frozenset) and len(names) == 1:  # the usual change, for each stream
            for name in names:
                if name in self.subscribed:
                    self._dirty.add(name)
        else:
            self._dirty.update(n for n in names if n in self.subscribed)

    @property
    def wants_poll(self) -> bool:
        """Whether `poll` may have a response now (each kind says from its own state)."""
        raise NotImplementedError

    def changed_due(self, names: frozenset[str] | None) -> bool:
        """`changed(names)`, then whether `poll` may have a response now."""
        self.changed(names)
        return self.wants_poll

    def acked_version(self, name: str) -> str | None:
        """The version of `name` Envoy holds, as far as this stream knows (not one it rejected)."""
        return self.acked.get(name)

    def _forget(self, name: str) -> None:
        self.subscribed.pop(name, None)
        self.sent.pop(name, None)
        self.acked.pop(name, None)
        self.nacked.pop(name, None)
        self._suspects.pop(name, None)
        self._dirty.discard(name)

    def _resend(self, name: str) -> None:
        """Subscribed again on a live stream: answered even if unchanged, or rejected before."""
        self.sent.pop(name, None)
        self.nacked.pop(name, None)
        self._suspects.pop(name, None)
        self._dirty.add(name)

    def _settle(self, resources: tuple[Resource, ...], error: str | None) -> None:
        """Envoy answered the response in flight: ACK (`error` None) or NACK."""
        subscribed, suspects = self.subscribed, self._suspects
        if error is None:  # the fan-out path: every stream ACKs every change
            for r in resources:
                if r.name in subscribed:  # not one unsubscribed meanwhile: nothing is kept for those
                    self.acked[r.name] = r.version
                    if self.nacked:
                        self.nacked.pop(r.name, None)
                    if suspects:
                        suspects.pop(r.name, None)
            return
        bundle = len(resources) > 1
        for r in resources:
            if r.name not in subscribed:
                continue
            suspects.pop(r.name, None)
            if bundle:
                self._suspects[r.name] = r.version
                self.sent.pop(r.name, None)
                self._dirty.add(r.name)
            else:
                self.nacked[r.name] = r.version

    def _take_dirty(self) -> list[Resource] | None:
        """The current resources of the dirty names, if a response may go out now."""
        if not self.wants_poll or not self.view.ready:
            return None
        names = [n for n in self.subscribed if n in self._dirty]
        self._dirty.clear()
        view = self.view
        if view.withholds:  # told again when the name arrives
            held = view.resources()
            names = [n for n in names if n in held]
        return [view.get(n) for n in names]

    def _due(self, current: Iterable[Resource]) -> tuple[Resource, ...]:
        """What Envoy lacks: not sent already, and not a version it rejected."""
        sent, nacked = self.sent, self.nacked
        due = [r for r in current if sent.get(r.name) != r.version and nacked.get(r.name) != r.version]
        if self._suspects and due:
            due = self._isolate(due)
        for r in due:
            sent[r.name] = r.version
        return tuple(due)

    def _isolate(self, due: list[Resource]) -> list[Resource]:
        """While a rejected bundle is being sorted out, one resource per response."""
        for r in due:
            if self._suspects.get(r.name, r.version) != r.version:
                del self._suspects[r.name]  # changed since: an ordinary update now
        pick = next((r for r in due if r.name in self._suspects), None)
        if pick is None:  # none left to try (answered, changed or dropped)
            self._suspects.clear()
            return due
        self._dirty.update(r.name for r in due if r is not pick)
        return [pick]

    def _next_nonce(self) -> str:
        self._nonces = self.nonces.after(self._nonces)
        return str(self._nonces)
