"""The cost of eds-server's health checks: CPU per HTTP check and memory per checked endpoint, next
to the same checks done by a naive aiohttp loop (one task per endpoint, a GET, a sleep).

    .venv/bin/python bench/health_checks.py [--endpoints 1000] [--interval 0.5] [--seconds 8] [--https]

"checker alone" runs the checker with a probe that returns at once: its own scheduling and
bookkeeping. The scenario is 10,000 endpoints every 5 s: 2,000 checks a second. The rate is what costs
CPU, so by default 1,000 endpoints (127.0.0.1, one port each) are checked every 0.5 s, the same
2,000 a second, against backends in another process (a raw asyncio HTTP server on uvloop, answering
200 with keep-alive, closing when asked to). "eds-server" keeps a connection per endpoint, as it
does for plain HTTP, with the checker's own probe as the server runs it (nothing of the bench's
in its path); "fresh connections" checks with a new connection each time (probes.check, as every
check before keep-alive). CPU is this process's own
(time.process_time), so the backends' cost is not counted (but on loopback the kernel delivers a
packet in the sender's time: part of each backend's receiving is counted). Memory per endpoint
is measured apart, with tracemalloc, for 10,000 targets. Loopback only; every loop is bounded in
time.

The scenario itself: `--endpoints 10000 --interval 5 --seconds 15` (the backends are spread over
processes of at most PER_BACKEND endpoints, two descriptors each).

`--https`: the same with `tls: true` checks against backends serving TLS (a throwaway P-256
certificate made here), eds-server's checker and fresh connections only (a handshake per fresh
check: fewer endpoints, e.g. `--endpoints 100`, keep the fresh rate within reach of one core;
`--kept-only` leaves fresh connections out, for the full rate). Each run of the checker also prints
the checks failed from the cold start on (for eds-server's, each failing endpoint's last reason),
the most endpoints marked unhealthy at once (sampled every 0.1 s; every backend is up, so any is the
checker's doing) and, for kept connections, the TLS handshakes in flight at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import ssl
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eds_server import gc_settings  # noqa: E402
from eds_server.encode import encode_group  # noqa: E402
from eds_server.health import probes  # noqa: E402
from eds_server.health.checker import Checker  # noqa: E402
from eds_server.health.spec import HealthSpec  # noqa: E402
from eds_server.health.tracker import Result  # noqa: E402
from eds_server.model import Endpoint, Group  # noqa: E402
from eds_server.store import Store  # noqa: E402

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
PER_BACKEND = 4000  # endpoints a backend process serves, at most
CLOSING = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class _Http(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:  # a request a read (a check sends one and waits)
            if b"onnection: close" in data:
                self.transport.write(CLOSING)  # type: ignore[attr-defined]
                self.transport.close()
            else:
                self.transport.write(ANSWER)  # type: ignore[attr-defined]


def _backends(n: int, ports: multiprocessing.Queue[list[int]], seconds: float, cert: tuple[str, str] | None) -> None:
    tls = None
    if cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(*cert)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(_Http, "127.0.0.1", 0, backlog=1024, ssl=tls) for _ in range(n)]
        ports.put([s.sockets[0].getsockname()[1] for s in servers])
        await asyncio.sleep(seconds)

    uvloop.run(main())


async def ours(
    ports: list[int], spec: HealthSpec, warm: float, seconds: float, null: bool = False, fresh: bool = False
) -> tuple[int, float]:
    """The checker; `null`: with a probe that returns at once (the scheduling and bookkeeping alone);
    `fresh`: a new connection per check."""
    store = Store(encode_group)
    store.add_source("bench")
    reasons: Counter[str] = Counter()

    async def probe(address: str, port: int, spec: HealthSpec) -> Result:
        if null:
            result = Result(True, "HTTP 200", 0.0005, 0.0)
        else:
            result = await probes.check(address, port, spec)
        reasons[result.reason] += 1
        return result

    # eds-server's own: the checker's default probe (kept connections), no wrapper of the bench's in
    # its path; what failed is read from the checks' counts and each target's last result at the end
    checker = Checker(store, probe=probe if null or fresh else None)
    store.update("bench", {"web": Group("web", tuple(Endpoint("127.0.0.1", p, check=spec) for p in ports))})
    stop = asyncio.Event()
    task = asyncio.create_task(checker.run(stop))
    most_unhealthy = [0]  # endpoints marked unhealthy at once, at most (all backends are up)

    async def watch() -> None:
        while not stop.is_set():  # bounded: ends with the run
            most_unhealthy[0] = max(most_unhealthy[0], checker.by_health()["unhealthy"])
            await asyncio.sleep(0.1)

    watching = asyncio.create_task(watch())
    await asyncio.sleep(warm)
    n0, c0, t0 = sum(checker.checks.values()), time.process_time(), os.times()
    await asyncio.sleep(seconds)
    n1, c1, t1 = sum(checker.checks.values()), time.process_time(), os.times()
    stop.set()
    await task
    await watching
    if not null and not fresh:
        for key in checker.targets():
            last = checker.last_check(*key) or {}
            if last.get("result") == "fail":
                reasons[f"{last['reason']} (last result)"] += 1
    failed = checker.checks[("http", "fail")]
    if failed or not reasons.keys() <= {"HTTP 200"}:
        print(f"  (ours, from the cold start on: {failed} failed; {dict(reasons)})")
    if not null:
        print(
            f"  (endpoints marked unhealthy at once, at most: {most_unhealthy[0]}; at the end: "
            f"{checker.by_health()['unhealthy']}; checks not counted (starved): {checker.checks[('http', 'starved')]})"
        )
    if n1 > n0:  # the process's CPU split: user (Python, uvloop) and system (the kernel's socket work)
        user, system = (t1.user - t0.user) / (n1 - n0) * 1e6, (t1.system - t0.system) / (n1 - n0) * 1e6
        print(f"  (CPU per check: {user:.1f} us user, {system:.1f} us system)")
    if not null and not fresh:
        kept = checker.connections
        peak = getattr(kept, "handshakes_peak", None)  # None: a version without the bound
        print(
            f"  (kept connections: {kept.opened} opened, {kept.reused} checks on a kept one; "
            f"TLS handshakes in flight at most: {'not counted' if peak is None else peak})"
        )
    return n1 - n0, c1 - c0


async def naive(ports: list[int], spec: HealthSpec, warm: float, seconds: float) -> tuple[int, float]:
    done = [0]
    deadline = time.monotonic() + warm + seconds
    timeout = aiohttp.ClientTimeout(total=spec.timeout)

    async def loop(session: aiohttp.ClientSession, url: str, offset: float) -> None:
        await asyncio.sleep(offset)
        while time.monotonic() < deadline:  # bounded in time
            started = time.monotonic()
            try:
                async with session.get(url, timeout=timeout, allow_redirects=False) as r:
                    await r.read()
            except (aiohttp.ClientError, TimeoutError):
                pass
            done[0] += 1
            await asyncio.sleep(max(0.0, spec.interval - (time.monotonic() - started)))

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [
            asyncio.create_task(loop(session, f"http://127.0.0.1:{p}/health", spec.interval * i / len(ports)))
            for i, p in enumerate(ports)
        ]
        await asyncio.sleep(warm)
        n0, c0 = done[0], time.process_time()
        await asyncio.sleep(seconds)
        n1, c1 = done[0], time.process_time()
        await asyncio.gather(*tasks)
    return n1 - n0, c1 - c0


async def memory(n: int, spec: HealthSpec) -> float:
    """Bytes allocated per checked endpoint by the checker's own state (targets, trackers, heap)."""
    store = Store(encode_group)
    store.add_source("bench")
    eps = tuple(Endpoint(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 80, check=spec) for i in range(n))
    checker = Checker(store)
    store.update("bench", {"web": Group("web", eps)})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    checker._reconcile()  # what run() does first; no check is started (nothing runs the loop meanwhile)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", type=int, default=1000)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--https", action="store_true", help="tls: true checks against TLS backends")
    p.add_argument("--kept-only", action="store_true", help="eds-server's checker alone (no fresh, naive rows)")
    args = p.parse_args()
    gc_settings.tune()  # the collector as the server sets it once started, for every row
    spec = HealthSpec("http", path="/health", interval=args.interval, timeout=min(1.0, args.interval), tls=args.https)
    warm = 2 * args.interval + 1
    cert: tuple[str, str] | None = None
    if args.https:
        from tests.support.tls import CertAuthority

        where = Path(tempfile.mkdtemp(prefix="bench-health-tls-"))
        issued = CertAuthority("bench CA", where).issue(where / "backend", dns=["backend.internal"])
        cert = (str(issued.cert), str(issued.key))
    q: multiprocessing.Queue[list[int]] = multiprocessing.get_context("spawn").Queue()
    scenarios: tuple[str, ...] = ("eds-server",)
    if not args.kept_only:
        scenarios += ("fresh connections",) if args.https else ("fresh connections", "naive aiohttp", "checker alone")
    # each backend process listens on and accepts its endpoints' connections: two descriptors each,
    # so a process takes at most PER_BACKEND endpoints (a descriptor limit of 20,000 is common)
    k = -(-args.endpoints // PER_BACKEND)
    shares = [args.endpoints // k + (i < args.endpoints % k) for i in range(k)]
    lasting = len(scenarios) * (warm + args.seconds) + 10
    procs = [
        multiprocessing.get_context("spawn").Process(target=_backends, args=(n, q, lasting, cert), daemon=True)
        for n in shares
    ]
    for proc in procs:
        proc.start()
    ports = [port for _ in procs for port in q.get(timeout=60)]
    rate = args.endpoints / args.interval
    results: dict[str, object] = {
        "endpoints": args.endpoints,
        "interval_s": args.interval,
        "checks_per_s_planned": rate,
        "https": args.https,
    }
    for name in scenarios:
        if name == "naive aiohttp":
            checks, cpu = uvloop.run(naive(ports, spec, warm, args.seconds))
        else:
            null, fresh = name == "checker alone", name == "fresh connections"
            checks, cpu = uvloop.run(ours(ports, spec, warm, args.seconds, null=null, fresh=fresh))
        per_check_us = cpu / checks * 1e6 if checks else float("nan")
        share = cpu / args.seconds
        results[name] = {
            "checks": checks,
            "cpu_s": round(cpu, 3),
            "cpu_us_per_check": round(per_check_us, 1),
            "core_share_at_2000_per_s": round(per_check_us * 2000 / 1e6, 3),
            "core_share_measured": round(share, 3),
        }
        print(
            f"{name:17} {checks / args.seconds:7.0f} checks/s  {per_check_us:6.1f} us CPU per check  "
            f"{share:5.1%} of a core here, {per_check_us * 2000 / 1e6:5.1%} at 10,000 endpoints every 5 s"
        )
    for proc in procs:
        proc.terminate()
    per_ep = asyncio.run(memory(10_000, spec))
    results["bytes_per_endpoint"] = round(per_ep)
    print(f"memory: {per_ep:.0f} bytes of checker state per checked endpoint (10,000 endpoints)")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    name = "health_checks_https.json" if args.https else "health_checks.json"
    (out / name).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
