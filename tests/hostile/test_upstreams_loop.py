"""A real server process while its upstreams file is big or hostile: the event loop keeps answering.

Before the file's input bounds, an alias bomb, a FIFO and a symlink to /dev/zero each froze the loop
(or filled memory), and a valid 20,000-endpoint file stalled it for seconds. A canary (a gRPC health client on
the xDS port plus an EDS stream) runs meanwhile; what is asserted are counts and memory, never times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h2.exceptions
from grpclib.client import Channel
from grpclib.const import Cardinality

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.grpc.health.v1 import HealthCheckRequest, HealthStub
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.canary import rss_mb
from tests.support.server_process import EdsServerProcess, wait_error, write_atomically
from tests.support.upstreams_files import BOMB

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"


def upstreams_text(canary_port: int, big: int = 1) -> str:
    lines = ["groups:", "  canary:", f"    endpoints: [127.0.0.1:{canary_port}]", "  big:", "    endpoints:"]
    lines += [f"      - 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8080" for i in range(big)]
    return "\n".join(lines) + "\n"


class Canary:
    """An Envoy-like EDS stream following some groups, ACKing every response."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.versions: list[str] = []
        self.changed = asyncio.Event()

    async def run(self, names: list[str]) -> None:
        await self.stream.send_message(
            DiscoveryRequest(
                node=Node(id="canary", cluster="canary"),
                resource_names=names,
                type_url=EDS_TYPE_URL,
            )
        )
        while (resp := await self.stream.recv_message()) is not None:
            self.versions.append(resp.version_info)
            self.changed.set()
            await self.stream.send_message(
                DiscoveryRequest(
                    version_info=resp.version_info,
                    resource_names=names,
                    response_nonce=resp.nonce,
                    type_url=EDS_TYPE_URL,
                )
            )

    async def next_version(self, timeout: float = 30) -> str:
        """Wait for a version other than the current one (bounded)."""
        seen = len(self.versions)
        for _ in range(int(timeout / 0.02)):
            if len(self.versions) > seen:
                return self.versions[-1]
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 0.02)
        raise AssertionError("the canary got no update")


@contextlib.asynccontextmanager
async def canary(server: EdsServerProcess, names: list[str]) -> AsyncIterator[tuple[Canary, HealthStub]]:
    channel = Channel("127.0.0.1", server.port)
    request = channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse)
    try:
        async with request as stream:
            c = Canary(stream)
            task = asyncio.create_task(c.run(names))
            try:
                await c.next_version()
                yield c, HealthStub(channel)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, h2.exceptions.StreamClosedError):
                    await task
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    await stream.cancel()
    finally:
        channel.close()


async def test_hostile_files_are_refused_while_the_canary_keeps_getting_updates(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams_text(1))
    async with EdsServerProcess(path) as server, canary(server, ["canary"]) as (c, health):
        assert server.proc is not None
        hostile = {
            "alias bomb": lambda: write_atomically(path, BOMB),
            "FIFO": lambda: (os.mkfifo(tmp_path / "fifo"), os.replace(tmp_path / "fifo", path)),
            "/dev/zero": lambda: (os.symlink("/dev/zero", tmp_path / "zero"), os.replace(tmp_path / "zero", path)),
        }
        expected = {
            "alias bomb": "anchors and aliases are not allowed",
            "FIFO": "not a regular file",
            "/dev/zero": "not a regular file",
        }
        for port, (what, make) in enumerate(hostile.items(), start=2):
            make()
            await wait_error(server, expected[what], timeout=20)
            await health.check(HealthCheckRequest())  # the gRPC port answers too
            os.unlink(path)
            write_atomically(path, upstreams_text(port))  # and the next good version is served
            await c.next_version()
        assert rss_mb(server.proc.pid) < 300, "reading /dev/zero took 3.2 GB before it was refused"


async def test_a_big_file_is_parsed_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams_text(1))
    async with EdsServerProcess(path) as server, canary(server, ["big"]) as (c, health):
        write_atomically(path, upstreams_text(1, big=50_000))
        # Count the canary's health checks answered between the server starting to parse (its debug
        # log says so, just before handing the parse to a thread) and the new version's arrival.
        # With the parse on the event loop nothing is answered in between, however long it takes.
        answered, parsing = 0, False
        for _ in range(20_000):  # bounded: each round is one health check round trip
            if c.versions[-1] != c.versions[0]:
                break
            parsing = parsing or "parsing " in server.log_text()
            await asyncio.wait_for(health.check(HealthCheckRequest()), 30)
            answered += parsing
        else:
            raise AssertionError("the big file was never served")
        assert parsing and answered >= 10, answered
        big = await server.admin("/v1/groups/big")
        assert len(big["endpoints"]) == 50_000
