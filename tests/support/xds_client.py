"""A scripted xDS client for tests that need a client to reject something."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import h2.exceptions
from grpclib.client import Channel
from grpclib.const import Cardinality

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.google.rpc import Status as RpcStatus
from eds_server.xds.common import EDS_TYPE_URL


@contextlib.asynccontextmanager
async def nacking_client(port: int, name: str, node_id: str, message: str) -> AsyncIterator[None]:
    """A scripted xDS client that subscribes to `name`, NACKs what it gets and stays connected.
    (eds-server now refuses every group we know Envoy would reject, so a real Envoy NACKs nothing.)"""
    channel = Channel("127.0.0.1", port)
    path = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
    try:
        async with channel.request(path, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse) as stream:
            await stream.send_message(
                DiscoveryRequest(
                    node=Node(id=node_id, cluster="scripted"), resource_names=[name], type_url=EDS_TYPE_URL
                )
            )
            response = await asyncio.wait_for(stream.recv_message(), 10)
            assert response is not None
            await stream.send_message(
                DiscoveryRequest(
                    version_info="",
                    resource_names=[name],
                    response_nonce=response.nonce,
                    type_url=EDS_TYPE_URL,
                    error_detail=RpcStatus(code=3, message=message),
                )
            )
            try:
                yield
            finally:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    await stream.cancel()
    finally:
        channel.close()
