"""What the SotW and delta stream state machines share: limits, errors, events, versions."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..store import Resource

EDS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


class ResourceView(Protocol):
    """What a stream reads: the store, or anything shaped like it."""

    @property
    def ready(self) -> bool: ...

    def get(self, name: str) -> Resource: ...


@dataclass(frozen=True, slots=True)
class Limits:
    max_names: int = 10_000
    max_name_length: int = 1024


class ProtocolError(Exception):
    """The client broke the protocol; the stream ends with this gRPC status name and message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# What `receive` reports, for logs and counters.
@dataclass(frozen=True, slots=True)
class Ack:
    version_info: str
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Nack:
    version_info: str
    names: tuple[str, ...]
    message: str


@dataclass(frozen=True, slots=True)
class StaleNonce:
    nonce: str


@dataclass(frozen=True, slots=True)
class Subscribed:
    added: tuple[str, ...]
    removed: tuple[str, ...]


Event = Ack | Nack | StaleNonce | Subscribed


def response_version(resources: Iterable[Resource]) -> str:
    """A response's version_info: the resource's own version for one, a digest of all for more."""
    items = sorted((r.name, r.version) for r in resources)
    if len(items) == 1:
        return items[0][1]
    digest = hashlib.blake2b(digest_size=8)
    for name, version in items:
        digest.update(f"{name}\0{version}\n".encode())
    return digest.hexdigest()


def check_request(type_url: str, names: Collection[str], limits: Limits) -> None:
    """Refuse what no Envoy sends: another resource type, or names past the limits."""
    if type_url not in ("", EDS_TYPE_URL):
        raise ProtocolError("INVALID_ARGUMENT", f"type_url {type_url!r} is not served here")
    if len(names) > limits.max_names:
        raise ProtocolError(
            "RESOURCE_EXHAUSTED", f"{len(names)} resource names in one request (limit {limits.max_names})"
        )
    for name in names:
        if len(name) > limits.max_name_length:
            raise ProtocolError(
                "INVALID_ARGUMENT", f"resource name of {len(name)} characters (limit {limits.max_name_length})"
            )


class SentResponse(Protocol):
    @property
    def resources(self) -> tuple[Resource, ...]: ...
    @property
    def nonce(self) -> str: ...


R = TypeVar("R", bound=SentResponse)


@dataclass
class StreamState(Generic[R]):
    """Bookkeeping both stream kinds share: subscriptions, what was sent or rejected, what is due.

    At most one response (`R`) is in flight; changes meanwhile only mark names dirty, so they
    coalesce into the next response.
    """

    view: ResourceView
    limits: Limits = field(default_factory=Limits)

    subscribed: dict[str, None] = field(default_factory=dict)  # ordered set
    sent: dict[str, str] = field(default_factory=dict)  # name -> version sent (Envoy has it, or soon)
    nacked: dict[str, str] = field(default_factory=dict)  # name -> version Envoy rejected
    in_flight: R | None = None
    _dirty: set[str] = field(default_factory=set)
    _started: bool = False
    _nonces: int = 0

    def changed(self, names: Iterable[str] | None) -> None:
        """The store changed these names (None: anything may have changed)."""
        if names is None:
            self._dirty.update(self.subscribed)
        else:
            self._dirty.update(n for n in names if n in self.subscribed)

    @property
    def wants_poll(self) -> bool:
        return bool(self._dirty) and self.in_flight is None and self._started

    def acked_version(self, name: str) -> str | None:
        """The version of `name` Envoy has accepted, as far as this stream knows."""
        in_flight = self.in_flight is not None and any(r.name == name for r in self.in_flight.resources)
        return None if in_flight else self.sent.get(name)

    def _start(self, has_node: bool) -> None:
        if not has_node:
            raise ProtocolError("INVALID_ARGUMENT", "the first request of a stream must carry a node")
        self._started = True

    def _forget(self, name: str) -> None:
        self.subscribed.pop(name, None)
        self.sent.pop(name, None)
        self.nacked.pop(name, None)
        self._dirty.discard(name)

    def _take_dirty(self) -> list[Resource] | None:
        """The current resources of the dirty names, if a response may go out now."""
        if not self.wants_poll or not self.view.ready:
            return None
        names = [n for n in self.subscribed if n in self._dirty]
        self._dirty.clear()
        return [self.view.get(n) for n in names]

    def _due(self, current: Iterable[Resource]) -> tuple[Resource, ...]:
        """What Envoy lacks: not sent already, and not a version it rejected."""
        due = tuple(r for r in current if self.sent.get(r.name) != r.version and self.nacked.get(r.name) != r.version)
        for r in due:
            self.sent[r.name] = r.version
        return due

    def _next_nonce(self) -> str:
        self._nonces += 1
        return str(self._nonces)
