"""Every core, and a second tier: eds-server with --workers 1 and 2, two tiers, the stock HTTP/2 path
and a peer, side by side.

    .venv/bin/python bench/run.py --only cores [--peer COMMAND] [--rounds 2] [--quick]

Each server runs unpinned (every core of this machine, as users run it), the load generators on
the client core(s) as in every scenario; configurations are interleaved round by round, so drift in
the machine hits each alike. Per shape and configuration, medians over rounds of:

- connect: from opening every stream to every stream holding its first response;
- delivery p50/p99: from just before the upstreams file is renamed to each stream's receipt of the
  response carrying the change (CLOCK_MONOTONIC in both processes), over every stream and change;
- CPU per change: CPU of every process of the server (the owner and its workers; both tiers) from
  the change until each stream has it and the CPU settles; for two tiers also the origin's share;
- RSS per stream: all its processes' RSS with the streams open and idle, less before, per stream.

"two tiers" is an origin (upstreams file) and a relay (`--upstream-eds`) that the streams reach:
its latency less one tier's is the cost of a hop. "floor" is bench/floor.py (unless --no-floor): the
same response bytes written to every stream with one sendmsg per connection, the ACKs read and
dropped; "floor C" the same in C (bench/floor.c, when gcc is here). The table gives CPU per change
as user and system apart (/proc/PID/stat of every process, clock ticks, over a round's changes) and
each server's CPU per change over the floors' and the peer's.
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from run import CORES, Config, Workers, table
from sidebyside import EDS_SERVER, IDLE_WAIT, PER_CONN, Served, cell, floors, ratio, upstreams_text, write_atomically


@dataclass(frozen=True)
class CoreShape:
    name: str
    streams: int
    endpoints: int
    changes: int


SHAPES = [
    CoreShape("1k streams x 1k eps", 1000, 1000, 5),
    CoreShape("10k streams x 1k eps", 10_000, 1000, 3),
]
BIG = CoreShape("20k streams x 1k eps, --workers 2", 20_000, 1000, 2)


def wait_ready(server: Served, limit: float = 60.0) -> None:
    """Until eds-server's /readyz says 200 (with workers: every worker listens), bounded."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("eds-server never became ready")


