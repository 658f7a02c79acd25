"""A scale-down through the shipped Envoy config loses no request.

Docker stops a container by sending SIGTERM and reports it (`kill`) at the same moment; a backend
that exits on SIGTERM is gone before the update that takes it away reaches Envoy. When four of five
backends go at once, most first attempts and many retries land on hosts that are gone: the shipped
retry policy (back-off) and the clusters' circuit breakers (retries in flight) are what keep every
request answered. Here the backends are real processes killed by SIGTERM, eds-server learns of it
from its upstreams file (the file's debounce makes the window wider than Docker's events do), and a
real Envoy runs envoy.yaml on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.support.envoy_harness import EnvoyProcess, envoy_binary
from tests.support.paths import ROOT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, write_atomically
from tests.support.waiting import wait_for

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover
    pytest.skip("no envoy binary", allow_module_level=True)

pytestmark = pytest.mark.envoy

RATE = 60  # requests per second, as the compose stack was measured at
ROUNDS = 5  # 5 -> 1 scale-downs
NOTICE_DELAY = 0.1  # seconds from the SIGTERMs to eds-server's upstreams changing
MAX_REQUESTS = RATE * 120  # the request loop's bound in count (and the test's deadline in time)


def _vhost(boot: dict[str, Any]) -> dict[str, Any]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vhost: dict[str, Any] = hcm["route_config"]["virtual_hosts"][0]
    return vhost


def _eds_clusters(boot: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in boot["static_resources"]["clusters"] if c.get("type") == "EDS"]


@pytest.mark.parametrize(
    "name", ["envoy.yaml", "envoy-delta.yaml", "envoy-mtls.yaml", "envoy-rest.yaml", "compose-envoy.yaml"]
)
def test_every_shipped_config_has_the_scale_down_settings(name: str) -> None:
    """The configs differ in how Envoy reaches eds-server, not in how it treats a leaving backend:
    the policy tested for real below with envoy.yaml is the one each of them ships."""
    reference = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    boot = yaml.safe_load((ROOT / "envoy" / name).read_text())
    assert _vhost(boot)["retry_policy"] == _vhost(reference)["retry_policy"]
    assert _vhost(boot)["retry_policy"]["retry_back_off"] == {"base_interval": "0.1s", "max_interval": "0.5s"}
    for cluster in _eds_clusters(boot):
        assert cluster["circuit_breakers"] == {"thresholds": [{"priority": "DEFAULT", "max_retries": 1000}]}
    demo = yaml.safe_load((ROOT / "eds_server" / "demo_files" / "envoy.yaml").read_text())
    assert demo == reference


BACKEND = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = sys.argv[2].encode()
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        self.wfile.write(head + body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class BackendProcess:
    """An HTTP backend in its own process, which SIGTERM ends at once (Python's default action), as
    a container whose program does not drain. It writes each response in one piece: a response cut
    after its status line has reached the client cannot be retried by anyone, and is the backend's
    doing, not the proxy's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> BackendProcess:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", BACKEND, str(self.port), self.name)

        def listening() -> bool:
            assert self.proc is not None and self.proc.returncode is None, f"backend {self.name} exited"
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        await wait_for(listening, timeout=30, interval=0.05, what=f"backend {self.name} listening")
        return self

    async def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await self.proc.wait()


def _bootstrap(xds_port: int, access_log: Path, shipped: bool) -> dict[str, Any]:
    """envoy.yaml on free ports, pointed at `xds_port`, with an access log of the response flags
    (UO: retry refused by the circuit breaker; URX: retries exhausted); unless `shipped`, with the
    policy these configs had before: 2 retries, Envoy's default back-off (25 ms) and circuit breaker
    (3 retries in flight)."""
    boot: dict[str, Any] = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    boot["admin"]["address"]["socket_address"]["port_value"] = 0
    listener = boot["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = free_port()
    for cluster in boot["static_resources"]["clusters"]:
        for ep in cluster.get("load_assignment", {}).get("endpoints", []):
            for lb in ep["lb_endpoints"]:
                lb["endpoint"]["address"]["socket_address"]["port_value"] = xds_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(access_log),
                "log_format": {"text_format_source": {"inline_string": "%RESPONSE_CODE% %RESPONSE_FLAGS%\n"}},
            },
        }
    ]
    if not shipped:
        del _vhost(boot)["retry_policy"]["retry_back_off"]
        _vhost(boot)["retry_policy"]["num_retries"] = 2
        for cluster in _eds_clusters(boot):
            del cluster["circuit_breakers"]
    return boot


