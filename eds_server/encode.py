"""Groups -> encoded ClusterLoadAssignment bytes: the only place that builds CLAs.

`encode_group` assembles the wire bytes from per-endpoint pieces, so a change to one endpoint of a
10,000-endpoint group encodes one endpoint, not 10,000 (a repeated protobuf field is the
concatenation of its elements). `cluster_load_assignment` builds the same message with the
generated classes: it serves the JSON of REST responses, and tests check that both agree. The
output is canonical (localities and endpoints sorted, metadata keys ordered), so the same content
always gives the same bytes and therefore the same version.

The caches that make this cheap belong to an `Encoders`, which the App makes and hands to the
store, the gRPC service and the REST port: nothing here is process-wide state, so two servers in
one process (tests, a relay tier) share none. The module's functions work without one, uncached.
"""

from __future__ import annotations

import json
import operator
import weakref
from collections.abc import Callable, Mapping
from itertools import groupby
from typing import Any

from .encoded import Resource
from .model import Endpoint, Group, Health, Locality
from .pb.envoy.config.core.v3 import Address, HealthStatus, Metadata, SocketAddress
from .pb.envoy.config.core.v3 import Locality as PbLocality
from .pb.envoy.config.endpoint.v3 import ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints
from .pb.envoy.config.endpoint.v3 import Endpoint as PbEndpoint
from .pb.google.protobuf import Struct
from .protowire import length_delimited, string_field, varint
from .xds.common import EDS_TYPE_URL
from .xds.wire import Responses

LB_METADATA_KEY = "envoy.lb"
ENDPOINT_CACHE_SIZE = 200_000  # encoded LbEndpoints kept; about 100 bytes each


# C-level key functions: a Python one per endpoint was a third of encoding a 1,000-endpoint group
_bucket: Callable[[Endpoint], tuple[int, Locality]] = operator.attrgetter("priority", "locality")
_order = operator.attrgetter("priority", "locality", "address", "port")


def _ordered(group: Group) -> list[Endpoint]:
    return sorted(group.endpoints, key=_order)


def _sorted(value: Any) -> Any:
    """Map keys in a fixed order: equal metadata must encode to equal bytes (and versions)."""
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _metadata(ep: Endpoint) -> Metadata | None:
    if not ep.metadata:
        return None
    return Metadata(filter_metadata={LB_METADATA_KEY: Struct.from_dict(_sorted(ep.metadata))})


# -- the generated classes -----------------------------------------------------------------------
def lb_endpoint(ep: Endpoint) -> LbEndpoint:
    return LbEndpoint(
        endpoint=PbEndpoint(
            address=Address(socket_address=SocketAddress(address=ep.address, port_value=ep.port)),
            hostname=ep.hostname,
        ),
        health_status=HealthStatus(int(ep.health)),
        metadata=_metadata(ep),
        load_balancing_weight=ep.weight,
    )


def cluster_load_assignment(group: Group) -> ClusterLoadAssignment:
    localities = []
    for (priority, loc), eps in groupby(_ordered(group), key=_bucket):
        localities.append(
            LocalityLbEndpoints(
                locality=PbLocality(region=loc.region, zone=loc.zone, sub_zone=loc.subzone),
                lb_endpoints=[lb_endpoint(e) for e in eps],
                load_balancing_weight=group.locality_weights.get(loc),
                priority=priority,
            )
        )
    return ClusterLoadAssignment(cluster_name=group.name, endpoints=localities)


# -- the same bytes from cached pieces -------------------------------------------------------------
def _uint32_value(field_number: int, value: int) -> bytes:
    """A google.protobuf.UInt32Value field: a message holding the value as field 1."""
    return length_delimited(field_number, (varint(1 << 3) + varint(value)) if value else b"")