def configurations(peer: list[str] | None, cfg: Config) -> dict[str, list[str] | None]:
    """Name -> eds-server's extra arguments (None: two tiers); for the floors, their command."""
    out: dict[str, list[str] | None] = {
        "eds --workers 1": [],
        "eds --workers 2": ["--workers", "2"],
        "eds two tiers": None,
        "eds stock HTTP2": ["--http2", "stock"],  # grpclib's own HTTP/2 path, below the guard
    }
    out.update(floors(cfg))
    if peer:
        out["peer"] = peer
    return out


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(
    cfg: Config, shape: CoreShape, name: str, extra: list[str] | None, peer: list[str] | None
) -> dict[str, Any]:
    streams, endpoints = cfg.size(shape.streams), cfg.size(shape.endpoints)
    work = cfg.out / "cores"
    work.mkdir(parents=True, exist_ok=True)
    path = work / "upstreams.yaml"
    weights = [1] * endpoints
    write_atomically(path, upstreams_text(weights))
    tuning = ["--debounce", cfg.debounce] if cfg.debounce else []
    with open(work / f"{name.replace(' ', '_')}.log", "a") as log:
        origin: Served | None = None
        if name == "peer":
            assert peer is not None
            server = Served(peer, path, log, pin=False)
        elif name.startswith("floor"):
            assert extra is not None
            server = Served(extra, path, log, pin=False)
        elif extra is None:  # two tiers: the streams reach the relay
            origin = Served(EDS_SERVER, path, log, extra=tuning, pin=False)
            wait_ready(origin)
            server = Served(EDS_SERVER, None, log, extra=["--upstream-eds", f"127.0.0.1:{origin.port}"], pin=False)
        else:
            server = Served(EDS_SERVER, path, log, extra=[*extra, *tuning], pin=False)
        workers = Workers(max(1, min(cfg.clients, math.ceil(streams / 1000))), cfg.node_bytes, log)
        try:
            if name != "peer" and not name.startswith("floor"):
                wait_ready(server)
            server.settle()
            rss0 = server.rss()
            t0, connect_cpu0 = time.monotonic(), server.cpu() + (origin.cpu() if origin else 0.0)
            workers.open(server.port, ["g0"] * streams, False, per_conn=PER_CONN)
            missing = sum(
                r["remaining"]
                for r in workers.all([{"cmd": "wait", "counts": {"g0": 1}, "timeout": 180}] * len(workers.procs))
            )
            connect = time.monotonic() - t0
            connect_cpu = server.cpu() + (origin.cpu() if origin else 0.0) - connect_cpu0
            if missing:
                raise RuntimeError(f"{name}: {missing} streams never got a first response")
            server.settle()
            time.sleep(IDLE_WAIT)
            rss1 = server.rss()
            workers.dump(clear=True)
            cpus, origin_cpus, latencies = [], [], []
            user0, sys0 = server.user_sys()
            ouser0, osys0 = origin.user_sys() if origin else (0.0, 0.0)
            for k in range(1, shape.changes + 1):
                base = min(r["g0"] for r in workers.all([{"cmd": "counts"}] * len(workers.procs)))
                c0 = server.cpu()
                o0 = origin.cpu() if origin else 0.0
                weights[k % endpoints] = k + 1
                t_change = time.monotonic_ns()
                write_atomically(path, upstreams_text(weights))
                missing = sum(
                    r["remaining"]
                    for r in workers.all(
                        [{"cmd": "wait", "counts": {"g0": base + 1}, "timeout": 120}] * len(workers.procs)
                    )
                )
                if missing:
                    raise RuntimeError(f"{name}: change {k} missed {missing} streams")
                server.settle()
                if origin:
                    origin.settle()
                    origin_cpus.append(origin.cpu() - o0)
                cpus.append(server.cpu() - c0 + (origin_cpus[-1] if origin else 0.0))
                for _, recv, _ in workers.dump(clear=True)["streams"]:
                    after = [t for _, t in recv if t >= t_change]
                    if after:
                        latencies.append((min(after) - t_change) / 1e9)
            user1, sys1 = server.user_sys()
            ouser1, osys1 = origin.user_sys() if origin else (0.0, 0.0)
            errors = workers.dump()["n_errors"]
            if errors:
                raise RuntimeError(f"{name}: {errors} stream errors (refused, reset or ended early)")
        finally:
            workers.stop()
            server.stop()
            if origin:
                origin.stop()
    return {
        "connect_s": connect,
        "connect_cpu_s": connect_cpu,
        "p50_s": quantile(latencies, 0.5),
        "p99_s": quantile(latencies, 0.99),
        "cpu_per_change_s": statistics.median(cpus),
        "origin_cpu_per_change_s": statistics.median(origin_cpus) if origin_cpus else None,
        "rss_per_stream_b": (rss1 - rss0) / streams,
        "user_per_change_s": (user1 - user0 + ouser1 - ouser0) / shape.changes,
        "sys_per_change_s": (sys1 - sys0 + osys1 - osys0) / shape.changes,
    }


