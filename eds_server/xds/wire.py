"""DiscoveryResponse bytes assembled from cached pieces.

A protobuf message is a concatenation of its fields, so a response is the bytes of its version,
its (cached) `Any`-wrapped resources, its type URL and its nonce, laid end to end. Building it this
way costs a few concatenations instead of a betterproto2 encode of every endpoint per subscriber.
Tests check the result against the official generated code.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from ..store import Resource
from .common import EDS_TYPE_URL

CONTROL_PLANE_ID = "eds-server"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); ValueError on a truncated or overlong varint."""
    result = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ValueError("bad varint")


def string_fields(message: bytes, wanted: set[int]) -> dict[int, str]:
    """The top-level string fields `wanted` of an encoded message, skipping everything else.

    Reading a Node's id and cluster this way costs a scan of its field headers, not a parse of
    its (often tens of kilobytes of) extensions and metadata.
    """
    found: dict[int, str] = {}
    pos = 0
    while pos < len(message):
        key, pos = read_varint(message, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = read_varint(message, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            size, pos = read_varint(message, pos)
            if number in wanted:
                found[number] = message[pos : pos + size].decode("utf-8", errors="replace")
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if pos > len(message):
            raise ValueError("truncated message")
    return found


def length_delimited(field_number: int, data: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(data)) + data


def string_field(field_number: int, value: str) -> bytes:
    return length_delimited(field_number, value.encode()) if value else b""


_ANY_TYPE_URL = string_field(1, EDS_TYPE_URL)
_TYPE_URL = string_field(4, EDS_TYPE_URL)  # type_url (4) of both response kinds
_CONTROL_PLANE = string_field(1, CONTROL_PLANE_ID)  # ControlPlane{identifier (1)}
_SOTW_TAIL = _TYPE_URL + length_delimited(6, _CONTROL_PLANE)
_DELTA_TAIL = _TYPE_URL + length_delimited(7, _CONTROL_PLANE)

# resource -> its encoded field in each kind of response. Weak keys: the bytes live exactly as
# long as the store holds that version, and are built once however many streams send them.
_sotw_fields: weakref.WeakKeyDictionary[Resource, bytes] = weakref.WeakKeyDictionary()
_delta_fields: weakref.WeakKeyDictionary[Resource, bytes] = weakref.WeakKeyDictionary()


def _any(resource: Resource) -> bytes:
    return _ANY_TYPE_URL + length_delimited(2, resource.body)


def any_field(resource: Resource) -> bytes:
    """DiscoveryResponse.resources (2): Any{type_url, value = CLA}."""
    cached = _sotw_fields.get(resource)
    if cached is None:
        cached = _sotw_fields[resource] = length_delimited(2, _any(resource))
    return cached


def delta_resource_field(resource: Resource) -> bytes:
    """DeltaDiscoveryResponse.resources (2): Resource{version (1), resource (2), name (3)}."""
    cached = _delta_fields.get(resource)
    if cached is None:
        inner = string_field(1, resource.version) + length_delimited(2, _any(resource))
        cached = _delta_fields[resource] = length_delimited(2, inner + string_field(3, resource.name))
    return cached


def discovery_response(version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DiscoveryResponse."""
    parts = [string_field(1, version_info)]
    parts.extend(any_field(r) for r in resources)
    parts.append(_SOTW_TAIL)
    parts.append(string_field(5, nonce))
    return b"".join(parts)


def delta_discovery_response(system_version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DeltaDiscoveryResponse."""
    parts = [string_field(1, system_version_info)]
    parts.extend(delta_resource_field(r) for r in resources)
    parts.append(_DELTA_TAIL)
    parts.append(string_field(5, nonce))
    return b"".join(parts)
