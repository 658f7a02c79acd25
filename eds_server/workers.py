"""`--workers N`: one process owns the sources and the store, N worker processes serve Envoy.

Each worker serves `--listen` on a socket its owner bound and handed over (worker_process.py: one
SO_REUSEPORT socket per worker, the kernel spreads new connections among them) and is a relay
(sources/relay.py) of its owner, over delta xDS on a Unix socket in a directory only they may enter
(no other local user reads groups past `--authz` there): the same mechanism as a relay tier, not a
second one, so a worker serves the owner's versions and an Envoy that moves to another worker is
sent nothing again.

A worker tells its owner "started" (listening) and "serving" (its relay loaded) on a pipe. The owner
restarts a worker that dies (new connections go to the live ones meanwhile), gives up after
MAX_FAILED_STARTS starts in a row that never got to "started" (exit 1: a supervisor sees it), moves
load back to a restarted worker, drains them all on stop, and answers for all of them on its admin
port: streams, stats and metrics are read from each worker's admin over a Unix socket in the private
directory when asked for, and added up here (prometheus-client's multiprocess mode cannot take the
live collectors every process uses); counters carry on across a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from . import gc_settings
from .settings import RegistrationSettings, SecuritySettings
from .sources.relay import UpstreamOptions
from .startup import refuse_security, setup_logging, start_app
from .worker_process import (
    BOOTSTRAP,
    Steering,
    bind_listeners,
    make_private_directory,
    owner_alive,
    told_to_stop,
)

if TYPE_CHECKING:
    from .app import App
    from .settings import Settings

log = logging.getLogger("eds_server.workers")

# Metric families that count what each worker serves: summed over the workers (the owner's own
# values count its links to the workers, not Envoys).
SERVED = frozenset(
    {
        "eds_streams_open",
        "eds_streams_opened",
        "eds_requests",
        "eds_responses",
        "eds_acks",
        "eds_nacks",
        "eds_clients_dropped",
        "eds_streams_refused",
        "eds_requests_denied",
        "eds_connections_open",
        "eds_refused",
        "eds_group_nacks",
        "eds_push_latency_seconds",
    }
)
# Summed over every process, the owner included: the host's cost of the whole server.
WHOLE = frozenset(
    {"process_cpu_seconds", "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_open_fds"}
)
RESTART_DELAY = (0.5, 30.0)  # first and longest wait before restarting a worker that died
START_TIMEOUT = 30.0  # a worker not listening by then is killed: a failed start
MAX_FAILED_STARTS = 3  # failed starts in a row of one worker before the owner gives up (exit status 1)
FETCH_TIMEOUT = 5.0
WORKER_EXIT = 2.0  # past --shutdown-timeout (each worker's own drain), for a worker's process to exit
SHED_STREAMS = 50  # streams at most asked to move at a time when load goes back to a restarted worker
REBALANCE_ROUNDS = 40
SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]  # family, sample name, labels


def worker_settings(settings: Settings, owner: str, admin_unix: str) -> Settings:
    """What a worker runs: the Envoy-facing half of `settings`, fed by the owner (its listening socket
    is handed over when it starts)."""
    relay = UpstreamOptions("localhost", 0, path=owner)
    sources = dataclasses.replace(
        settings.sources,
        upstreams=None,
        docker=None,
        swarm=None,
        kubernetes=None,
        startup_timeout=None,
        upstream_eds=relay,
    )
    return dataclasses.replace(
        settings,
        sources=sources,
        registrations=RegistrationSettings(),
        transport=dataclasses.replace(settings.transport, rest_listen=None),
        admin=dataclasses.replace(settings.admin, address=None),
        workers=dataclasses.replace(settings.workers, admin_unix=admin_unix),
    )


def owner_settings(settings: Settings, directory: str) -> Settings:
    """What the owner runs: the sources, the admin and REST ports, and gRPC for its workers alone, on a
    Unix socket in its private directory (TLS and authorization are the workers', facing Envoy)."""
    return dataclasses.replace(
        settings,
        transport=dataclasses.replace(settings.transport, listen=("127.0.0.1", 0)),
        workers=dataclasses.replace(settings.workers, listen_unix=owner_socket(directory)),
        security=SecuritySettings(),
    )


def owner_socket(directory: str) -> str:
    return os.path.join(directory, "owner.sock")


@dataclass
class Worker:
    index: int
    listener: socket.socket  # the owner's, held for its whole life: the worker's is a copy
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    serving: bool = False  # answering Envoy: its relay of the owner is loaded
    # Counter samples of its current process as last read, and what its dead predecessors had
    # counted: the sums on /metrics carry on across a restart instead of going back.
    seen: dict[SampleKey, float] = field(default_factory=dict)
    carried: dict[SampleKey, float] = field(default_factory=dict)
    control: int | None = None  # the pipe on which it is told "stop" before an orderly SIGTERM

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def carry(self) -> None:
        for key, value in self.seen.items():
            self.carried[key] = self.carried.get(key, 0.0) + value
        self.seen = {}


class WorkerPool:
    """The owner's view of its workers: runs, restarts and stops them, and reads their admin."""

    def __init__(self, directory: str, log_level: str, log_format: str, listeners: list[socket.socket]) -> None:
        self.workers = [Worker(i + 1, sock) for i, sock in enumerate(listeners)]
        self.directory = directory
        self.log_level, self.log_format = log_level, log_format
        self.steering = Steering(listeners)
        self.failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # why the owner gives up
        self.all_serving = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._kinds: dict[str, tuple[str, str]] = {}  # metric family -> (type, help), as the workers said
        self._rebalancing: asyncio.Task[None] | None = None

    def socket(self, worker: Worker) -> str:
        return os.path.join(self.directory, f"worker-{worker.index}.sock")

    def write_settings(self, settings: Settings) -> None:
        for worker in self.workers:
            path = os.path.join(self.directory, f"worker-{worker.index}.settings")
            with open(path, "wb") as f:
                pickle.dump(worker_settings(settings, owner_socket(self.directory), self.socket(worker)), f)

    async def start(self) -> None:
        """Start every worker now (their imports overlap the owner's start), then watch them."""
        for worker in self.workers:
            lines = await self._spawn(worker)
            self._tasks.append(asyncio.create_task(self._supervise(worker, lines), name=f"worker {worker.index}"))

    async def _spawn(self, worker: Worker) -> asyncio.StreamReader:
        """Start the worker's process; the reader of the lines it says of itself ("started", "serving")."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket(worker))
        loop = asyncio.get_running_loop()
        read, write = os.pipe()  # the worker's lines to us
        control, told = os.pipe()  # ours to it: "stop" before an orderly SIGTERM
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                BOOTSTRAP,
                str(os.getpid()),
                self.directory,
                str(worker.index),
                self.log_level,
                self.log_format,
                str(write),
                str(control),
                str(worker.listener.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(write, control, worker.listener.fileno()),
            )
        except BaseException:
            os.close(read)
            os.close(told)
            raise
        finally:
            os.close(write)
            os.close(control)
        if worker.control is not None:
            os.close(worker.control)
        worker.control = told
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read, "rb", buffering=0))
        worker.started_at = time.monotonic()
        log.info("worker %d starting (pid %d)", worker.index, worker.process.pid)
        return reader

    async def _supervise(self, worker: Worker, lines: asyncio.StreamReader) -> None:
        """Watch and restart one worker; give up (self.failed) after MAX_FAILED_STARTS in a row."""
        delay, failures = RESTART_DELAY[0], 0
        while True:
            assert worker.process is not None
            started = await self._follow(worker, lines)
            code = await worker.process.wait()
            worker.serving = False
            worker.carry()
            if self._stopping:
                return
            self._steer_to_serving()
            how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            if not started:
                failures += 1
                if failures >= MAX_FAILED_STARTS:
                    reason = f"worker {worker.index} failed to start {failures} times in a row (last: {how})"
                    if not self.failed.done():
                        self.failed.set_result(reason)
                    return
            else:
                failures = 0
            if time.monotonic() - worker.started_at > 60:
                delay = RESTART_DELAY[0]  # it ran a while: not a crash loop
            what = "could not start" if not started else "stopped"
            log.error(
                "worker %d (pid %d) %s: %s; its Envoys reconnect to the others; restarting it in %.1fs",
                worker.index,
                worker.process.pid,
                what,
                how,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(RESTART_DELAY[1], delay * 2)
            if self._stopping:
                return
            worker.restarts += 1
            while True:
                try:
                    lines = await self._spawn(worker)
                    break
                except OSError as e:  # out of processes or descriptors: a failed start, tried again
                    log.error("worker %d could not be started: %s", worker.index, e)
                    failures += 1
                    if failures >= MAX_FAILED_STARTS:
                        if not self.failed.done():
                            self.failed.set_result(f"worker {worker.index} could not be started: {e}")
                        return
                    await asyncio.sleep(delay)
                    if self._stopping:
                        return

    async def _follow(self, worker: Worker, lines: asyncio.StreamReader) -> bool:
        """Read what the worker says until it exits; whether it ever started (was listening)."""
        assert worker.process is not None
        try:
            line = await asyncio.wait_for(lines.readline(), START_TIMEOUT)
        except TimeoutError:
            log.error(
                "worker %d (pid %d) not started after %gs: killing it", worker.index, worker.process.pid, START_TIMEOUT
            )
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
            return False
        if line != b"started\n":
            return False
        while line := await lines.readline():
            if line == b"serving\n":
                worker.serving = True
                self._served(worker)
        return True

    def _served(self, worker: Worker) -> None:
        took = time.monotonic() - worker.started_at
        if not self.all_serving.is_set():
            if all(w.serving for w in self.workers):
                self.all_serving.set()
            return
        log.info(
            "worker %d serving again (pid %s, %.2fs after its start)",
            worker.index,
            worker.process.pid if worker.process else None,
            took,
        )
        self._steer_to_serving()
        if self._rebalancing is None or self._rebalancing.done():
            self._rebalancing = asyncio.create_task(self._rebalance(worker), name=f"load back to worker {worker.index}")

    async def _rebalance(self, fresh: Worker) -> None:
        """Bring load back to a restarted worker: new connections go to it alone while the busiest
        worker asks a few of its connections at a time (SHED_STREAMS streams at most, or one that
        narrows the gap) to reconnect; until the two are even, bounded in rounds. Each moved stream
        ends cleanly and reopens with its versions (nothing is sent again, no cluster is emptied)."""
        if not self.steering.steer([fresh.index - 1]):
            return  # the kernel's hash will bring connections back as Envoys reconnect
        try:
            for _ in range(REBALANCE_ROUNDS):
                counts = {w.index: stats["streams_open"] for w, stats in await self._each("/v1/stats")}
                if fresh.index not in counts or not fresh.serving or len(counts) < 2:
                    return
                busiest = max(counts, key=lambda i: counts[i])
                gap = counts[busiest] - counts[fresh.index]
                if busiest == fresh.index or gap < 2:
                    return
                answer = await self._post(
                    self.workers[busiest - 1],
                    "/v1/worker/shed",
                    {"streams": str(min(SHED_STREAMS, gap // 2)), "one_under": str(gap)},
                )
                if not answer.get("streams"):
                    return  # only connections too big to move without making it worse
                target = counts[fresh.index] + int(answer["streams"])
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10.0  # Envoy's backoff, then they reconnect; if not, the next round
                while await self._streams_of(fresh) < target and loop.time() < deadline:
                    await asyncio.sleep(0.1)
            counts = {w.index: stats["streams_open"] for w, stats in await self._each("/v1/stats")}
            log.info(
                "streams per worker after moving load to worker %d: %s",
                fresh.index,
                ", ".join(f"{i}: {n}" for i, n in sorted(counts.items())),
            )
        except Exception as e:  # a worker gone meanwhile: the kernel's hash does the rest
            log.debug("moving load to worker %d: %r", fresh.index, e)
        finally:
            self._steer_to_serving()

    async def _streams_of(self, worker: Worker) -> int:
        return int((await self._get(worker, "/v1/stats"))["streams_open"])

    def _steer_to_serving(self) -> None:
        """New connections to the workers that serve (none or all: the kernel's hash over all). A
        dead worker's socket keeps what was queued on it for its successor."""
        serving = [w.index - 1 for w in self.workers if w.serving]
        if not serving or len(serving) == len(self.workers):
            self.steering.spread()
        else:
            self.steering.steer(serving)

    def reload(self) -> None:
        """SIGHUP to every worker: each reads its TLS and authorization files again (App.reload)."""
        for worker in self.workers:
            if worker.alive and worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGHUP)

    async def stop(self, grace: float) -> None:
        """SIGTERM to every worker (each drains its streams), SIGKILL to those still up after `grace`."""
        self._stopping = True
        if self._rebalancing is not None:
            self._rebalancing.cancel()
        running = [w.process for w in self.workers if w.alive and w.process is not None]
        for worker in self.workers:
            if worker.alive and worker.process is not None and worker.control is not None:
                with contextlib.suppress(OSError):
                    os.write(worker.control, b"stop\n")
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), grace)
        except TimeoutError:
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.workers:  # one spawned while this began
            if worker.alive and worker.process is not None:
                worker.process.kill()
                await worker.process.wait()

    # -- reading the workers' admin ------------------------------------------------------------
    async def _get(self, worker: Worker, path: str) -> Any:
        import aiohttp

        connector = aiohttp.UnixConnector(path=self.socket(worker))
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.get(f"http://worker{path}") as response,
        ):
            if response.status != 503:  # /readyz answers 503 with a body
                response.raise_for_status()
            if path.startswith("/metrics"):
                return await response.text()
            return await response.json()

    async def _post(self, worker: Worker, path: str, query: dict[str, str]) -> Any:
        import aiohttp

        connector = aiohttp.UnixConnector(path=self.socket(worker))
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT + 5.0)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.post(f"http://worker{path}", params=query) as response,
        ):
            response.raise_for_status()
            return await response.json()

    async def _each(self, path: str) -> list[tuple[Worker, Any]]:
        """(worker, answer) for each live worker that answered `path`."""
        live = [w for w in self.workers if w.alive]
        answers = await asyncio.gather(*(self._get(w, path) for w in live), return_exceptions=True)
        out = []
        for worker, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                log.debug("worker %d: %s: %r", worker.index, path, answer)
                continue
            out.append((worker, answer))
        return out

    async def not_ready(self) -> list[int]:
        """The workers not serving yet (starting, restarting, or waiting for the owner's answer)."""
        answered = {w.index for w, r in await self._each("/readyz") if r.get("ready")}
        return [w.index for w in self.workers if w.index not in answered]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"worker": w.index, "pid": w.process.pid if w.process else None, "alive": w.alive, "restarts": w.restarts}
            for w in self.workers
        ]

    async def streams(self, after: int, limit: int) -> dict[str, Any]:
        """One page of every worker's streams. A stream's id here is its worker's id times the
        number of workers, plus the worker's index - 1: unique, and ordered within each worker."""
        n = len(self.workers)
        pages = await asyncio.gather(
            *(
                self._each_one(w, f"/v1/streams?after={max(0, (after - w.index + 1) // n)}&limit={limit}")
                for w in self.workers
                if w.alive
            )
        )
        streams: list[dict[str, Any]] = []
        total = 0
        for worker, page in pages:
            if page is None:
                continue
            total += page["total"]
            for s in page["streams"]:
                gid = s["id"] * n + worker.index - 1
                if gid > after:
                    streams.append({**s, "id": gid, "worker": worker.index})
        streams.sort(key=lambda s: s["id"])
        more = len(streams) > limit
        streams = streams[:limit]
        return {"streams": streams, "total": total, "next_after": streams[-1]["id"] if more else None}

    async def _each_one(self, worker: Worker, path: str) -> tuple[Worker, Any]:
        try:
            return worker, await self._get(worker, path)
        except Exception as e:  # a worker restarting: left out of this answer
            log.debug("worker %d: %s: %r", worker.index, path, e)
            return worker, None

    async def stats(self, own: dict[str, Any]) -> dict[str, Any]:
        """The workers' serving figures added up, the owner's store figures, and each worker."""
        total: dict[str, Any] = {}
        answers = await self._each("/v1/stats")
        for _, stats in answers:
            for key, value in stats.items():
                if key == "encodes":
                    continue
                if isinstance(value, bool) or not isinstance(value, int | float | dict):
                    total.setdefault(key, value)
                elif isinstance(value, dict):
                    into = total.setdefault(key, {})
                    for k, v in value.items():
                        into[k] = into.get(k, 0) + v
                else:
                    total[key] = total.get(key, 0) + value
        by_index = {w.index: s for w, s in answers}
        workers = [{**d, "streams_open": by_index.get(d["worker"], {}).get("streams_open")} for d in self.describe()]
        return {**own, **total, "encodes": own.get("encodes"), "workers": workers}

    async def metrics(self, own: str) -> str:
        """The owner's exposition with the workers' serving series added up (see SERVED, WHOLE).
        Counters carry on across a worker's restart (Worker.carried), and a worker that does not
        answer counts with what it last said: a sum never goes back, so rate() holds."""
        answers = {w.index: text for w, text in await self._each("/metrics")}
        parts: list[dict[SampleKey, float]] = []
        for worker in self.workers:
            text = answers.get(worker.index)
            gauges: dict[SampleKey, float] = {}
            if text is not None:
                worker.seen, gauges = served_samples(text, self._kinds)
            part = dict(gauges)
            for key, value in [*worker.carried.items(), *worker.seen.items()]:
                part[key] = part.get(key, 0.0) + value
            parts.append(part)
        return merge_metrics(own, parts, self._kinds, self.describe())