def _upstreams(backends: list[BackendProcess]) -> str:
    endpoints = ", ".join(f"127.0.0.1:{b.port}" for b in backends)
    return f"groups:\n  web:\n    endpoints: [{endpoints}]\n  api:\n    endpoints: [{endpoints}]\n"


@pytest.mark.parametrize("shipped", [True, False], ids=["as shipped", "as before"])
async def test_repeated_scale_downs_at_60_requests_per_second_fail_no_request(tmp_path: Path, shipped: bool) -> None:
    kept = await BackendProcess("kept").start()
    running: list[BackendProcess] = [kept]
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text(_upstreams(running))
    access_log = tmp_path / "access.log"
    statuses: Counter[int | str] = Counter()
    stop = asyncio.Event()
    try:
        async with (
            EdsServerProcess(upstreams, workdir=tmp_path) as server,
            EnvoyProcess(_bootstrap(server.port, access_log, shipped)) as envoy,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        ):
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hosts: len(hosts) == 1, timeout=30)
            url = f"http://127.0.0.1:{envoy.listener_port}/"

            async def one() -> None:
                try:
                    async with session.get(url) as r:
                        await r.read()
                        statuses[r.status] += 1
                except (aiohttp.ClientError, TimeoutError) as e:
                    statuses[type(e).__name__] += 1

            async def load() -> None:
                """RATE requests a second, each on its own (a slow answer does not slow the rate),
                until told to stop or MAX_REQUESTS are sent."""
                tasks: set[asyncio.Task[None]] = set()
                loop = asyncio.get_running_loop()
                start = loop.time()
                for i in range(MAX_REQUESTS):
                    if stop.is_set():
                        break
                    task = asyncio.create_task(one())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    await asyncio.sleep(max(0.0, start + (i + 1) / RATE - loop.time()))
                await asyncio.gather(*tasks)

            async def until_answered(count: int) -> None:
                await wait_for(lambda: sum(statuses.values()), lambda n: n >= count, timeout=60, what="answers")

            loader = asyncio.create_task(load())
            sent_before = 0
            for round_ in range(ROUNDS):
                leaving = [await BackendProcess(f"r{round_}-{i}").start() for i in range(4)]
                running = [kept, *leaving]
                write_atomically(upstreams, _upstreams(running))
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda hosts: len(hosts) == 5, timeout=30)
                # traffic over all five for a while: RATE requests
                await until_answered(sent_before + RATE)
                # Docker's order: the signal first, the event eds-server acts on right after it
                await asyncio.gather(*(b.terminate() for b in leaving))
                running = [kept]
                await asyncio.sleep(NOTICE_DELAY)  # not a wait for something: the modelled lag itself
                write_atomically(upstreams, _upstreams(running))
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda hosts: len(hosts) == 1, timeout=30)
                await until_answered(sent_before + 2 * RATE)
                sent_before = sum(statuses.values())
                assert not loader.done()
            stop.set()
            await loader
    finally:
        stop.set()
        for b in running:
            with contextlib.suppress(ProcessLookupError):
                await b.terminate()
    flags = Counter(line for line in access_log.read_text().splitlines() if not line.startswith("200"))
    total = sum(statuses.values())
    failed = total - statuses[200]
    print(f"shipped={shipped}: {ROUNDS} x 5 -> 1 at {RATE} req/s: {failed} of {total} failed; {dict(statuses)} {flags}")
    assert total >= ROUNDS * 2 * RATE
    if shipped:
        assert failed == 0, (statuses, flags)
    else:
        assert failed > 0