def scenario_cores(cfg: Config) -> dict[str, Any]:
    """`--shapes 1,2,3`: 1k streams, 10k streams, 20k streams with --workers 2 (default: all)."""
    peer = shlex.split(cfg.peer) if cfg.peer else None
    configs = configurations(peer, cfg)
    picked = [int(n) for n in cfg.shapes.split(",") if n.strip()] if cfg.shapes else [1, 2, 3]
    shapes = [SHAPES[n - 1] for n in picked if n <= len(SHAPES)]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {n: [] for n in configs} for s in shapes}
    for r in range(cfg.rounds):
        for shape in shapes:
            for name, extra in configs.items():
                got = one_round(cfg, shape, name, extra, peer)
                results[shape.name][name].append(got)
                print(
                    f"  round {r + 1}/{cfg.rounds} {shape.name} {name}: connect {got['connect_s']:.2f} s "
                    f"({got['connect_cpu_s']:.2f} s CPU), "
                    f"p50 {got['p50_s'] * 1000:.0f} ms, p99 {got['p99_s'] * 1000:.0f} ms, "
                    f"{got['cpu_per_change_s'] * 1000:.0f} ms CPU/change "
                    f"(user {got['user_per_change_s'] * 1000:.0f}, "
                    f"system {got['sys_per_change_s'] * 1000:.0f})",
                    flush=True,
                )
    big = one_round(cfg, BIG, "eds --workers 2", ["--workers", "2"], peer) if 3 in picked else None
    if big is not None:
        print(f"  {BIG.name}: {big['rss_per_stream_b'] / 1000:.1f} KB per stream", flush=True)
    rows = [
        (
            "shape",
            "server",
            "connect s",
            "connect CPU s",
            "p50 ms",
            "p99 ms",
            "CPU/change ms",
            "user ms",
            "sys ms",
            "/ floor",
            "/ floor C",
            "/ peer",
            "KB/stream",
        )
    ]
    out: dict[str, Any] = {
        "cores": len(CORES),
        "rounds": cfg.rounds,
        "peer": cfg.peer,
        "floor": [n for n, _ in floors(cfg)],
        "shapes": {},
        "big": big,
        "debounce": cfg.debounce or "default",
    }
    for shape in shapes:
        out["shapes"][shape.name] = {}
        for name in configs:
            runs = results[shape.name][name]

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.median(x[key] for x in runs)

            keys = (
                "connect_s",
                "connect_cpu_s",
                "p50_s",
                "p99_s",
                "cpu_per_change_s",
                "user_per_change_s",
                "sys_per_change_s",
                "rss_per_stream_b",
            )
            figures = {k: med(k) for k in keys}
            if name == "eds two tiers":
                figures["origin_cpu_per_change_s"] = med("origin_cpu_per_change_s")
            out["shapes"][shape.name][name] = {**figures, "rounds": runs}
        here = out["shapes"][shape.name]
        for name, figures in here.items():
            for ref in ("floor", "floor C", "peer"):
                ref_cpu = here[ref]["cpu_per_change_s"] if ref in here else math.nan
                figures[f"cpu_over_{ref.replace(' ', '_').lower()}"] = ratio(figures["cpu_per_change_s"], ref_cpu)
            rows.append(
                (
                    shape.name,
                    name,
                    f"{figures['connect_s']:.2f}",
                    f"{figures['connect_cpu_s']:.2f}",
                    f"{figures['p50_s'] * 1000:.0f}",
                    f"{figures['p99_s'] * 1000:.0f}",
                    f"{figures['cpu_per_change_s'] * 1000:.0f}",
                    f"{figures['user_per_change_s'] * 1000:.1f}",
                    f"{figures['sys_per_change_s'] * 1000:.1f}",
                    cell(figures["cpu_over_floor"], "{:.2f}"),
                    cell(figures["cpu_over_floor_c"], "{:.2f}"),
                    cell(figures["cpu_over_peer"], "{:.2f}"),
                    f"{figures['rss_per_stream_b'] / 1000:.1f}",
                )
            )
    if big is not None:
        rows.append(
            (
                BIG.name,
                "eds --workers 2",
                f"{big['connect_s']:.2f}",
                f"{big['connect_cpu_s']:.2f}",
                f"{big['p50_s'] * 1000:.0f}",
                f"{big['p99_s'] * 1000:.0f}",
                f"{big['cpu_per_change_s'] * 1000:.0f}",
                f"{big['user_per_change_s'] * 1000:.1f}",
                f"{big['sys_per_change_s'] * 1000:.1f}",
                "-",
                "-",
                "-",
                f"{big['rss_per_stream_b'] / 1000:.1f}",
            )
        )
    table(
        f"every core ({len(CORES)} here, servers unpinned), eds-server --debounce {cfg.debounce or '50ms'}, "
        f"medians of {cfg.rounds} interleaved rounds" + (" (QUICK: sizes / 10, not comparable)" if cfg.quick else ""),
        rows,
    )
    return out
