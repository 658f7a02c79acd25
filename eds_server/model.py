"""Validated plain data for upstream groups: what every source produces and the store merges.

Nothing here does IO or knows about protobuf; the values are already checked, so anything built from
them is something Envoy accepts.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .health.spec import HealthSpec, to_json


class Health(enum.IntEnum):
    """Envoy's `config.core.v3.HealthStatus`, with the same numbers."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2
    DRAINING = 3
    TIMEOUT = 4
    DEGRADED = 5


@dataclass(frozen=True, slots=True, order=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""


@functools.lru_cache(maxsize=4096)
def _interned(region: str, zone: str, subzone: str) -> Locality:
    return Locality(region, zone, subzone)


def locality(region: str = "", zone: str = "", subzone: str = "") -> Locality:
    """One shared Locality per value (every source makes them here): sorting and grouping
    thousands of endpoints then compares localities by identity, not with the dataclass's
    Python-level __eq__."""
    return _interned(region, zone, subzone)


NOWHERE = locality()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One upstream host. `address` is an IP literal (Envoy rejects hostnames in EDS)."""

    address: str
    port: int
    weight: int | None = None  # None: leave load_balancing_weight unset (Envoy uses 1)
    health: Health = Health.UNKNOWN
    priority: int = 0
    locality: Locality = NOWHERE
    hostname: str = ""
    # filter_metadata["envoy.lb"]: JSON-like values, for Envoy's subset load balancer
    metadata: Mapping[str, Any] = field(default_factory=dict)
    check: HealthSpec | None = None  # an active health check eds-server runs on it (not sent to Envoy)
    # its encoded lb_endpoints field, once encode.py has made it: an endpoint a source keeps
    # (the file's parser, Kubernetes, Docker) is encoded once, and found without a cache key
    wire: bytes | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.address, self.port)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Endpoint:
        """From checked values keyed as in the upstreams file (address, port, region, ...)."""
        return cls(
            address=values["address"],
            port=values["port"],
            weight=values.get("weight"),
            health=values.get("health", Health.UNKNOWN),
            priority=values.get("priority", 0),
            locality=locality(values.get("region", ""), values.get("zone", ""), values.get("subzone", "")),
            hostname=values.get("hostname", ""),
            metadata=values.get("metadata") or {},
        )


@dataclass(frozen=True, slots=True)
class Group:
    """A named set of endpoints: one ClusterLoadAssignment, named as Envoy asks for it."""

    name: str
    endpoints: tuple[Endpoint, ...] = ()
    # per-locality load_balancing_weight, for Envoy's locality-weighted load balancing
    locality_weights: Mapping[Locality, int] = field(default_factory=dict)


def groups_from(pairs: Iterable[tuple[str, Endpoint]]) -> dict[str, Group]:
    """(group, endpoint) pairs -> groups; a repeated address:port in a group keeps the first."""
    merged: dict[str, dict[tuple[str, int], Endpoint]] = {}
    for group, ep in pairs:
        merged.setdefault(group, {}).setdefault(ep.key, ep)
    return {name: Group(name, tuple(eps.values())) for name, eps in merged.items()}


def merge_groups(name: str, parts: list[Group]) -> Group:
    """Union of one group's endpoints across sources; the first source wins a duplicate address."""
    if len(parts) == 1:
        return parts[0]
    endpoints: dict[tuple[str, int], Endpoint] = {}
    weights: dict[Locality, int] = {}
    for part in parts:
        for ep in part.endpoints:
            endpoints.setdefault(ep.key, ep)
        for loc, w in part.locality_weights.items():
            weights.setdefault(loc, w)
    return Group(name, tuple(endpoints.values()), weights)


def endpoint_json(ep: Endpoint) -> dict[str, Any]:
    """The JSON form of an endpoint (admin API, registrations and their state file): the upstreams
    file's keys, defaults left out."""
    out: dict[str, Any] = {"address": ep.address, "port": ep.port, "health": ep.health.name.lower()}
    if ep.weight is not None:
        out["weight"] = ep.weight
    if ep.priority:
        out["priority"] = ep.priority
    for key in ("region", "zone", "subzone"):
        if value := getattr(ep.locality, key):
            out[key] = value
    if ep.hostname:
        out["hostname"] = ep.hostname
    if ep.metadata:
        out["metadata"] = dict(ep.metadata)
    if ep.check is not None:
        out["health_check"] = to_json(ep.check)
    return out
