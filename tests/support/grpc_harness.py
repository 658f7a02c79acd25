"""The gRPC service in-process on a loopback port, and a grpclib client speaking the wire protocol
like Envoy: the `harness` fixture (tests/conftest.py) and the requests tests send through it."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import h2.exceptions
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from grpclib.client import Channel
from grpclib.const import Cardinality

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.google.rpc import Status as RpcStatus
from eds_server.store import Store
from eds_server.transport.grpc import EdsService, make_server
from eds_server.transport.h2 import ConnectionLimits
from eds_server.transport.h2.fast_server import Server
from eds_server.xds.common import EDS_TYPE_URL

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
SOURCE = "test"


def group(name: str, *ports: int) -> Group:
    return Group(name, tuple(Endpoint("127.0.0.1", p) for p in ports))


async def fetch_web(port: int, host: str = "127.0.0.1") -> DiscoveryResponse:
    """One well-behaved client's answer for "web" on its own connection: the server still serves."""
    channel = Channel(host, port)
    try:
        async with channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse) as s:
            await s.send_message(DiscoveryRequest(node=Node(id="n"), resource_names=["web"], type_url=EDS_TYPE_URL))
            msg = await asyncio.wait_for(s.recv_message(), 5)
            await s.cancel()
            assert msg is not None
            return msg
    finally:
        channel.close()


class Harness:
    def __init__(self, store: Store, service: EdsService, channel: Channel, server: Any) -> None:
        self.store, self.service, self.channel, self.server = store, service, channel, server

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[Any]:
        """A StreamEndpoints stream, reset on exit as Envoy does when it goes away."""
        request = self.channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse)
        async with request as stream:
            try:
                yield stream
            finally:
                with contextlib.suppress(h2.exceptions.StreamClosedError):  # the server ended it first
                    await stream.cancel()


@contextlib.asynccontextmanager
async def grpc_harness() -> AsyncIterator[Harness]:
    """The `harness` fixture: high enough limits that a test may open thousands of streams."""
    store = Store(encode_group)
    store.add_source(SOURCE)
    service = EdsService(store, send_timeout=1)
    server = make_server(
        service,
        max_streams_per_connection=1000,
        keepalive_time=30,
        keepalive_timeout=10,
        max_message_size=1 << 20,
        limits=ConnectionLimits(stream_budget=100_000),  # tests open thousands
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    port = server.port
    channel = Channel("127.0.0.1", port)
    try:
        yield Harness(store, service, channel, server)
    finally:
        channel.close()
        service.stop()
        server.close()
        await server.wait_closed()


def first(*names: str, version: str = "") -> DiscoveryRequest:
    return DiscoveryRequest(
        node=Node(id="test-node", cluster="test"),
        resource_names=list(names),
        type_url=EDS_TYPE_URL,
        version_info=version,
    )


def reply(resp: DiscoveryResponse, *names: str, error: str | None = None) -> DiscoveryRequest:
    return DiscoveryRequest(
        version_info=resp.version_info,
        resource_names=list(names),
        response_nonce=resp.nonce,
        type_url=EDS_TYPE_URL,
        error_detail=RpcStatus(code=3, message=error) if error else None,
    )


async def recv(stream: Any, timeout: float = 5.0) -> DiscoveryResponse:
    msg = await asyncio.wait_for(stream.recv_message(), timeout)
    assert msg is not None
    return msg  # type: ignore[no-any-return]


async def no_message(stream: Any, wait: float = 0.3) -> None:
    """Nothing arrives within `wait` (a count of messages, not a speed claim)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stream.recv_message(), wait)


def cla_of(resp: DiscoveryResponse, i: int = 0) -> endpoint_pb2.ClusterLoadAssignment:
    assert resp.resources[i].type_url == EDS_TYPE_URL
    return endpoint_pb2.ClusterLoadAssignment.FromString(resp.resources[i].value)


@contextlib.asynccontextmanager
async def serving(limits: ConnectionLimits, **kwargs: object) -> AsyncIterator[tuple[Server, EdsService, int]]:
    """A server with `limits` and its settings as `kwargs`; "web" in the store from the start."""
    store = Store(encode_group)
    store.add_source("test")
    store.update("test", {"web": Group("web", (Endpoint("127.0.0.1", 1),))})
    service = EdsService(store)
    settings: dict[str, Any] = {
        "max_streams_per_connection": 100,
        "keepalive_time": 30,
        "keepalive_timeout": 10,
        "max_message_size": 1 << 20,
        "limits": limits,
        "http2": os.environ.get("EDS_HTTP2", "auto"),
        **kwargs,
    }
    server = make_server(service, **settings)
    await server.start("127.0.0.1", 0)
    port = server.port
    try:
        yield server, service, port
    finally:
        service.stop()
        server.close()
        await server.wait_closed()
