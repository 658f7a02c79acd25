"""Groups -> encoded ClusterLoadAssignment bytes: the only place that builds CLAs.

The output is canonical (localities and endpoints sorted), so the same content always encodes to
the same bytes and therefore the same version, whatever order sources listed it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby
from typing import Any

from .model import Endpoint, Group, Locality
from .pb.envoy.config.core.v3 import Address, HealthStatus, Metadata, SocketAddress
from .pb.envoy.config.core.v3 import Locality as PbLocality
from .pb.envoy.config.endpoint.v3 import ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints
from .pb.envoy.config.endpoint.v3 import Endpoint as PbEndpoint
from .pb.google.protobuf import Struct

LB_METADATA_KEY = "envoy.lb"


def _bucket(ep: Endpoint) -> tuple[int, Locality]:
    return (ep.priority, ep.locality)


def _sorted(value: Any) -> Any:
    """Map keys in a fixed order: equal metadata must encode to equal bytes (and versions)."""
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def lb_endpoint(ep: Endpoint) -> LbEndpoint:
    return LbEndpoint(
        endpoint=PbEndpoint(
            address=Address(socket_address=SocketAddress(address=ep.address, port_value=ep.port)),
            hostname=ep.hostname,
        ),
        health_status=HealthStatus(int(ep.health)),
        metadata=(
            Metadata(filter_metadata={LB_METADATA_KEY: Struct.from_dict(_sorted(ep.metadata))})
            if ep.metadata
            else None
        ),
        load_balancing_weight=ep.weight,
    )


def cluster_load_assignment(group: Group) -> ClusterLoadAssignment:
    ordered = sorted(group.endpoints, key=lambda e: (_bucket(e), e.address, e.port))
    localities = []
    for (priority, loc), eps in groupby(ordered, key=_bucket):
        localities.append(
            LocalityLbEndpoints(
                locality=PbLocality(region=loc.region, zone=loc.zone, sub_zone=loc.subzone),
                lb_endpoints=[lb_endpoint(e) for e in eps],
                load_balancing_weight=group.locality_weights.get(loc),
                priority=priority,
            )
        )
    return ClusterLoadAssignment(cluster_name=group.name, endpoints=localities)


def encode_group(group: Group) -> bytes:
    return bytes(cluster_load_assignment(group))
