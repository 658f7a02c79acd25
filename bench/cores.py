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
- RSS per stream: all its processes' RSS with the streams open and idle, less before, per stream;
- the canary's delay p50/p99 (eds-server only; bench/canary.py): one stream from an address of its
  own, its group changed through the registration API every 50 ms while as many changes again fan
  out to every stream (after the measured ones: its writes are not in the CPU per change).

"two tiers" is an origin (upstreams file) and a relay (`--upstream-eds`) that the streams reach:
its latency less one tier's is the cost of a hop. "floor" is bench/floor.py (unless --no-floor): the
same response bytes written to every stream with one sendmsg per connection, the ACKs read and
dropped; "floor C" the same in C (bench/floor.c, when gcc is here). The table gives CPU per change
as user and system apart (/proc/PID/stat of every process, clock ticks, over a round's changes) and
each server's CPU per change over the floors' and the peer's.

Shape 4 (`--shapes 4`, not in the default run): 100,000 streams (`--streams N` for another count)
on eds-server --workers 2 alone, every round, each round recorded (a failed one with what stopped
it). Its load generators are `--clients` processes (one per 1,000 streams at most), 100 streams a
connection; a round that adds more than `--memory-cap` GB (default 16) to the machine's memory in
use is stopped. It also gives the load generators' CPU per change and RSS, and the memory peak.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shlex
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import canary
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
HUGE_STREAMS = 100_000  # shape 4, unless --streams says otherwise


def huge(streams: int, shown: int) -> CoreShape:
    """Shape 4: `streams` (100,000 by default) x 1k eps on --workers 2, every round (not in the default
    run); `shown`: the streams it runs with (a tenth with --quick), for its name."""
    return CoreShape(f"{shown / 1000:g}k streams x 1k eps, --workers 2", streams, 1000, 3)


def used_memory() -> int:
    """Bytes in use on this machine (MemTotal less MemAvailable): every process and the kernel's
    socket buffers, where 100,000 streams' first requests wait on flow control."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class MemoryCap:
    """Stops a round whose memory grows past `cap` bytes over what the machine used at its start
    (checked every 0.5 s, from a thread: the bench waits on its children meanwhile) by killing the
    processes `victims` gives; the peak growth is a figure of the round."""

    def __init__(self, cap: float, victims: Callable[[], list[int]]) -> None:
        self.cap, self.victims = cap, victims
        self.base = used_memory()
        self.peak = 0
        self.tripped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            grown = used_memory() - self.base
            self.peak = max(self.peak, grown)
            if grown > self.cap:
                self.tripped = grown
                for pid in self.victims():
                    with contextlib.suppress(OSError):  # gone already
                        os.kill(pid, signal.SIGKILL)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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


def check_descriptors(streams: int, processes: int) -> None:
    """Each load generator holds its share of the connections: refuse a round the descriptor limit
    (raised to the hard limit by bench/run.py) cannot hold, with the figures, rather than fail midway."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = math.ceil(math.ceil(streams / PER_CONN) / processes) + 64
    if need > soft:
        raise RuntimeError(f"{streams} streams on {processes} load generators: {need} descriptors each, limit {soft}")


def one_round(
    cfg: Config, shape: CoreShape, name: str, extra: list[str] | None, peer: list[str] | None
) -> dict[str, Any]:
    streams, endpoints = cfg.size(shape.streams), cfg.size(shape.endpoints)
    connect_timeout, change_timeout = max(180.0, streams * 0.003), max(120.0, streams * 0.0012)
    n_workers = max(1, min(cfg.clients, math.ceil(streams / 1000)))
    check_descriptors(streams, n_workers)
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
            if cfg.peer_eds:  # another version of eds-server: its settings as this one's
                server = Served(peer, path, log, extra=[*tuning, *canary.ARGS], pin=False, env=canary.ENV)
            else:
                server = Served(peer, path, log, pin=False)
        elif name.startswith("floor"):
            assert extra is not None
            server = Served(extra, path, log, pin=False)
        elif extra is None:  # two tiers: the streams reach the relay; the canary's group is written to the origin
            origin = Served(EDS_SERVER, path, log, extra=[*tuning, *canary.ARGS], pin=False, env=canary.ENV)
            wait_ready(origin)
            server = Served(EDS_SERVER, None, log, extra=["--upstream-eds", f"127.0.0.1:{origin.port}"], pin=False)
        else:
            server = Served(EDS_SERVER, path, log, extra=[*extra, *tuning, *canary.ARGS], pin=False, env=canary.ENV)
        workers = Workers(n_workers, cfg.node_bytes, log)
        cap = MemoryCap(
            cfg.memory_cap,
            lambda: [*server.pids(), *(origin.pids() if origin else []), *(w.p.pid for w in workers.procs)],
        )
        eds = (name != "peer" or cfg.peer_eds) and not name.startswith("floor")
        try:
            if eds:
                wait_ready(server)
            server.settle()
            rss0 = server.rss()
            t0, connect_cpu0 = time.monotonic(), server.cpu() + (origin.cpu() if origin else 0.0)
            connect_sys0 = server.user_sys()[1] + (origin.user_sys()[1] if origin else 0.0)
            every = ["g0"] * streams
            workers.open(server.port, every, False, PER_CONN, own_addresses=cfg.own_addresses, rate=cfg.connect_rate)
            missing = sum(
                r["remaining"]
                for r in workers.all(
                    [{"cmd": "wait", "counts": {"g0": 1}, "timeout": connect_timeout}] * len(workers.procs)
                )
            )
            connect = time.monotonic() - t0
            connect_cpu = server.cpu() + (origin.cpu() if origin else 0.0) - connect_cpu0
            connect_sys = server.user_sys()[1] + (origin.user_sys()[1] if origin else 0.0) - connect_sys0
            if missing:
                raise RuntimeError(f"{name}: {missing} streams never got a first response")
            server.settle()
            time.sleep(IDLE_WAIT)
            rss1 = server.rss()
            client_rss = sum(rss_of(w.p.pid) for w in workers.procs)
            got = workers.dump(clear=True)
            client_cpu0, client_sys0 = got["cpu"], got["cpu_sys"]
            cpus, origin_cpus, latencies = [], [], []
            user0, sys0 = server.user_sys()
            ouser0, osys0 = origin.user_sys() if origin else (0.0, 0.0)

            def change(k: int, settle: bool = True) -> int:
                """Change k written, every stream holding it (and the server's CPU settled); when it was written."""
                base = min(r["g0"] for r in workers.all([{"cmd": "counts"}] * len(workers.procs)))
                weights[k % endpoints] = k + 1
                t_change = time.monotonic_ns()
                write_atomically(path, upstreams_text(weights))
                missing = sum(
                    r["remaining"]
                    for r in workers.all(
                        [{"cmd": "wait", "counts": {"g0": base + 1}, "timeout": change_timeout}] * len(workers.procs)
                    )
                )
                if missing:
                    raise RuntimeError(f"{name}: change {k} missed {missing} streams")
                if settle:
                    server.settle()
                    if origin:
                        origin.settle()
                return t_change

            for k in range(1, shape.changes + 1):
                c0 = server.cpu()
                o0 = origin.cpu() if origin else 0.0
                t_change = change(k)
                if origin:
                    origin_cpus.append(origin.cpu() - o0)
                cpus.append(server.cpu() - c0 + (origin_cpus[-1] if origin else 0.0))
                got = workers.dump(clear=True)
                client_cpu1, client_sys1 = got["cpu"], got["cpu_sys"]
                for _, recv, _ in got["streams"]:
                    after = [t for _, t in recv if t >= t_change]
                    if after:
                        latencies.append((min(after) - t_change) / 1e9)
            user1, sys1 = server.user_sys()
            ouser1, osys1 = origin.user_sys() if origin else (0.0, 0.0)
            beside = {}
            if eds:  # as many changes again, with the canary's group changing meanwhile (not in the CPU above)
                bird = canary.Canary(server.port, (origin or server).admin, cfg.node_bytes, log)
                try:
                    with bird.changing():
                        for k in range(shape.changes + 1, 2 * shape.changes + 1):
                            change(k, settle=False)  # its writes keep the CPU from settling
                            workers.dump(clear=True)
                            time.sleep(canary.GAP)
                    beside = bird.figures()
                finally:
                    bird.stop()
            end = workers.dump()
            errors = end["n_errors"]
            if errors:
                raise RuntimeError(
                    f"{name}: {errors} stream errors (refused, reset or ended early), first: {end['errors'][:2]}"
                )
            refused = refusals(server) if eds else {}
        except (RuntimeError, OSError, ValueError) as e:  # a killed child: EOF, a broken pipe or a cut line
            if cap.tripped:
                raise RuntimeError(
                    f"{name}, {streams} streams: stopped at {cap.tripped / 1e9:.1f} GB of memory used over "
                    f"the start (cap {cfg.memory_cap / 1e9:.0f} GB)"
                ) from e
            why = refusals(server) if eds else {}
            raise RuntimeError(f"{e}; refused by eds-server: {why}" if why else str(e)) from e
        finally:
            cap.stop()
            workers.stop()
            server.stop()
            if origin:
                origin.stop()
    return {
        "streams": streams,
        "load_generators": n_workers,
        "connect_s": connect,
        "connect_cpu_s": connect_cpu,
        "connect_sys_s": connect_sys,  # its system part (clock ticks: to 10 ms)
        "p50_s": quantile(latencies, 0.5),
        "p99_s": quantile(latencies, 0.99),
        "cpu_per_change_s": statistics.median(cpus),
        "origin_cpu_per_change_s": statistics.median(origin_cpus) if origin_cpus else None,
        "rss_per_stream_b": (rss1 - rss0) / streams,
        "user_per_change_s": (user1 - user0 + ouser1 - ouser0) / shape.changes,
        "sys_per_change_s": (sys1 - sys0 + osys1 - osys0) / shape.changes,
        "client_cpu_per_change_s": (client_cpu1 - client_cpu0) / shape.changes,
        "client_sys_per_change_s": (client_sys1 - client_sys0) / shape.changes,
        "client_rss_b": client_rss,
        "peak_memory_growth_b": cap.peak,
        "refused": refused,
        **beside,
    }


def refusals(server: Served) -> dict[str, int]:
    """What eds-server refused or shed, by reason (its /v1/stats, every worker's added up), bounded."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/v1/stats", timeout=10) as r:
            stats = json.load(r)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in (stats.get("refused_by_reason") or {}).items() if v}


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def canary_cell(runs: list[dict[str, Any]]) -> str:
    """The canary's delay p50 / p99 in ms (medians of the rounds), or "-" where it did not run."""
    ran = [x for x in runs if "canary_p99_s" in x]
    if not ran:
        return "-"
    p50, p99 = (statistics.median(x[k] for x in ran) * 1000 for k in ("canary_p50_s", "canary_p99_s"))
    return f"{p50:.0f} / {p99:.0f}"


def describe(got: dict[str, Any]) -> str:
    """One round's figures on one line."""
    return (
        f"connect {got['connect_s']:.2f} s ({got['connect_cpu_s']:.2f} s CPU, "
        f"system {got['connect_sys_s']:.2f}), "
        f"p50 {got['p50_s'] * 1000:.0f} ms, p99 {got['p99_s'] * 1000:.0f} ms, "
        f"{got['cpu_per_change_s'] * 1000:.0f} ms CPU/change "
        f"(user {got['user_per_change_s'] * 1000:.0f}, system {got['sys_per_change_s'] * 1000:.0f}), "
        f"{got['rss_per_stream_b'] / 1000:.1f} KB/stream; load generators {got['load_generators']}: "
        f"{got['client_cpu_per_change_s'] * 1000:.0f} ms CPU/change (system "
        f"{got['client_sys_per_change_s'] * 1000:.0f}), RSS {got['client_rss_b'] / 1e6:.0f} MB; "
        f"memory peak +{got['peak_memory_growth_b'] / 1e9:.1f} GB"
        + (
            f"; canary: {got['canary_changes']} changes, delay p50 {got['canary_p50_s'] * 1000:.0f} ms, "
            f"p99 {got['canary_p99_s'] * 1000:.0f} ms, max {got['canary_max_s'] * 1000:.0f} ms, "
            f"{got['canary_missed']} missed"
            + (f", {got['canary_refused']} refused: {got['canary_refused_why']}" if got["canary_refused"] else "")
            if "canary_p99_s" in got
            else ""
        )
        + (f"; refused {got['refused']}" if got.get("refused") else "")
    )


def scenario_cores(cfg: Config) -> dict[str, Any]:
    """`--shapes 1,2,3,4`: 1k streams, 10k streams, 20k streams with --workers 2 (once), 100k streams
    (or `--streams N`) with --workers 2 (every round); default 1,2,3."""
    peer = shlex.split(cfg.peer) if cfg.peer else None
    configs = configurations(peer, cfg)
    picked = [int(n) for n in cfg.shapes.split(",") if n.strip()] if cfg.shapes else [1, 2, 3]
    if any(not 1 <= n <= 4 for n in picked):
        raise SystemExit(f"--shapes of cores: numbers from 1 to 4, got {cfg.shapes!r}")
    shapes = [SHAPES[n - 1] for n in picked if n <= len(SHAPES)]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {n: [] for n in configs} for s in shapes}
    top_streams = cfg.streams or HUGE_STREAMS
    top = huge(top_streams, cfg.size(top_streams)) if 4 in picked else None
    top_rounds: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        if top is not None:
            try:
                got = one_round(cfg, top, "eds --workers 2", ["--workers", "2"], peer)
            except RuntimeError as e:  # recorded: what stopped a round is a result too
                got = {"error": str(e)}
                print(f"  round {r + 1}/{cfg.rounds} {top.name}: FAILED: {e}", flush=True)
            else:
                print(f"  round {r + 1}/{cfg.rounds} {top.name}: {describe(got)}", flush=True)
            top_rounds.append(got)
        for shape in shapes:
            for name, extra in configs.items():
                got = one_round(cfg, shape, name, extra, peer)
                results[shape.name][name].append(got)
                print(f"  round {r + 1}/{cfg.rounds} {shape.name} {name}: {describe(got)}", flush=True)
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
            "canary p50/p99 ms",
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
        "huge": None,
        "debounce": cfg.debounce or "default",
    }
    done = [x for x in top_rounds if "error" not in x]
    if top is not None:
        out["huge"] = {"shape": top.name, "streams": cfg.size(top.streams), "rounds": top_rounds}
        if done:
            counts = ("load_generators", "streams")
            numbers = [k for k, v in done[0].items() if isinstance(v, float | int) and k not in counts]
            out["huge"] |= {k: statistics.median(x[k] for x in done) for k in numbers}
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
            if all("canary_p99_s" in x for x in runs):
                figures |= {k: med(k) for k in ("canary_p50_s", "canary_p99_s", "canary_max_s")}
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
                    canary_cell(figures["rounds"]),
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
                canary_cell([big]),
                f"{big['cpu_per_change_s'] * 1000:.0f}",
                f"{big['user_per_change_s'] * 1000:.1f}",
                f"{big['sys_per_change_s'] * 1000:.1f}",
                "-",
                "-",
                "-",
                f"{big['rss_per_stream_b'] / 1000:.1f}",
            )
        )
    for i, x in enumerate(top_rounds):
        assert top is not None
        if "error" in x:
            rows.append((top.name, f"round {i + 1}: {x['error']}"[:60], *["-"] * 12))
            continue
        rows.append(
            (
                top.name,
                f"eds --workers 2, round {i + 1}",
                f"{x['connect_s']:.2f}",
                f"{x['connect_cpu_s']:.2f}",
                f"{x['p50_s'] * 1000:.0f}",
                f"{x['p99_s'] * 1000:.0f}",
                canary_cell([x]),
                f"{x['cpu_per_change_s'] * 1000:.0f}",
                f"{x['user_per_change_s'] * 1000:.1f}",
                f"{x['sys_per_change_s'] * 1000:.1f}",
                "-",
                "-",
                "-",
                f"{x['rss_per_stream_b'] / 1000:.1f}",
            )
        )
    table(
        f"every core ({len(CORES)} here, servers unpinned), eds-server --debounce {cfg.debounce or '50ms'}, "
        f"medians of {cfg.rounds} interleaved rounds" + (" (QUICK: sizes / 10, not comparable)" if cfg.quick else ""),
        rows,
    )
    return out
