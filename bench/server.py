"""Server under test for bench/run.py: eds_server's App on uvloop, pinned to one core, driven over stdin.

    .venv/bin/python bench/server.py [--cpu 0] [--log-level info]   # prints {"port": P}, then takes commands

The App has no upstreams file and no Docker source: a source named "bench" is declared on its store
and fed from memory, so a change is exactly one source event (one `store.update` of the whole
in-memory state, as the file and Docker sources do), never a re-parse.

Control channel, one command per line on stdin, one JSON reply per line on stdout:
  set GROUPS ENDPOINTS     groups g0..g{GROUPS-1} with ENDPOINTS endpoints each, as one update
  change GROUP             set one endpoint's weight to a value never used before (so every change has
                           a new version); replies t (CLOCK_MONOTONIC ns, taken just before
                           store.update), the group's new version, and upd_cpu: CPU seconds spent in
                           store.update itself (encode + telling the streams)
  churn RATE SECONDS SEED  changes to random groups at RATE per second for SECONDS, timed in here;
                           replies [[t_scheduled, t, group, version], ...]
  versions | cpu ([user, sys] seconds) | rss (bytes, after gc) | stats (App.stats()) | quit
  heap [N]                 the N biggest live allocation sites (run with PYTHONTRACEMALLOC=depth)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import random
import resource
import sys
import time
import tracemalloc
from typing import Any

import uvloop

from eds_server.app import App
from eds_server.model import Endpoint, Group
from eds_server.settings import AdminSettings, Settings, SourceSettings, TransportSettings
from eds_server.transport.h2 import ConnectionLimits

SOURCE = "bench"


def make_group(name: str, endpoints: int, base: int) -> Group:
    eps = tuple(
        Endpoint(f"10.{(base + i) >> 16 & 255}.{(base + i) >> 8 & 255}.{(base + i) & 255}", 8080, weight=1)
        for i in range(endpoints)
    )
    return Group(name, eps)


class Bench:
    def __init__(self, app: App) -> None:
        self.app = app
        self.groups: dict[str, Group] = {}
        self.counter = 0

    def set(self, n_groups: int, n_endpoints: int) -> dict[str, Any]:
        self.groups = {f"g{i}": make_group(f"g{i}", n_endpoints, i * n_endpoints) for i in range(n_groups)}
        c = time.process_time()
        self.app.store.update(SOURCE, self.groups)
        return {"groups": n_groups, "cpu": time.process_time() - c}

    def change(self, name: str) -> tuple[int, str, float]:
        self.counter += 1
        group = self.groups[name]
        eps = list(group.endpoints)
        i = self.counter % len(eps)
        eps[i] = dataclasses.replace(eps[i], weight=self.counter + 1)
        self.groups[name] = dataclasses.replace(group, endpoints=tuple(eps))
        t = time.monotonic_ns()
        c = time.process_time()
        self.app.store.update(SOURCE, self.groups)
        upd = time.process_time() - c
        return t, self.app.store.resources()[name].version, upd

    async def churn(self, rate: float, seconds: float, seed: int) -> list[list[Any]]:
        rng = random.Random(seed)
        names = list(self.groups)
        start, out = time.monotonic_ns(), []
        for k in range(int(rate * seconds)):
            due = start + int(k * 1e9 / rate)
            await asyncio.sleep(max(0.0, (due - time.monotonic_ns()) / 1e9))
            name = rng.choice(names)
            t, version, _ = self.change(name)
            out.append([due, t, name, version])
        return out


def cpu_seconds() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def heap_top(n: int) -> list[str]:
    if not tracemalloc.is_tracing():
        return ["start the server with PYTHONTRACEMALLOC=N"]
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    stats = tracemalloc.take_snapshot().statistics("traceback")
    head = f"traced now {current / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB"
    sites = [" <- ".join(map(str, s.traceback[::-1])) for s in stats[:n]]
    return [head] + [
        f"{s.size / 1e6:.1f} MB in {s.count} blocks: {site}" for s, site in zip(stats[:n], sites, strict=True)
    ]


async def main(log_level: str) -> None:
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Every load generator connection comes from 127.0.0.1: the per-IP budgets, sized for one
    # Envoy per IP, would refuse the benchmark's thousands of streams from one address; and 10,000
    # first requests of 60 KB take one core longer than the 10 s a stream has to send its first.
    per_ip = ConnectionLimits(
        stream_budget=1_000_000, max_connections_per_ip=10_000, partial_message_budget=1 << 33, request_timeout=300
    )
    app = App(
        Settings(
            sources=SourceSettings(startup_timeout=3600.0),
            admin=AdminSettings(address=None),
            transport=TransportSettings(listen=("127.0.0.1", 0), connection_limits=per_ip),
        )
    )
    app.store.add_source(SOURCE)
    await app.start()
    bench = Bench(app)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"port": app.grpc_port, "pid": os.getpid()}), flush=True)
    try:
        while line := await reader.readline():
            cmd, *args = line.decode().split()
            reply: Any
            match cmd:
                case "set":
                    reply = bench.set(int(args[0]), int(args[1]))
                case "change":
                    t, version, upd = bench.change(args[0])
                    reply = {"t": t, "version": version, "upd_cpu": upd}
                case "churn":
                    reply = await bench.churn(float(args[0]), float(args[1]), int(args[2]))
                case "versions":
                    reply = {n: r.version for n, r in app.store.resources().items()}
                case "cpu":
                    reply = cpu_seconds()
                case "rss":
                    reply = rss_bytes()
                case "stats":
                    reply = app.stats()
                case "heap":  # with PYTHONTRACEMALLOC=N: the biggest live allocation sites
                    reply = heap_top(int(args[0]) if args else 10)
                case "quit":
                    break
                case _:
                    reply = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        await app.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", type=int, default=None, help="pin to this core")
    p.add_argument("--log-level", default="info")
    args = p.parse_args()
    if args.cpu is not None and args.cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {args.cpu})
    uvloop.run(main(args.log_level))
