"""What the SotW and delta stream state machines share: limits, errors, events, versions."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

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
