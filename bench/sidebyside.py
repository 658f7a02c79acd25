"""Side by side: eds-server and a peer xDS server, both driven through the upstreams file.

    .venv/bin/python bench/run.py --only sidebyside [--peer COMMAND] [--rounds 3] [--shapes 2,3] [--quick]

Each server is started as `COMMAND serve --upstreams FILE --listen HOST:PORT --admin HOST:PORT`
(eds-server: `python -m eds_server`), pinned to the server core, fed by rewriting FILE (a temp file
renamed over it, one endpoint's weight changed per change) and measured from outside: CPU from
/proc/PID/task/*/schedstat (nanoseconds, every thread), RSS from /proc/PID/status. The shapes are
the reference table's (below); each round runs every shape on eds-server, then on the peer (A B A B
...), and the table gives medians over rounds and the ratio eds-server / peer.

Each change sets one endpoint's weight to a new value (the others keep theirs), as an operator's
edit of one line would. A change counts from just before the file is renamed until every stream has received a new
response and the server's CPU has settled (its ACKs processed). Without --peer, the peer columns
hold the reference figures of go-control-plane's LinearCache, measured once on another day in the same
kind of VM with these client shapes (`Shape.reference`): a reference, not a same-run comparison.

The floor (bench/floor.py, unless --no-floor) runs in every round too, after eds-server: a bare
server that writes the same response bytes to every stream with one sendmsg per connection and
reads and drops the ACKs; eds-server / floor is what eds-server spends over writing the bytes.
"floor C" is the same server in C (bench/floor.c, when gcc is here): the floor without Python.
User and system CPU are given apart (from /proc/PID/stat, clock ticks, over all changes of a round).
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from run import CLIENT_CORES, CORES, SERVER_CORE, Config, Workers, profiled, table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the test helpers: tests.support
from tests.support.ports import free_port
from tests.support.server_process import write_atomically

EDS_SERVER = [sys.executable, "-m", "eds_server"]
FLOOR = [sys.executable, str(Path(__file__).resolve().parent / "floor.py")]
FLOOR_C = [*FLOOR, "--native"]  # bench/floor.c, compiled with gcc on first use


@dataclass(frozen=True)
class Shape:
    name: str
    streams: int
    endpoints: int
    node_every: bool
    changes: int
    # the reference run, before this bench: eds-server and go-control-plane CPU per change (ms), RSS per
    # stream (KB), what the side-by-side figures are compared with when no --peer is given
    reference: tuple[float, float, float | None, float | None]


SHAPES = [
    Shape("1k streams x 1k eps, Node every request", 1000, 1000, True, 5, (297, 477, 52, 361)),
    Shape("1k streams x 1k eps, Node first only", 1000, 1000, False, 5, (172, 80, 54, 251)),
    Shape("10k streams x 1k eps, Node first only", 10_000, 1000, False, 3, (1335, 1035, 53, 244)),
    Shape("100 streams x one group of 10k eps", 100, 10_000, False, 5, (640, 70, None, None)),
    Shape("1 stream x 1k eps (fixed cost)", 1, 1000, False, 10, (55, 5, None, None)),
]
PER_CONN = 100  # streams per HTTP/2 connection, as in the reference run
IDLE_WAIT = 2.0  # seconds between the last first response and the RSS of idle streams
# Every load generator connection comes from 127.0.0.1: eds-server's per-IP budgets, sized for one
# Envoy per IP, are raised for it, and the time a stream has to send its first request (10,000
# first requests of 60 KB take one core longer than 10 s). The environment reaches eds-server only.
PER_IP_ENV = {
    "EDS_STREAM_BUDGET": "1000000",
    "EDS_MAX_CONNECTIONS_PER_IP": "10000",
    "EDS_PARTIAL_MESSAGE_BUDGET": str(1 << 33),
    "EDS_REQUEST_TIMEOUT": "300s",
}


def upstreams_text(weights: list[int]) -> str:
    """Group g0, one endpoint per weight, one line each."""
    lines = ["groups:", "  g0:", "    endpoints:"]
    for i, weight in enumerate(weights):
        lines.append(f"      - {{address: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}, port: 8080, weight: {weight}}}")
    return "\n".join(lines) + "\n"


class Served:
    """A server process under test, measured from outside."""

    def __init__(
        self,
        command: list[str],
        upstreams: Path | None,
        log: IO[str],
        extra: list[str] | None = None,
        pin: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """`extra`: more arguments (e.g. `--workers 2`, `--upstream-eds ...` with no upstreams file);
        `pin`: on the server core (else on every core, as users run it); `env`: more variables."""
        self.port, self.admin = free_port(), free_port()
        admin = self.admin
        args = [
            *command,
            "serve",
            *(["--upstreams", str(upstreams)] if upstreams else []),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--admin",
            f"127.0.0.1:{admin}",
            *(extra or []),
        ]
        cores = {SERVER_CORE} if pin else set(CORES)
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, **PER_IP_ENV, **(env or {})},
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
        for _ in range(600):  # bounded: 60 s
            if self.p.poll() is not None:
                raise RuntimeError(f"{args!r} exited with {self.p.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{args!r} never listened")

    def pids(self) -> list[int]:
        """The server's process and its children (the workers of `--workers N`)."""
        out = [self.p.pid]
        for pid in out:  # grows as children are found
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        out.extend(int(c) for c in f.read().split())
            except OSError:
                pass  # ended meanwhile
        return out

    def cpu(self) -> float:
        """CPU seconds of every thread of every process, in nanosecond resolution (getrusage ticks are 10 ms)."""
        total = 0
        for pid in self.pids():
            task_dir = f"/proc/{pid}/task"
            try:
                tids = os.listdir(task_dir)
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"{task_dir}/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except OSError:
                    pass  # the thread ended meanwhile
        return total / 1e9

    def user_sys(self) -> tuple[float, float]:
        """User and system CPU seconds of the process and its children (clock ticks): where the time goes."""
        user = system = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            user, system = user + int(fields[11]), system + int(fields[12])
        tick = os.sysconf("SC_CLK_TCK")
        return user / tick, system / tick

    def rss(self) -> int:
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return total

    def settle(self, limit: float = 5.0) -> None:
        """Until the server's CPU stops moving (ACKs processed, buffers flushed), bounded."""
        last, deadline = self.cpu(), time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.cpu()
            if now - last < 0.002:
                return
            last = now

    def stop(self) -> None:
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def one_round(cfg: Config, shape: Shape, command: list[str], tag: str) -> dict[str, Any]:
    streams, endpoints = cfg.size(shape.streams), cfg.size(shape.endpoints)
    work = cfg.out / "sidebyside"
    work.mkdir(parents=True, exist_ok=True)
    path = work / "upstreams.yaml"
    weights = [1] * endpoints  # change k sets endpoint k's weight to k + 1: one endpoint per change
    write_atomically(path, upstreams_text(weights))
    with open(work / f"{tag}.log", "a") as log:
        server = Served(command, path, log)
        workers = Workers(max(1, min(cfg.clients, math.ceil(streams / 1000))), cfg.node_bytes, log)
        try:
            server.settle()
            rss0 = server.rss()
            python = command is EDS_SERVER  # py-spy samples Python servers only
            with profiled(cfg, server.p.pid, f"sidebyside-{tag}-connect") if python else contextlib.nullcontext():
                workers.open(server.port, ["g0"] * streams, shape.node_every, per_conn=PER_CONN)
                if workers.wait({}, 180):
                    raise RuntimeError(f"{tag}: not every stream got its first response")
            server.settle()
            time.sleep(IDLE_WAIT)  # idle: what either server gives back once a burst is over counts
            rss1 = server.rss()
            cpus = []
            user0, sys0 = server.user_sys()
            with profiled(cfg, server.p.pid, f"sidebyside-{tag}") if python else contextlib.nullcontext():
                for k in range(1, shape.changes + 1):
                    base = min(r["g0"] for r in workers.all([{"cmd": "counts"}] * len(workers.procs)))
                    c0 = server.cpu()
                    weights[k % endpoints] = k + 1
                    write_atomically(path, upstreams_text(weights))
                    missing = sum(
                        r["remaining"]
                        for r in workers.all(
                            [{"cmd": "wait", "counts": {"g0": base + 1}, "timeout": 120}] * len(workers.procs)
                        )
                    )
                    if missing:
                        raise RuntimeError(f"{tag}: change {k} missed {missing} streams")
                    server.settle()
                    cpus.append(server.cpu() - c0)
            user1, sys1 = server.user_sys()
            errors = workers.dump()["n_errors"]
            if errors:  # a refused or reset stream is not a stream served: the figure would mislead
                raise RuntimeError(f"{tag}: {errors} stream errors (refused, reset or ended early)")
        finally:
            workers.stop()
            server.stop()
    return {
        "cpu_per_change_s": statistics.median(cpus),
        "cpu_s": cpus,
        "rss_per_stream_b": (rss1 - rss0) / streams,
        "errors": errors,
        "user_s": user1 - user0,
        "sys_s": sys1 - sys0,
        "user_per_change_s": (user1 - user0) / len(cpus),
        "sys_per_change_s": (sys1 - sys0) / len(cpus),
    }


