"""DiscoveryResponse bytes assembled from cached pieces.

A protobuf message is a concatenation of its fields, so a response is the bytes of its version,
its (cached) `Any`-wrapped resources, its type URL and its nonce, laid end to end. Building it this
way costs a few concatenations instead of a betterproto2 encode of every endpoint per subscriber.
Tests check the result against the official generated code.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

from ..protowire import length_delimited, string_field
from ..store import Resource
from .common import EDS_TYPE_URL

CONTROL_PLANE_ID = "eds-server"


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


def _response(version: str, resource_fields: Iterable[bytes], tail: bytes, nonce: str) -> bytes:
    return b"".join([string_field(1, version), *resource_fields, tail, string_field(5, nonce)])


def discovery_response(version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DiscoveryResponse."""
    return _response(version_info, map(any_field, resources), _SOTW_TAIL, nonce)


def delta_discovery_response(system_version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DeltaDiscoveryResponse."""
    return _response(system_version_info, map(delta_resource_field, resources), _DELTA_TAIL, nonce)
