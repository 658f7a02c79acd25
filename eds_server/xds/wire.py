"""DiscoveryResponse bytes assembled from cached pieces.

A protobuf message is a concatenation of its fields, so a response is the bytes of its version,
its (cached) `Any`-wrapped resources, its type URL and its nonce, laid end to end. Building it this
way costs a few concatenations instead of a betterproto2 encode of every endpoint per subscriber.
Tests check the result against the official generated code.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence

from ..encoded import Resource
from ..protowire import FieldValue, fields, length_delimited, string_field, text
from .common import EDS_TYPE_URL, ProtocolError
from .delta import DeltaRequest
from .sotw import Request

CONTROL_PLANE_ID = "eds-server"


_ANY_TYPE_URL = string_field(1, EDS_TYPE_URL)
_TYPE_URL = string_field(4, EDS_TYPE_URL)  # type_url (4) of both response kinds
_CONTROL_PLANE = string_field(1, CONTROL_PLANE_ID)  # ControlPlane{identifier (1)}
_SOTW_TAIL = _TYPE_URL + length_delimited(6, _CONTROL_PLANE)
_DELTA_TAIL = _TYPE_URL + length_delimited(7, _CONTROL_PLANE)


def _any(resource: Resource) -> bytes:
    return _ANY_TYPE_URL + length_delimited(2, resource.body)


def any_field(resource: Resource) -> bytes:
    """DiscoveryResponse.resources (2): Any{type_url, value = CLA}."""
    return length_delimited(2, _any(resource))


def delta_resource_field(resource: Resource) -> bytes:
    """DeltaDiscoveryResponse.resources (2): Resource{version (1), resource (2), name (3)}."""
    inner = string_field(1, resource.version) + length_delimited(2, _any(resource))
    return length_delimited(2, inner + string_field(3, resource.name))


def _response(version: str, resource_fields: Iterable[bytes], tail: bytes, nonce: str) -> bytes:
    return b"".join([string_field(1, version), *resource_fields, tail, string_field(5, nonce)])


def discovery_response(version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DiscoveryResponse (uncached: see Responses)."""
    return _response(version_info, map(any_field, resources), _SOTW_TAIL, nonce)