Samples = dict[SampleKey, float]


def served_samples(text: str, kinds: dict[str, tuple[str, str]]) -> tuple[Samples, Samples]:
    """A worker's SERVED and WHOLE samples: (counters and histograms, gauges); each family's type
    and help noted in `kinds`."""
    counted: dict[SampleKey, float] = {}
    gauges: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in SERVED and family.name not in WHOLE:
            continue
        kinds[family.name] = (family.type, family.documentation)
        into = counted if family.type in ("counter", "histogram", "summary") else gauges
        for sample in family.samples:
            into[(family.name, sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return counted, gauges


def merge_metrics(
    own: str,
    parts: Iterable[dict[SampleKey, float]],
    kinds: dict[str, tuple[str, str]],
    described: list[dict[str, Any]],
) -> str:
    """One exposition for the whole server: the workers' samples (`parts`, one per worker, of the
    families in `kinds`) summed, WHOLE families with the owner's own, the rest the owner's."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

    families: dict[str, Metric] = {m.name: m for m in text_string_to_metric_families(own)}
    sums: dict[SampleKey, float] = {}
    for part in parts:
        for key, value in part.items():
            sums[key] = sums.get(key, 0.0) + value
    for family in families.values():
        if family.name in WHOLE and family.name in kinds:
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
    for name in SERVED:
        families.pop(name, None)  # the owner's links to its workers are not Envoy streams
    summed: dict[str, Metric] = {}
    for (name, sample_name, labels), value in sums.items():
        if name not in summed:
            kind, documentation = kinds[name]
            summed[name] = Metric(name, documentation, kind)
        summed[name].add_sample(sample_name, dict(labels), value)
    families.update(summed)
    alive = GaugeMetricFamily("eds_workers_alive", "Worker processes running (--workers)")
    alive.add_metric([], sum(1 for d in described if d["alive"]))
    restarts = CounterMetricFamily("eds_worker_restarts", "Worker processes restarted after dying", labels=["worker"])
    for d in described:
        restarts.add_metric([str(d["worker"])], d["restarts"])

    class _All(Collector):
        def collect(self) -> Iterable[Metric]:
            return [*families.values(), alive, restarts]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_All())
    return generate_latest(registry).decode()


async def serve_with_workers(settings: Settings, log_level: str, log_format: str) -> int:
    """The owner process: bind `--listen` for every worker, start them and the sources; drain on
    SIGTERM or SIGINT, reload on SIGHUP; exit 1 when a worker cannot start (MAX_FAILED_STARTS)."""
    from . import __version__, ports

    began = time.monotonic()
    net, count = settings.transport, settings.workers.count
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    pool: WorkerPool | None = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app: App | None = None
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(pool, app))
    log.info("eds-server %s starting with %d workers (Python %s)", __version__, count, sys.version.split()[0])
    if not _security_usable(settings):
        return 1
    taken = ports.every_unbindable(
        [
            ("--admin", settings.admin.address),
            ("--rest-listen", net.rest_listen),
            ("--metrics-listen", settings.admin.metrics_listen),
        ]
    )
    if taken:
        log.error("not starting: %s", "; ".join(taken))
        return 1
    host, port = net.listen
    try:
        listeners = bind_listeners(host, port, count)
    except OSError as e:
        reason = "address in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        log.error("not starting: --listen %s:%s: %s", host, port, reason)
        return 1
    log.info(
        "listening on %s:%s for %d worker processes (connections wait there until they serve)",
        host,
        listeners[0].getsockname()[1],
        count,
    )
    directory, lock = make_private_directory()
    try:
        pool = WorkerPool(directory, log_level, log_format, listeners)
        bound = dataclasses.replace(net, listen=(host, listeners[0].getsockname()[1]))
        pool.write_settings(dataclasses.replace(settings, transport=bound))
        await pool.start()  # the workers start while the sources load
        app = await start_app(owner_settings(settings, directory), workers=pool)
        if app is None:
            await pool.stop(1.0)
            return 1
        stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        serving: asyncio.Future[Any] = asyncio.ensure_future(pool.all_serving.wait())
        failed: asyncio.Future[Any] = pool.failed
        try:
            await asyncio.wait([stopped, serving, failed], return_when=asyncio.FIRST_COMPLETED)
            if serving.done() and not stopped.done() and not pool.failed.done():
                log.info(
                    "serving EDS (gRPC) on %s:%s with %d worker processes (every worker serving %.2fs after start)",
                    host,
                    listeners[0].getsockname()[1],
                    count,
                    time.monotonic() - began,
                )
                await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            serving.cancel()
        status = 0
        if pool.failed.done():
            log.error("not serving: %s (its lines above say why); stopping", pool.failed.result())
            status = 1
        else:
            log.info("shutting down: draining the workers")
        await pool.stop(net.shutdown_grace + WORKER_EXIT)
        return status
    finally:
        if app is not None:
            await app.stop()
            gc_settings.before_exit()
        for sock in listeners:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock)


def _reload(pool: WorkerPool | None, app: App | None) -> None:
    log.info(
        "SIGHUP: the workers read their TLS and authorization files again (the owner's own: its admin port's "
        "with --admin-tls; the upstreams file is followed as it changes)"
    )
    if pool is not None:
        pool.reload()
    if app is not None:
        app.reload_admin_tls()


def _security_usable(settings: Settings) -> bool:
    """The workers' TLS and authorization files, checked before anything starts: a bad one stops the
    start with the file named, rather than every worker dying on it over and over."""
    from . import security
    from .security import SecurityConfigError

    try:
        tls = settings.security
        if tls.tls_cert:
            security.server_ssl_context(tls.tls_cert, tls.tls_key, tls.tls_client_ca)
        if tls.authz:
            security.load_authz(tls.authz)
    except SecurityConfigError as e:
        refuse_security(e)
        return False
    return True


def worker_main(argv: list[str]) -> int:
    """A worker process: `OWNER_PID DIRECTORY INDEX LOG_LEVEL LOG_FORMAT STATUS_FD CONTROL_FD LISTEN_FD`, run by
    worker_process.BOOTSTRAP; its settings pickled by the owner in its private directory. Says
    "started" then "serving" on STATUS_FD; ends on SIGTERM (also sent by the kernel when its owner
    dies), and when it finds its owner gone."""
    import uvloop

    owner, directory, index, level, fmt, status, control, listen = argv
    setup_logging(level, fmt)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Prefix(f"worker {index}: "))
    with open(os.path.join(directory, f"worker-{index}.settings"), "rb") as f:
        settings = pickle.load(f)  # written by our owner, in a directory only it (and we) may write
    settings = dataclasses.replace(settings, workers=dataclasses.replace(settings.workers, listen_fd=int(listen)))
    return int(uvloop.run(_work(settings, int(owner), directory, int(status), int(control))))


async def _work(settings: Settings, owner: int, directory: str, status: int, control: int) -> int:
    app = await start_app(settings)
    if app is None:
        return 1
    os.write(status, b"started\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.reload)
    announced = False
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05 if not announced else 1.0)
        if not announced and app.store.ready:
            with contextlib.suppress(OSError):
                os.write(status, b"serving\n")
            announced = True
        if not owner_alive(owner, status):
            break
    # A dying owner's threads each send the parent-death signal: the drain is not cut short by the next.
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    await app.stop()
    gc_settings.before_exit()
    # Not stopped by the owner: it is dying (its threads send the signal one by one), or gone.
    deadline = loop.time() + 1.0
    while not told_to_stop(control) and owner_alive(owner, status) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if not owner_alive(owner, status):
        log.warning("the owner process (pid %d) is gone: stopped, and removed its private directory", owner)
        shutil.rmtree(directory, ignore_errors=True)
    return 0


class _Prefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_prefixed", False):
            record.msg = self.prefix + str(record.msg)
            record._prefixed = True
        return True
