"""Calls started past grpclib's reading of their headers (transport/h2/handlers.py's PlainCall):
which headers qualify (pure), and, over real loopback sockets, that a plain call and one grpclib
starts itself (a deadline asked) are served alike, each with what its headers say."""

from __future__ import annotations

from typing import Any

import pytest
from hyperframe.frame import HeadersFrame

from eds_server.transport.h2 import ConnectionLimits
from eds_server.transport.h2.handlers import PlainCall
from tests.support.grpc_harness import serving
from tests.support.h2_client import client_of, data, first_request, grpc
from tests.support.hostile_clients import STREAM, headers

pytestmark = pytest.mark.fast_path

TABLE = {STREAM: "the method"}
PLAIN = (*headers(STREAM), ("x-envoy-internal", "true"), ("user-agent", "envoy"))


def test_an_envoys_call_is_plain_and_says_what_its_headers_do() -> None:
    call = PlainCall.of(PLAIN, TABLE, "proto")
    assert call is not None
    assert (call.path, call.method, call.content_type, call.user_agent) == (
        STREAM,
        "the method",
        "application/grpc",
        "envoy",
    )
    assert list(call.metadata.items()) == [("x-envoy-internal", "true")]  # what grpclib's metadata would be
    assert PlainCall.of((*headers(STREAM), ("content-type", "application/grpc+proto")), TABLE, "proto") is not None


def swap(name: str, value: str | None) -> tuple[tuple[str, str], ...]:
    """PLAIN with `name` set to `value` (None: without it)."""
    kept = tuple((n, v) for n, v in PLAIN if n != name)
    return kept if value is None else (*kept, (name, value))


@pytest.mark.parametrize(
    "fields",
    [
        swap(":method", "GET"),
        swap("content-type", None),
        swap("content-type", "application/json"),
        swap("content-type", "application/grpc+json"),
        swap("te", None),
        swap("te", "gzip"),
        swap(":path", "/unknown.Service/Method"),
        swap(":path", None),
        swap("grpc-timeout", "10S"),
    ],
)
def test_anything_grpclib_would_answer_otherwise_or_time_is_left_to_grpclib(fields: Any) -> None:
    assert PlainCall.of(fields, TABLE, "proto") is None


async def test_a_plain_call_and_a_call_with_a_deadline_are_served_alike() -> None:
    """Two streams on one connection: one as Envoy opens it, one asking a deadline (grpclib's own
    request_handler starts it). Both are answered; each grpclib Stream holds what its headers said."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        for node in ("plain", "plain-too"):
            await client.response(await client.request(first_request(node, "web")), 1)
        conn = client.conn
        timed = conn.next_id
        conn.next_id += 2
        block = conn.encoder.encode([*headers(STREAM), ("grpc-timeout", "30S"), ("x-tag", "t")])
        client.windows[timed], client.messages[timed] = client.initial_window, []
        await client.send(HeadersFrame(timed, data=block, flags=["END_HEADERS"]).serialize())
        await client.send(data(timed, grpc(first_request("timed", "web"))))
        await client.response(timed, 1)
        streams = {s.node: s.stream for s in service.sessions}
        assert streams["plain"].deadline is None and streams["timed"].deadline is not None
        assert streams["timed"].metadata is not None and streams["timed"].metadata.get("x-tag") == "t"
        assert streams["plain"].metadata is not None and "x-tag" not in streams["plain"].metadata
        assert streams["plain"].metadata is not streams["plain-too"].metadata  # each call its own