def delta_discovery_response(system_version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
    """An encoded envoy.service.discovery.v3.DeltaDiscoveryResponse (uncached: see Responses)."""
    return _response(system_version_info, map(delta_resource_field, resources), _DELTA_TAIL, nonce)


class Responses:
    """The same responses from each resource's field, built once however many streams send it.
    One per server (encode.Encoders holds it), not per process."""

    __slots__ = ("_delta", "_sotw")

    def __init__(self) -> None:
        # resource -> its encoded field in each kind of response. Weak keys: the bytes live exactly
        # as long as the store holds that version.
        self._sotw: weakref.WeakKeyDictionary[Resource, bytes] = weakref.WeakKeyDictionary()
        self._delta: weakref.WeakKeyDictionary[Resource, bytes] = weakref.WeakKeyDictionary()

    def any_field(self, resource: Resource) -> bytes:
        cached = self._sotw.get(resource)
        if cached is None:
            cached = self._sotw[resource] = any_field(resource)
        return cached

    def delta_resource_field(self, resource: Resource) -> bytes:
        cached = self._delta.get(resource)
        if cached is None:
            cached = self._delta[resource] = delta_resource_field(resource)
        return cached

    def discovery_response(self, version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
        return _response(version_info, map(self.any_field, resources), _SOTW_TAIL, nonce)

    def delta_discovery_response(self, system_version_info: str, resources: Sequence[Resource], nonce: str) -> bytes:
        return _response(system_version_info, map(self.delta_resource_field, resources), _DELTA_TAIL, nonce)


_plain_ack: tuple[str, str, str, bytes] = ("", "", "", b"")


def plain_ack(version_info: str, name: str, nonce: str) -> bytes:
    """The bytes of the request Envoy ACKs a one-resource response with when its Node went only
    with the first request: version_info, the one name, the type URL and the nonce, in field order
    (as every protobuf serializer writes them). Every stream answering one change ACKs the same
    response, so the last one built is kept (a pure function's one-entry memo)."""
    global _plain_ack
    last = _plain_ack
    if last[2] == nonce and last[0] == version_info and last[1] == name:
        return last[3]
    data = b"".join([string_field(1, version_info), string_field(3, name), _TYPE_URL, string_field(5, nonce)])
    _plain_ack = (version_info, name, nonce, data)
    return data


# -- requests ---------------------------------------------------------------------------------------
# Envoy sends its whole Node (tens of kilobytes) in every request unless told otherwise, ACKs
# included. These read a request's few small fields and leave the Node as a view into the buffer.


def _error_message(value: FieldValue) -> str:
    """google.rpc.Status.message (field 2) of an error_detail."""
    if isinstance(value, int):
        raise ValueError("error_detail is not a message")
    return next((text(v) for n, v in fields(value) if n == 2), "")


def _too_many(what: str, limit: int) -> ProtocolError:
    return ProtocolError("RESOURCE_EXHAUSTED", f"more than {limit} {what} in one request (limit {limit})")


def sotw_request(data: bytes | memoryview, max_names: int = sys.maxsize) -> tuple[Request, memoryview | None]:
    """A DiscoveryRequest, and its encoded Node if it carries one.

    Past `max_names` names, parsing stops at once: a 4 MiB request of tiny names would otherwise cost
    a second of CPU before the limit refused it."""
    return _sotw_plain(data, max_names) or _sotw_request(data, max_names)


def _sotw_plain(data: bytes | memoryview, max_names: int) -> tuple[Request, memoryview | None] | None:
    """The request every ACK is, read in one tight loop: only string and Node fields with one-byte
    keys, well formed, no error_detail, within `max_names`. None for anything else, which the
    general parse reads (or refuses) the same as ever. A third of the cost of an ACK's parse."""
    version = type_url = nonce = ""
    names: list[str] = []
    node: memoryview | None = None
    pos, end = 0, len(data)
    while pos < end:
        key = data[pos]
        if key & 0x87 != 2 or pos + 1 >= end:  # not length-delimited, a longer key, or truncated
            return None
        size = data[pos + 1]
        pos += 2
        if size & 0x80:
            size &= 0x7F
            shift = 7
            while True:
                if pos >= end or shift > 28:
                    return None
                byte = data[pos]
                pos += 1
                size |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
                shift += 7
        stop = pos + size
        if stop > end:
            return None
        number = key >> 3
        if number == 3:
            if len(names) >= max_names:
                return None
            names.append(str(data[pos:stop], "utf-8"))
        elif number == 1:
            version = str(data[pos:stop], "utf-8")
        elif number == 2:
            node = memoryview(data)[pos:stop]
        elif number == 4:
            type_url = str(data[pos:stop], "utf-8")
        elif number == 5:
            nonce = str(data[pos:stop], "utf-8")
        elif number == 6:
            return None
        pos = stop
    return Request(version, node is not None, tuple(names), type_url, nonce, None), node


def _sotw_request(data: bytes | memoryview, max_names: int) -> tuple[Request, memoryview | None]:
    version = type_url = nonce = ""
    names: list[str] = []
    node: memoryview | None = None
    error: str | None = None
    for number, value in fields(data):
        if number == 3:
            if len(names) >= max_names:
                raise _too_many("resource names", max_names)
            names.append(text(value))
        elif number == 1:
            version = text(value)
        elif number == 2 and not isinstance(value, int):
            node = value
        elif number == 4:
            type_url = text(value)
        elif number == 5:
            nonce = text(value)
        elif number == 6:
            error = _error_message(value)
    # A present but empty Node (`node {}`) is still a node: test presence, not truthiness.
    request = Request(version, node is not None, tuple(names), type_url, nonce, error)
    return request, node


def delta_request(data: bytes | memoryview, max_names: int = sys.maxsize) -> tuple[DeltaRequest, memoryview | None]:
    """A DeltaDiscoveryRequest, and its encoded Node if it carries one; each list of names (subscribe,
    unsubscribe, initial versions) is refused past `max_names` without reading the rest."""
    type_url = nonce = ""
    subscribe: list[str] = []
    unsubscribe: list[str] = []
    initial: dict[str, str] = {}
    node: memoryview | None = None
    error: str | None = None
    for number, value in fields(data):
        if number == 3:
            if len(subscribe) >= max_names:
                raise _too_many("names to subscribe", max_names)
            subscribe.append(text(value))
        elif number == 4:
            if len(unsubscribe) >= max_names:
                raise _too_many("names to unsubscribe", max_names)
            unsubscribe.append(text(value))
        elif number == 1 and not isinstance(value, int):
            node = value
        elif number == 2:
            type_url = text(value)
        elif number == 5:
            if isinstance(value, int):
                raise ValueError("initial_resource_versions entry is not a message")
            if len(initial) >= max_names:
                raise _too_many("initial resource versions", max_names)
            entry = {n: text(v) for n, v in fields(value)}
            initial[entry.get(1, "")] = entry.get(2, "")
        elif number == 6:
            nonce = text(value)
        elif number == 7:
            error = _error_message(value)
    request = DeltaRequest(node is not None, type_url, tuple(subscribe), tuple(unsubscribe), initial, nonce, error)
    return request, node