def _encode_lb_endpoint(ep: Endpoint) -> bytes:
    socket = string_field(2, ep.address) + (varint(3 << 3) + varint(ep.port) if ep.port else b"")
    endpoint = length_delimited(1, length_delimited(1, socket)) + string_field(3, ep.hostname)
    out = length_delimited(1, endpoint)  # LbEndpoint.endpoint
    if ep.health != Health.UNKNOWN:
        out += varint(2 << 3) + varint(int(ep.health))  # health_status
    metadata = _metadata(ep)
    if metadata is not None:
        out += length_delimited(3, bytes(metadata))
    if ep.weight is not None:
        out += _uint32_value(4, ep.weight)  # load_balancing_weight
    return out


def lb_endpoint_field(ep: Endpoint) -> bytes:
    """One endpoint's encoded `lb_endpoints` field, kept on the endpoint."""
    wire = ep.wire
    if wire is None:
        wire = length_delimited(2, _encode_lb_endpoint(ep))
        object.__setattr__(ep, "wire", wire)  # frozen, but this is a cache, not a value (compare=False)
    return wire


def encode_group(group: Group, field: Callable[[Endpoint], bytes] = lb_endpoint_field) -> bytes:
    """The group's ClusterLoadAssignment; `field` gives each endpoint's encoded `lb_endpoints`."""
    out = [string_field(1, group.name)]
    for (priority, loc), eps in groupby(_ordered(group), key=_bucket):
        locality = string_field(1, loc.region) + string_field(2, loc.zone) + string_field(3, loc.subzone)
        parts = [length_delimited(1, locality)]
        parts.extend(map(field, eps))
        weight = group.locality_weights.get(loc)
        if weight is not None:
            parts.append(_uint32_value(3, weight))
        if priority:
            parts.append(varint(5 << 3) + varint(priority))
        out.append(length_delimited(2, b"".join(parts)))
    return b"".join(out)


def _endpoint_cache(size: int) -> Callable[[Endpoint], bytes]:
    """`lb_endpoint_field`, and found by value for an equal endpoint encoded before (a source that
    rebuilds its endpoints on every change) in a FIFO-bounded cache of its own. A closure, not a
    method: called once per endpoint of every changed group."""
    cache: dict[tuple[Any, ...], bytes] = {}

    def lb_endpoint_field(ep: Endpoint) -> bytes:
        if ep.wire is not None:
            return ep.wire
        key = (
            ep.address,
            ep.port,
            ep.weight,
            ep.health,
            ep.hostname,
            json.dumps(ep.metadata, sort_keys=True) if ep.metadata else "",
        )
        cached = cache.get(key)
        if cached is None:
            if len(cache) >= size:
                del cache[next(iter(cache))]  # the oldest
            cached = cache[key] = length_delimited(2, _encode_lb_endpoint(ep))
        object.__setattr__(ep, "wire", cached)
        return cached

    return lb_endpoint_field


class Encoders:
    """The encoders one server serves with, and their caches: made by the App, handed to the
    store (`encode_group`), the gRPC service (`responses`) and the REST port (`resource_json`)."""

    def __init__(self, endpoint_cache_size: int = ENDPOINT_CACHE_SIZE) -> None:
        self.lb_endpoint_field = _endpoint_cache(endpoint_cache_size)
        self.responses = Responses()  # DiscoveryResponse bytes from cached per-resource fields
        # resource -> its proto3-JSON `Any` (REST), built once per version: weak keys, so kept
        # exactly as long as the store holds that version
        self._json: weakref.WeakKeyDictionary[Resource, dict[str, Any]] = weakref.WeakKeyDictionary()

    def encode_group(self, group: Group) -> bytes:
        return encode_group(group, self.lb_endpoint_field)

    def resource_json(self, resource: Resource) -> dict[str, Any]:
        """A resource as the `Any` of a REST DiscoveryResponse's JSON."""
        cached = self._json.get(resource)
        if cached is None:
            cached = self._json[resource] = {"@type": EDS_TYPE_URL, **cluster_load_assignment(resource.group).to_dict()}
        return cached
