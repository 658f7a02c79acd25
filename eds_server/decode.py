"""Encoded ClusterLoadAssignment bytes -> a Group: what a relay shows of what its upstream sent.

A relay serves its upstream's bytes unchanged (and so its versions); it decodes them only to know
the endpoints for its admin pages and metrics. The decoder reads the wire format directly with
protowire, as encode.py writes it: betterproto2's parse of a 1,000-endpoint assignment costs
several times more, once per change in every relay and worker.
"""

from __future__ import annotations

from typing import Any

from .encode import LB_METADATA_KEY
from .model import Endpoint, Group, Health, Locality, locality
from .protowire import FieldValue, fields, text

_HEALTH = {int(h): h for h in Health}


class DecodeError(ValueError):
    """The bytes are not a ClusterLoadAssignment eds-server can serve (named in the message)."""


def _message(value: FieldValue, what: str) -> memoryview:
    if isinstance(value, int):
        raise DecodeError(f"{what}: expected a message, found a varint")
    return value


def _uint32(value: FieldValue) -> int:
    """A google.protobuf.UInt32Value's value (0 when absent in it)."""
    out = 0
    for number, v in fields(_message(value, "UInt32Value")):
        if number == 1 and isinstance(v, int):
            out = v
    return out


def _locality(value: FieldValue) -> Locality:
    parts = ["", "", ""]
    for number, v in fields(_message(value, "locality")):
        if 1 <= number <= 3:
            parts[number - 1] = text(v)
    return locality(*parts)


def _metadata(value: FieldValue) -> dict[str, Any]:
    from .pb.envoy.config.core.v3 import Metadata

    found = Metadata.parse(bytes(_message(value, "metadata"))).filter_metadata.get(LB_METADATA_KEY)
    return found.to_dict() if found is not None else {}


def _socket_address(endpoint: memoryview) -> tuple[str, int, str]:
    address, port, hostname = "", 0, ""
    for number, v in fields(endpoint):
        if number == 1:  # Address
            for n2, sock in fields(_message(v, "address")):
                if n2 != 1:
                    raise DecodeError("endpoint address: only socket addresses are served")
                for n3, v3 in fields(_message(sock, "socket_address")):
                    if n3 == 2:
                        address = text(v3)
                    elif n3 == 3 and isinstance(v3, int):
                        port = v3
        elif number == 3:
            hostname = text(v)
    return address, port, hostname


def _lb_endpoint(raw: memoryview, priority: int, loc: Locality) -> Endpoint:
    address, port, hostname = "", 0, ""
    health, weight, metadata = Health.UNKNOWN, None, {}
    for number, v in fields(raw):
        if number == 1:
            address, port, hostname = _socket_address(_message(v, "endpoint"))
        elif number == 2 and isinstance(v, int):
            health = _HEALTH.get(v, Health.UNKNOWN)
        elif number == 3:
            metadata = _metadata(v)
        elif number == 4:
            weight = _uint32(v)
    if not address:
        raise DecodeError("an endpoint without an address")
    return Endpoint(address, port, weight, health, priority, loc, hostname, metadata)


def decode_group(body: bytes) -> Group:
    """The Group whose encoding is `body`; DecodeError if it is not a ClusterLoadAssignment."""
    try:
        name = ""
        endpoints: list[Endpoint] = []
        weights: dict[Locality, int] = {}
        for number, value in fields(body):
            if number == 1:
                name = text(value)
            elif number == 2:
                raw_endpoints: list[memoryview] = []
                loc, priority, weight = locality(), 0, None
                for n2, v2 in fields(_message(value, "endpoints")):
                    if n2 == 1:
                        loc = _locality(v2)
                    elif n2 == 2:
                        raw_endpoints.append(_message(v2, "lb_endpoints"))
                    elif n2 == 3:
                        weight = _uint32(v2)
                    elif n2 == 5 and isinstance(v2, int):
                        priority = v2
                if weight is not None:
                    weights[loc] = weight
                endpoints.extend(_lb_endpoint(raw, priority, loc) for raw in raw_endpoints)
    except DecodeError:
        raise
    except ValueError as e:  # malformed protobuf, or a string that is not UTF-8
        raise DecodeError(f"cannot parse ClusterLoadAssignment: {e}") from None
    return Group(name, tuple(endpoints), weights)
