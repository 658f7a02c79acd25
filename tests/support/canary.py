"""A well-behaved Envoy-like client that measures what an attack costs everyone else.

While it runs, the canary changes its group a few times a second, through the registration API
or the upstreams file (the endpoint's port carries a sequence number), keeps one StreamEndpoints
stream open and ACKs what it gets, and keeps opening fresh connections that fetch once. It reports
how many changes reached it, how late, and how fresh connections fared. Loopback only; every loop
is bounded by its duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from envoy.config.endpoint.v3 import endpoint_pb2
from grpclib.client import Channel
from grpclib.const import Cardinality

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.envoy.service.endpoint.v3 import EndpointDiscoveryServiceStub
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.server_process import write_atomically

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
GROUP = "canary"
BASE_PORT = 20000


def upstreams_text(seq: int) -> str:
    return f"groups:\n  {GROUP}:\n    endpoints: [127.0.0.1:{BASE_PORT + seq % 40000}]\n"


TOKEN = "hostile-test-token-0123456789"  # the admin token of the servers under attack
DELAY_BOUND_S = 0.5  # the canary's median delay: ~3 ms here without an attack, at most ~16 ms with one


def pin(pid: int, cpu: int) -> None:
    """Server on one core, attacker on another (as the attacks were first measured), where there are two."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(pid, {cpus[cpu]})


@dataclass
class CanaryReport:
    seconds: float = 0.0
    changes: int = 0  # changes written
    updates: int = 0  # changes delivered on the long-lived stream (by their state, or a later one)
    delays: list[float] = field(default_factory=list)  # seconds from write to receipt
    stream_breaks: int = 0
    fresh_ok: int = 0
    fresh_failed: int = 0
    fresh_latencies: list[float] = field(default_factory=list)

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds if self.seconds else 0.0

    def delay(self, q: float) -> float:
        if not self.delays:
            return float("inf")
        return (
            statistics.quantiles(self.delays, n=100, method="inclusive")[int(q * 100) - 1]
            if len(self.delays) > 1
            else self.delays[0]
        )

    def fresh(self, q: float) -> float:
        if not self.fresh_latencies:
            return float("inf")
        ordered = sorted(self.fresh_latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        return {
            "updates_per_s": round(self.updates_per_s, 2),
            "changes": self.changes,
            "updates": self.updates,
            "delay_p50_ms": round(self.delay(0.5) * 1000, 1),
            "delay_p99_ms": round(self.delay(0.99) * 1000, 1),
            "fresh_ok": self.fresh_ok,
            "fresh_failed": self.fresh_failed,
            "fresh_p50_ms": round(self.fresh(0.5) * 1000, 1),
            "stream_breaks": self.stream_breaks,
        }


class Canary:
    def __init__(
        self,
        port: int,
        upstreams: Path,
        *,
        interval: float = 0.25,
        admin_port: int | None = None,
        token: str | None = None,
    ) -> None:
        """Changes go through the registration API when `admin_port` and `token` are given (the
        server needs --registration-allow-cidr 127.0.0.0/8), else through the upstreams file."""
        self.port = port
        self.upstreams = upstreams
        self.interval = interval
        self.admin_port = admin_port
        self.token = token
        self.seq = 0
        self.written: dict[int, float] = {}

    async def run(self, seconds: float) -> CanaryReport:
        report = CanaryReport()
        start = time.monotonic()
        deadline = start + seconds
        tasks = [
            asyncio.create_task(self._write(report, deadline)),
            asyncio.create_task(self._follow(report, deadline)),
            asyncio.create_task(self._fresh(report, deadline)),
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), seconds + 15)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        report.seconds = time.monotonic() - start
        return report

    async def _write(self, report: CanaryReport, deadline: float) -> None:
        await asyncio.sleep(0.3)  # the stream is open first
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline - 1.0:  # the last second is for the last change to arrive
                self.seq += 1
                self.written[self.seq] = time.monotonic()
                if self.admin_port is None:
                    write_atomically(self.upstreams, upstreams_text(self.seq))
                else:
                    url = f"http://127.0.0.1:{self.admin_port}/v1/groups/{GROUP}/endpoints/canary"
                    body = {"address": "127.0.0.1", "port": BASE_PORT + self.seq % 40000}
                    async with session.put(url, json=body, headers={"Authorization": f"Bearer {self.token}"}) as r:
                        assert r.status in (200, 201), await r.text()
                report.changes += 1
                await asyncio.sleep(self.interval)

    async def _follow(self, report: CanaryReport, deadline: float) -> None:
        seen: set[int] = set(self.written)  # earlier runs' changes are not this run's
        while time.monotonic() < deadline:
            channel = Channel("127.0.0.1", self.port)
            try:
                request = channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse)
                async with request as stream:
                    await stream.send_message(
                        DiscoveryRequest(
                            node=Node(id="canary", cluster="canary"), resource_names=[GROUP], type_url=EDS_TYPE_URL
                        )
                    )
                    while time.monotonic() < deadline:
                        left = deadline - time.monotonic()
                        try:
                            resp = await asyncio.wait_for(stream.recv_message(), max(0.01, left))
                        except TimeoutError:
                            break
                        if resp is None:
                            break
                        now = time.monotonic()
                        for res in resp.resources:
                            cla = endpoint_pb2.ClusterLoadAssignment.FromString(res.value)
                            for lle in cla.endpoints:
                                for lb in lle.lb_endpoints:
                                    latest = lb.endpoint.address.socket_address.port_value - BASE_PORT
                                    # a later state delivers the earlier changes too (they may be coalesced)
                                    for seq in [s for s in self.written if s <= latest and s not in seen]:
                                        seen.add(seq)
                                        report.updates += 1
                                        report.delays.append(now - self.written[seq])
                        await stream.send_message(
                            DiscoveryRequest(
                                version_info=resp.version_info,
                                resource_names=[GROUP],
                                response_nonce=resp.nonce,
                                type_url=EDS_TYPE_URL,
                            )
                        )
                    with contextlib.suppress(Exception):
                        await stream.cancel()
            except Exception:
                report.stream_breaks += 1
                await asyncio.sleep(0.2)
            finally:
                channel.close()

    async def _fresh(self, report: CanaryReport, deadline: float) -> None:
        while time.monotonic() < deadline - 0.5:
            t0 = time.monotonic()
            channel = Channel("127.0.0.1", self.port)
            try:
                stub = EndpointDiscoveryServiceStub(channel)
                await asyncio.wait_for(
                    stub.fetch_endpoints(
                        DiscoveryRequest(node=Node(id="canary-fresh"), resource_names=[GROUP], type_url=EDS_TYPE_URL)
                    ),
                    5,
                )
                report.fresh_ok += 1
                report.fresh_latencies.append(time.monotonic() - t0)
            except Exception:
                report.fresh_failed += 1
            finally:
                channel.close()
            await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def assert_canary_fine(r: CanaryReport, what: str) -> None:
    """The well-behaved client barely noticed: its changes arrived, soon, and new connections were served."""
    assert r.changes >= 3, (what, r.summary())
    assert r.updates >= 0.5 * r.changes, (what, r.summary())
    assert r.delay(0.5) < DELAY_BOUND_S, (what, r.summary())
    assert r.fresh_ok >= 3 and r.fresh_failed <= 1, (what, r.summary())