def chosen_shapes(spec: str) -> list[Shape]:
    """`--shapes 2,3`: the second and third shapes of SHAPES (all of them for "")."""
    if not spec:
        return SHAPES
    picked = [int(n) for n in spec.split(",") if n.strip()]
    if not picked or any(not 1 <= n <= len(SHAPES) for n in picked):
        raise SystemExit(f"--shapes: numbers from 1 to {len(SHAPES)}, got {spec!r}")
    return [SHAPES[n - 1] for n in picked]


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def cell(x: float, fmt: str = "{:.1f}") -> str:
    return "-" if math.isnan(x) else fmt.format(x)


def floors(cfg: Config) -> list[tuple[str, list[str]]]:
    """The floor servers of this run: Python, and C when gcc is here (none with --no-floor)."""
    if not cfg.floor:
        return []
    return [("floor", FLOOR)] + ([("floor C", FLOOR_C)] if shutil.which("gcc") else [])


def scenario_sidebyside(cfg: Config) -> dict[str, Any]:
    peer = shlex.split(cfg.peer) if cfg.peer else None
    shapes = chosen_shapes(cfg.shapes)
    servers = [("eds-server", EDS_SERVER), *floors(cfg)] + ([("peer", peer)] if peer else [])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {n: [] for n, _ in servers} for s in shapes}
    for r in range(cfg.rounds):
        for shape in shapes:
            for name, command in servers:  # A B C A B C ...: drift in the machine hits each alike
                results[shape.name][name].append(one_round(cfg, shape, command, f"{name.replace(' ', '_')}-r{r}"))
                got = results[shape.name][name][-1]["cpu_per_change_s"] * 1000
                us = results[shape.name][name][-1]
                print(
                    f"  round {r + 1}/{cfg.rounds} {shape.name} {name}: {got:.1f} ms/change "
                    f"(user {us['user_s']:.2f} s, system {us['sys_s']:.2f} s in all)",
                    flush=True,
                )
    out: dict[str, Any] = {
        "peer": cfg.peer,
        "floor": [n for n, _ in floors(cfg)],
        "rounds": cfg.rounds,
        "server_core": SERVER_CORE,
        "client_cores": CLIENT_CORES,
        "shapes": {},
    }
    peer_label = "peer" if peer else "gcp (reference)"
    refs = [n for n, _ in floors(cfg)] + ["peer"]  # what eds-server is put beside; JSON keys: floor_, floor_c_, peer_
    labels = {"peer": peer_label}
    rows = [("shape", "eds CPU/chg ms", "user/sys")]
    for ref in refs:
        rows[0] += (f"{labels.get(ref, ref)} CPU/chg ms", "user/sys", f"eds/{ref}")
    rows[0] += ("eds KB/stream", *(f"{labels.get(ref, ref)} KB/stream" for ref in refs), "eds/peer")
    for shape in shapes:
        per = results[shape.name]

        def med(name: str, key: str, scale: float, per: dict[str, list[dict[str, Any]]] = per) -> float:
            return statistics.median(x[key] for x in per[name]) * scale if per.get(name) else math.nan

        def figures(name: str) -> tuple[float, float, float, float]:
            """CPU, user, system per change (ms) and KB per stream: medians over rounds."""
            return (
                med(name, "cpu_per_change_s", 1000),
                med(name, "user_per_change_s", 1000),
                med(name, "sys_per_change_s", 1000),
                med(name, "rss_per_stream_b", 1e-3),
            )

        got = {name: figures(name) for name in ["eds-server", *refs]}
        if not peer:
            ref_rss = shape.reference[3] if shape.reference[3] is not None else math.nan
            got["peer"] = (shape.reference[1], math.nan, math.nan, ref_rss)
        eds = got["eds-server"]
        show_rss = shape.streams >= 1000
        entry: dict[str, Any] = {
            "streams": cfg.size(shape.streams),
            "endpoints": cfg.size(shape.endpoints),
            "node_every": shape.node_every,
            "eds_cpu_ms": eds[0],
            "eds_user_ms": eds[1],
            "eds_sys_ms": eds[2],
            "eds_rss_kb": eds[3],
            "peer_is_reference_figure": not peer,
            "reference_eds_cpu_ms": shape.reference[0],
        }
        row = (shape.name, cell(eds[0]), f"{cell(eds[1])}/{cell(eds[2])}")
        for ref in refs:
            key = ref.replace(" ", "_").lower()
            cpu_ms, user_ms, sys_ms, rss_kb = got[ref]
            entry |= {
                f"{key}_cpu_ms": cpu_ms,
                f"{key}_user_ms": user_ms,
                f"{key}_sys_ms": sys_ms,
                f"{key}_rss_kb": rss_kb,
            }
            entry["cpu_ratio" if ref == "peer" else f"cpu_ratio_{key}"] = ratio(eds[0], cpu_ms)
            row += (cell(cpu_ms), f"{cell(user_ms)}/{cell(sys_ms)}", cell(ratio(eds[0], cpu_ms), "{:.2f}"))
        row += tuple(cell(got[n][3]) if show_rss else "-" for n in ["eds-server", *refs])
        row += (cell(ratio(eds[3], got["peer"][3]), "{:.2f}") if show_rss else "-",)
        entry["rounds"] = per
        out["shapes"][shape.name] = entry
        rows.append(row)
    title = (
        f"side by side, medians of {cfg.rounds} interleaved rounds"
        if peer
        else (
            f"eds-server through its file, medians of {cfg.rounds} rounds, against go-control-plane's reference figures"
        )
    )
    title += ", with the floor (bench/floor.py, floor.c)" if cfg.floor else ""
    table(title + (" (QUICK: sizes / 10, not comparable)" if cfg.quick else ""), rows)
    return out
