"""Fan-out benchmark: how eds-server copes with many Envoy streams, changes, churn and reconnects.

    .venv/bin/python bench/run.py [--quick] [--only NAME[,NAME]] [--clients N] [--profile]
                                  [--peer COMMAND] [--rounds N] [--no-floor]

Scenarios (NAME): fanout, churn, memory, storm, big, cores (bench/cores.py: --workers 1 and 2, two
tiers, the floor and --peer, unpinned; by default only with --peer; `--shapes 4 [--streams N]`:
100,000 streams on --workers 2) and sidebyside (bench/sidebyside.py:
eds-server, the floor and --peer COMMAND, any server taking `serve --upstreams FILE --listen HOST:PORT
[--admin HOST:PORT]`, all driven through the file, interleaved over --rounds). The floor
(bench/floor.py; --no-floor leaves it out) is a bare server that writes the same response bytes to
every stream with one sendmsg per connection: the least a change can cost in Python; "floor C"
(bench/floor.c, compiled with gcc when it is here) the same without Python. Each starts a fresh server (bench/server.py,
eds_server's App, pinned to the first core) and load generators (bench/loadgen.py, raw HTTP/2
speaking StreamEndpoints like Envoy without ADS, all pinned to the other core), prints a table and
writes bench/results/<name>.json (bench/results/quick/ with --quick, which divides the sizes by 10).
A summary with the targets comes last. --profile records each server with py-spy (`.venv/bin/pip
install py-spy`) as collapsed stacks in bench/results/profile/<name>-<variant>.folded (for
speedscope or flamegraph.pl); its figures go there too, as sampling slows the server a little.

Latency = from the change being handed to the server (CLOCK_MONOTONIC, just before store.update)
to the stream's receipt of the response carrying it (CLOCK_MONOTONIC in the load generator). Server
CPU = user+sys of the server process (getrusage), read before a change and after every stream has
ACKed it. Variant A sends the ~60 KB Node on every request (Envoy's default), variant B on the
first only (`set_node_on_first_message_only`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
PY = sys.executable
STREAMS_PER_CONN = 1000
CORES = sorted(os.sched_getaffinity(0))
SERVER_CORE, CLIENT_CORES = CORES[0], (CORES[1:] or CORES[:1])


@dataclass
class Config:
    quick: bool
    clients: int
    node_bytes: int
    profile: bool
    out: Path
    peer: str = ""
    rounds: int = 3
    shapes: str = ""  # side-by-side shapes to run: comma list of numbers (1-5), all if empty
    debounce: str = ""  # eds-server's --debounce in the cores scenario ("": its default)
    floor: bool = True  # run bench/floor.py beside eds-server in sidebyside and cores
    streams: int = 0  # streams of the cores scenario's shape 4 (0: 100,000)
    memory_cap: float = 16e9  # bytes a cores round may add to the machine's used memory before it is stopped
    own_addresses: bool = False  # cores: each load generator connection from its own loopback address
    connect_rate: float = 0.0  # cores: connections opened per second in all (0: all at once)
    peer_eds: bool = False  # cores: the peer is an eds-server (another version): the canary runs beside it too

    def size(self, full: int) -> int:
        return max(1, full // 10) if self.quick else full


class Child:
    """A JSON-lines child process (server or load generator)."""

    def __init__(self, args: list[str], log: IO[str]) -> None:
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.hello = self.recv()

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.p.args!r} exited ({self.p.wait()}); see bench/results/*.log")
        return json.loads(line)

    def ask(self, line: str) -> Any:
        self.send(line)
        return self.recv()

    def stop(self, quit_line: str) -> None:
        try:
            self.send(quit_line)
            self.p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


class Workers:
    """Load generator processes; connections are dealt out round-robin."""

    def __init__(self, n: int, node_bytes: int, log: IO[str]) -> None:
        args = [
            PY,
            str(HERE / "loadgen.py"),
            "--cpus",
            ",".join(map(str, CLIENT_CORES)),
            "--node-bytes",
            str(node_bytes),
        ]
        self.procs = [Child(args, log) for _ in range(n)]

    def all(self, cmds: list[dict[str, Any]]) -> list[Any]:
        for p, c in zip(self.procs, cmds, strict=True):
            p.send(json.dumps(c))
        return [p.recv() for p in self.procs]

    def open(
        self,
        port: int,
        groups: list[str],
        node_every: bool,
        per_conn: int = STREAMS_PER_CONN,
        own_addresses: bool = False,
        rate: float = 0.0,
    ) -> list[Any]:
        """`own_addresses`: each connection from its own loopback address (127.1.0.1 on), as a
        fleet of Envoys on their own hosts meets a server's per-address limits; else all from 127.0.0.1.
        `rate`: connections opened per second in all, as a fleet reconnecting over time (0: all at once)."""
        conns = [groups[i : i + per_conn] for i in range(0, len(groups), per_conn)]
        n = len(self.procs)
        mine: list[list[list[str]]] = [conns[i::n] for i in range(n)]
        cmds: list[dict[str, Any]] = [{"cmd": "open", "port": port, "conns": c, "node_every": node_every} for c in mine]
        if rate:
            for cmd in cmds:
                cmd["pace"] = n / rate
        if own_addresses:
            addresses = [f"127.{1 + (k >> 16)}.{k >> 8 & 255}.{k & 255}" for k in range(1, len(conns) + 1)]
            for i, cmd in enumerate(cmds):
                cmd["sources"] = addresses[i::n]
        return self.all(cmds)

    def wait(self, targets: dict[str, str], timeout: float) -> int:
        """Streams still not there after `timeout` (0: all arrived)."""
        replies = self.all([{"cmd": "wait", "targets": targets, "timeout": timeout}] * len(self.procs))
        return sum(r["remaining"] for r in replies)

    def dump(self, clear: bool = False) -> dict[str, Any]:
        replies = self.all([{"cmd": "dump", "clear": clear}] * len(self.procs))
        return {
            "streams": [s for r in replies for s in r["streams"]],
            "errors": [e for r in replies for e in r["errors"]],
            "n_errors": sum(r["n_errors"] for r in replies),
            "cpu": sum(r["cpu"] for r in replies),
            "cpu_sys": sum(r["cpu_sys"] for r in replies),
            "t_start": min(r["t_start"] for r in replies),
        }

    def stop(self) -> None:
        for p in self.procs:
            p.stop(json.dumps({"cmd": "quit"}))


@contextmanager
def running(cfg: Config, name: str, clients: int) -> Iterator[tuple[Child, Workers]]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    with open(cfg.out / f"{name}.log", "w") as log:
        server = Child([PY, str(HERE / "server.py"), "--cpu", str(SERVER_CORE)], log)
        workers = Workers(max(1, min(cfg.clients, clients)), cfg.node_bytes, log)
        try:
            yield server, workers
        finally:
            workers.stop()
            server.stop("quit")


@contextmanager
def profiled(cfg: Config, pid: int, name: str) -> Iterator[None]:
    """With --profile, py-spy samples the server during the measured phase only (on a client core)."""
    if not cfg.profile:
        yield
        return
    out = str(cfg.out / f"{name}.folded")
    args = [str(Path(PY).parent / "py-spy"), "record", "-r", "250", "-f", "raw", "-o", out, "--pid"]
    spy = subprocess.Popen([*args, str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def dist(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs, default=math.nan)}


def wait_acks(server: Child, target: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (acks := server.ask("stats")["acks"]) < target and time.monotonic() < deadline:
        time.sleep(0.005)
    return int(acks)


def table(title: str, rows: Sequence[tuple[str, ...]]) -> None:
    print(f"\n{title}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.1f}" if x < 10 else f"{x * 1000:.0f}"


# -- scenarios ---------------------------------------------------------------------------------
def cpu(server: Child) -> float:
    return float(sum(server.ask("cpu")))


def paced_changes(cfg: Config, name: str, server: Child, workers: Workers, n: int, streams: int) -> dict[str, Any]:
    """`n` changes to the group g0, each delivered to and ACKed by every stream before the next."""
    workers.dump(clear=True)
    acks = wait_acks(server, streams, 30)  # a fresh server: the first responses' ACKs
    changes, (user0, sys0), c_client0 = [], server.ask("cpu"), workers.dump()["cpu"]
    t0 = time.monotonic()
    with profiled(cfg, server.hello["pid"], name):
        for _ in range(n):
            c0 = cpu(server)
            ch = server.ask("change g0")
            ch["missing"] = workers.wait({"g0": ch["version"]}, 60)
            acks = wait_acks(server, acks + streams, 30)
            ch["cpu"] = cpu(server) - c0
            changes.append(ch)
    wall = time.monotonic() - t0
    user1, sys1 = server.ask("cpu")
    total = user1 + sys1 - user0 - sys0
    d = workers.dump()
    per_stream = [dict(recv) for _, recv, _ in d["streams"]]
    lat, last = [], []
    for ch in changes:
        got = [(r[ch["version"]] - ch["t"]) / 1e9 for r in per_stream if ch["version"] in r]
        lat += got
        last.append(max(got, default=math.nan))
    return {
        "changes": len(changes),
        "undelivered": sum(c["missing"] for c in changes),
        "latency_s": dist(lat),
        "last_stream_s": dist(last),
        "cpu_per_change_s": {
            "median": statistics.median(c["cpu"] for c in changes),
            "mean": total / n,
            "sys_share": (sys1 - sys0) / total,
        },
        "store_update_cpu_s": statistics.median(c["upd_cpu"] for c in changes),
        "response_bytes": max(s[2] for s in d["streams"]),
        "client_cpu_share": (d["cpu"] - c_client0) / wall,
        "errors": d["errors"],
        "n_errors": d["n_errors"],
    }


def scenario_fanout(cfg: Config) -> dict[str, Any]:
    streams, endpoints, n = cfg.size(1000), cfg.size(1000), 20
    out: dict[str, Any] = {"streams": streams, "endpoints": endpoints}
    for variant in ("B", "A"):
        with running(cfg, f"fanout-{variant}", 1) as (server, workers):
            server.ask(f"set 1 {endpoints}")
            hello = workers.open(server.hello["port"], ["g0"] * streams, node_every=variant == "A")
            if workers.wait({}, 60):
                raise RuntimeError("fan-out: not every stream got its first response")
            out[variant] = {
                "node_bytes": hello[0]["node_bytes"],
                **paced_changes(cfg, f"fanout-{variant}", server, workers, n, streams),
            }
    rows = [
        (
            "variant",
            "changes",
            "p50 ms",
            "p99 ms",
            "max ms",
            "last p50",
            "last max",
            "CPU/chg ms",
            "sys %",
            "update ms",
            "resp KB",
            "client CPU",
        )
    ]
    for v in ("A", "B"):
        r = out[v]
        rows.append(
            (
                v,
                str(r["changes"]),
                ms(r["latency_s"]["p50"]),
                ms(r["latency_s"]["p99"]),
                ms(r["latency_s"]["max"]),
                ms(r["last_stream_s"]["p50"]),
                ms(r["last_stream_s"]["max"]),
                ms(r["cpu_per_change_s"]["median"]),
                f"{r['cpu_per_change_s']['sys_share']:.0%}",
                ms(r["store_update_cpu_s"]),
                f"{r['response_bytes'] / 1000:.0f}",
                f"{r['client_cpu_share']:.0%}",
            )
        )
    table(f"fan-out: {streams} streams on one group of {endpoints} endpoints", rows)
    return out


def scenario_churn(cfg: Config) -> dict[str, Any]:
    groups, rate, seconds = cfg.size(1000), 200.0, (5.0 if cfg.quick else 30.0)
    out: dict[str, Any] = {"groups": groups, "endpoints": 10, "rate": rate, "seconds": seconds}
    for variant in ("B", "A"):
        with running(cfg, f"churn-{variant}", 1) as (server, workers):
            server.ask(f"set {groups} 10")
            names = [f"g{i}" for i in range(groups)]
            workers.open(server.hello["port"], names, node_every=variant == "A")
            if workers.wait({}, 60):
                raise RuntimeError("churn: not every stream got its first response")
            seq = {n: {v: 0} for n, v in server.ask("versions").items()}
            workers.dump(clear=True)
            c0 = cpu(server)
            with profiled(cfg, server.hello["pid"], f"churn-{variant}"):
                changes = server.ask(f"churn {rate} {seconds} 1")
            t_end = changes[-1][1]
            final = {}
            for _, _, g, v in changes:
                seq[g][v] = len(seq[g])
                final[g] = v
            missing = workers.wait(final, 30)
            cpu_s = cpu(server) - c0
            d = workers.dump()
        arrivals: dict[str, list[tuple[int, int]]] = {}
        for g, recv, _ in d["streams"]:
            arrivals[g] = [(seq[g].get(v, -1), t) for v, t in recv]
        index = {g: 0 for g in seq}
        lat: list[float] = []
        lag: list[float] = []
        first5: list[float] = []
        last5: list[float] = []
        late_at_end = lost = 0
        t_first, window = changes[0][1], min(5.0, seconds / 3) * 1e9
        for due, t, g, v in changes:
            k, got = seq[g][v], arrivals.get(g, [])
            i = index[g]
            while i < len(got) and got[i][0] < k:
                i += 1
            index[g] = i
            lag.append((t - due) / 1e9)
            if i == len(got):
                lost += 1
                continue
            x = (got[i][1] - t) / 1e9
            lat.append(x)
            (first5 if t - t_first < window else last5 if t_end - t < window else []).append(x)
            late_at_end += t < t_end - 1e9 and got[i][1] > t_end
        out[variant] = {
            "changes": len(changes),
            "achieved_rate": len(changes) / max(1e-9, (t_end - t_first) / 1e9),
            "latency_s": dist(lat),
            "first_5s_s": dist(first5),
            "last_5s_s": dist(last5),
            "handoff_lag_s": dist(lag),
            "undelivered_at_end_older_than_1s": late_at_end,
            "never_delivered": lost,
            "streams_not_final": missing,
            "server_cpu_share": cpu_s / ((t_end - t_first) / 1e9 + 1e-9),
            "n_errors": d["n_errors"],
            "errors": d["errors"],
        }
    rows = [
        (
            "variant",
            "changes",
            "rate/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "first5 p99",
            "last5 p99",
            "lag p99 ms",
            "stale@end",
            "lost",
            "server CPU",
        )
    ]
    for v in ("A", "B"):
        r = out[v]
        rows.append(
            (
                v,
                str(r["changes"]),
                f"{r['achieved_rate']:.0f}",
                ms(r["latency_s"]["p50"]),
                ms(r["latency_s"]["p99"]),
                ms(r["latency_s"]["max"]),
                ms(r["first_5s_s"]["p99"]),
                ms(r["last_5s_s"]["p99"]),
                ms(r["handoff_lag_s"]["p99"]),
                str(r["undelivered_at_end_older_than_1s"]),
                str(r["never_delivered"]),
                f"{r['server_cpu_share']:.0%}",
            )
        )
    table(f"churn: {groups} groups x 10 endpoints, {groups} streams, {rate:.0f} changes/s for {seconds:.0f} s", rows)
    return out


def scenario_memory(cfg: Config) -> dict[str, Any]:
    streams, groups = cfg.size(10_000), cfg.size(1000)
    with running(cfg, "memory", 4) as (server, workers):
        server.ask(f"set {groups} 10")
        rss0 = server.ask("rss")
        workers.open(server.hello["port"], [f"g{i % groups}" for i in range(streams)], node_every=False)
        missing = workers.wait({}, 120)
        time.sleep(1)
        rss1, opened = server.ask("rss"), server.ask("stats")["streams_open"]
        workers.all([{"cmd": "close"}] * len(workers.procs))
        deadline = time.monotonic() + 30
        while server.ask("stats")["streams_open"] and time.monotonic() < deadline:
            time.sleep(0.1)
        rss2 = server.ask("rss")
    out = {
        "streams": streams,
        "streams_open": opened,
        "missing": missing,
        "rss_before": rss0,
        "rss_after": rss1,
        "rss_after_close": rss2,
        "bytes_per_stream": (rss1 - rss0) / max(1, opened),
    }
    table(
        f"memory: {streams} idle open streams ({groups} groups x 10 endpoints)",
        [
            ("streams", "open", "RSS before MB", "RSS open MB", "KB per stream", "RSS after close MB"),
            (
                str(streams),
                str(opened),
                f"{rss0 / 1e6:.0f}",
                f"{rss1 / 1e6:.0f}",
                f"{out['bytes_per_stream'] / 1000:.1f}",
                f"{rss2 / 1e6:.0f}",
            ),
        ],
    )
    return out


def scenario_storm(cfg: Config) -> dict[str, Any]:
    streams, groups = cfg.size(5000), cfg.size(1000)
    with running(cfg, "storm", 4) as (server, workers):
        server.ask(f"set {groups} 10")
        c0 = cpu(server)
        with profiled(cfg, server.hello["pid"], "storm"):
            workers.open(server.hello["port"], [f"g{i % groups}" for i in range(streams)], node_every=False)
            missing = workers.wait({}, 60)
        cpu_s = cpu(server) - c0
        d = workers.dump()
    t0 = d["t_start"]
    first = [(recv[0][1] - t0) / 1e9 for _, recv, _ in d["streams"] if recv]
    out = {
        "streams": streams,
        "connections": math.ceil(streams / STREAMS_PER_CONN),
        "missing": missing,
        "first_response_s": dist(first),
        "all_s": max(first, default=math.nan),
        "server_cpu_s": cpu_s,
        "n_errors": d["n_errors"],
        "errors": d["errors"],
    }
    table(
        f"reconnect storm: {streams} streams on {out['connections']} connections at once",
        [
            ("first resp p50 s", "p99 s", "all s", "server CPU s", "missing", "errors"),
            (
                f"{out['first_response_s']['p50']:.2f}",
                f"{out['first_response_s']['p99']:.2f}",
                f"{out['all_s']:.2f}",
                f"{cpu_s:.2f}",
                str(missing),
                str(d["n_errors"]),
            ),
        ],
    )
    return out


def scenario_big(cfg: Config) -> dict[str, Any]:
    endpoints, streams, n = cfg.size(10_000), 10, 20
    with running(cfg, "big", 1) as (server, workers):
        set_cpu = server.ask(f"set 1 {endpoints}")["cpu"]
        workers.open(server.hello["port"], ["g0"] * streams, node_every=False)
        if workers.wait({}, 60):
            raise RuntimeError("big group: not every stream got its first response")
        out = {
            "endpoints": endpoints,
            "streams": streams,
            "initial_set_cpu_s": set_cpu,
            **paced_changes(cfg, "big", server, workers, n, streams),
        }
    table(
        f"big group: one endpoint changed in a {endpoints}-endpoint group, {streams} streams",
        [
            ("changes", "CPU/chg ms", "store.update ms", "p50 ms", "p99 ms", "max ms", "resp KB"),
            (
                str(n),
                ms(out["cpu_per_change_s"]["median"]),
                ms(out["store_update_cpu_s"]),
                ms(out["latency_s"]["p50"]),
                ms(out["latency_s"]["p99"]),
                ms(out["latency_s"]["max"]),
                f"{out['response_bytes'] / 1000:.0f}",
            ),
        ],
    )
    return out


def scenario_sidebyside(cfg: Config) -> dict[str, Any]:
    from sidebyside import scenario_sidebyside as run  # imports this module

    return run(cfg)


def scenario_cores(cfg: Config) -> dict[str, Any]:
    from cores import scenario_cores as run  # imports this module

    return run(cfg)


SCENARIOS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "fanout": scenario_fanout,
    "churn": scenario_churn,
    "memory": scenario_memory,
    "storm": scenario_storm,
    "big": scenario_big,
    "sidebyside": scenario_sidebyside,
    "cores": scenario_cores,
}


def summary(results: dict[str, dict[str, Any]]) -> None:
    rows: list[tuple[str, ...]] = [("scenario", "figure", "measured", "target", "")]

    def row(scn: str, what: str, value: float, target: float | None, unit: str, fmt: str = "{:.0f}") -> None:
        ok = "" if math.isnan(value) or target is None else "ok" if value <= target else "MISSED"
        goal = "-" if target is None else f"<= {fmt.format(target)} {unit}"
        rows.append((scn, what, fmt.format(value) + f" {unit}", goal, ok))

    if f := results.get("fanout"):
        for v, cpu_target in (("B", 0.1), ("A", 0.2)):
            row(
                f"fan-out {v}",
                "server CPU per change (median)",
                f[v]["cpu_per_change_s"]["median"] * 1000,
                cpu_target * 1000,
                "ms",
            )
            row(
                f"fan-out {v}",
                "delivery p99 (all stream x change)",
                f[v]["latency_s"]["p99"] * 1000,
                250 if v == "B" else None,
                "ms",
                "{:.1f}",
            )
    if c := results.get("churn"):
        for v in ("B", "A"):
            row(
                f"churn {v}", "delivery p99 (no debounce in path)", c[v]["latency_s"]["p99"] * 1000, 100, "ms", "{:.1f}"
            )
            row(
                f"churn {v}",
                "stale undelivered at end + lost",
                c[v]["undelivered_at_end_older_than_1s"] + c[v]["never_delivered"],
                0,
                "changes",
            )
    if m := results.get("memory"):
        row("memory", f"RSS per idle stream ({m['streams']})", m["bytes_per_stream"] / 1000, 50, "KB", "{:.1f}")
    if s := results.get("storm"):
        row("storm", f"all {s['streams']} streams answered", s["all_s"], 10, "s", "{:.2f}")
    if b := results.get("big"):
        row(
            "big group",
            f"server CPU per change ({b['endpoints']} eps)",
            b["cpu_per_change_s"]["median"] * 1000,
            20,
            "ms",
            "{:.1f}",
        )
        row("big group", "store.update CPU per change", b["store_update_cpu_s"] * 1000, 20, "ms", "{:.1f}")
    table(f"summary (server pinned to core {SERVER_CORE}, load generators to core(s) {CLIENT_CORES})", rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: sizes / 10, churn for 5 s")
    p.add_argument("--only", default="", help="comma list of: " + ", ".join(SCENARIOS))
    p.add_argument("--node-bytes", type=int, default=60_000, help="size of the Node sent by the load generators")
    p.add_argument("--clients", type=int, default=4, help="most load generator processes per scenario")
    p.add_argument("--profile", action="store_true", help="record each server with py-spy (installed in the venv)")
    p.add_argument("--time-limit", type=int, default=900, help="seconds allowed per scenario")
    p.add_argument(
        "--peer",
        default="",
        metavar="COMMAND",
        help="another xDS server's command (shell words), run side by side with eds-server",
    )
    p.add_argument(
        "--rounds", type=int, default=0, help="interleaved rounds of sidebyside and cores (default 3; 1 with --quick)"
    )
    p.add_argument("--shapes", default="", help="side-by-side shapes to run, e.g. 2,3 (default: all five)")
    p.add_argument("--debounce", default="", help="eds-server's --debounce in the cores scenario (default: its own)")
    p.add_argument(
        "--no-floor", action="store_true", help="leave out the floor (bench/floor.py) in sidebyside and cores"
    )
    p.add_argument("--streams", type=int, default=0, help="streams of cores' shape 4 (default 100000)")
    p.add_argument(
        "--own-addresses",
        action="store_true",
        help="cores: each load generator connection from its own loopback address (127.1.0.1 on)",
    )
    p.add_argument(
        "--connect-rate", type=float, default=0, help="cores: connections opened per second (default: all at once)"
    )
    p.add_argument(
        "--memory-cap", type=float, default=16, help="GB of memory use a cores round may add before it is stopped"
    )
    p.add_argument(
        "--peer-eds", action="store_true", help="cores: the peer is another eds-server, run with the canary too"
    )
    args = p.parse_args()
    if args.profile and not (Path(PY).parent / "py-spy").exists():
        p.error(f"--profile needs py-spy beside {PY}: {Path(PY).parent / 'pip'} install py-spy")
    args.rounds = max(1, args.rounds or (1 if args.quick else 3))
    default = [n for n in SCENARIOS if n != "cores" or args.peer]
    names = [n for n in args.only.split(",") if n] or default
    for n in names:
        if n not in SCENARIOS:
            p.error(f"unknown scenario {n!r}")
    os.sched_setaffinity(0, set(CLIENT_CORES))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # the load generators inherit it: a thousand connections and more in cores' shape 4
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = HERE / "results" / ("profile" if args.profile else "") / ("quick" if args.quick else "")
    cfg = Config(
        args.quick,
        args.clients,
        args.node_bytes,
        args.profile,
        out,
        args.peer,
        args.rounds,
        args.shapes,
        args.debounce,
        not args.no_floor,
        args.streams,
        args.memory_cap * 1e9,
        args.own_addresses,
        args.connect_rate,
        args.peer_eds,
    )

    def too_long(*_: Any) -> None:
        raise TimeoutError("scenario exceeded --time-limit")

    signal.signal(signal.SIGALRM, too_long)
    results: dict[str, dict[str, Any]] = {}
    for n in names:
        signal.alarm(args.time_limit * (args.rounds * 2 if n in ("sidebyside", "cores") else 1))  # per round and server
        started = time.monotonic()
        results[n] = SCENARIOS[n](cfg)
        signal.alarm(0)
        results[n]["wall_s"] = time.monotonic() - started
        (cfg.out / f"{n}.json").write_text(json.dumps(results[n], indent=1) + "\n")
    summary(results)


if __name__ == "__main__":
    # Scenario modules `import run`: let them share this module rather than load a second copy, which
    # would work out the cores after main() narrowed this process to the client cores (and so put the
    # server under test on a client core).
    sys.modules.setdefault("run", sys.modules[__name__])
    main()
