"""`--workers N`: one process owns the sources and the store, N worker processes serve Envoy.

Each worker listens on the same `--listen` address (SO_REUSEPORT: the kernel spreads new
connections among them) and is a relay (sources/relay.py) of its owner, over delta xDS on a Unix
socket in a directory only they may enter (no other local user reads groups past `--authz` there):
the same mechanism as a relay tier, not a second one, so a worker serves the owner's versions and
an Envoy that moves to another worker is sent nothing again.

The owner restarts a worker that dies (Envoy reconnects to a live one meanwhile), drains them all
on stop, and answers for all of them on its admin port: streams, stats and metrics are read from
each worker's admin over a Unix socket in a private directory when asked for, and added up here
(prometheus-client's multiprocess mode cannot take the live collectors every process uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .registration_api import RegistrationPolicy
from .sources.relay import UpstreamOptions

if TYPE_CHECKING:
    from .app import Settings

log = logging.getLogger("eds_server.workers")

# Metric families that count what each worker serves: summed over the workers (the owner's own
# values count its links to the workers, not Envoys).
SERVED = frozenset({
    "eds_streams_open", "eds_streams_opened", "eds_requests", "eds_responses", "eds_acks", "eds_nacks",
    "eds_clients_dropped", "eds_streams_refused", "eds_requests_denied", "eds_connections_open", "eds_refused",
    "eds_group_nacks", "eds_push_latency_seconds",
})  # fmt: skip
# Summed over every process, the owner included: the host's cost of the whole server.
WHOLE = frozenset({"process_cpu_seconds", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                   "process_open_fds"})  # fmt: skip
RESTART_DELAY = (0.5, 30.0)  # first and longest wait before restarting a worker that died
FETCH_TIMEOUT = 5.0


def worker_settings(settings: Settings, owner: str, admin_unix: str) -> Settings:
    """What a worker runs: the Envoy-facing half of `settings`, fed by the owner."""
    return dataclasses.replace(
        settings, upstreams=None, docker=None, swarm=None, kubernetes=None, state=None, admin_token=None,
        registration_policy=RegistrationPolicy(), rest_listen=None, admin=None, admin_unix=admin_unix,
        startup_timeout=None, reuse_port=True, upstream_eds=UpstreamOptions("localhost", 0, path=owner),
    )  # fmt: skip


def owner_settings(settings: Settings, directory: str) -> Settings:
    """What the owner runs: the sources, the admin and REST ports, and gRPC for its workers alone, on a
    Unix socket in its private directory (TLS and authorization are the workers', facing Envoy)."""
    return dataclasses.replace(settings, listen=("127.0.0.1", 0), listen_unix=owner_socket(directory), tls_cert=None,
                               tls_key=None, tls_client_ca=None, authz=None, reuse_port=False)  # fmt: skip


def owner_socket(directory: str) -> str:
    return os.path.join(directory, "owner.sock")


@dataclass
class Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class WorkerPool:
    """The owner's view of its workers: runs, restarts and stops them, and reads their admin."""

    def __init__(self, count: int, directory: str, log_level: str, log_format: str) -> None:
        self.workers = [Worker(i + 1) for i in range(count)]
        self.directory = directory
        self.log_level, self.log_format = log_level, log_format
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def socket(self, worker: Worker) -> str:
        return os.path.join(self.directory, f"worker-{worker.index}.sock")

    def write_settings(self, settings: Settings) -> None:
        for worker in self.workers:
            path = os.path.join(self.directory, f"worker-{worker.index}.settings")
            with open(path, "wb") as f:
                pickle.dump(worker_settings(settings, owner_socket(self.directory), self.socket(worker)), f)

    async def start(self) -> None:
        for worker in self.workers:
            await self._spawn(worker)
            self._tasks.append(asyncio.create_task(self._supervise(worker), name=f"worker {worker.index}"))

    async def _spawn(self, worker: Worker) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket(worker))
        code = "import sys; from eds_server.workers import worker_main; sys.exit(worker_main(sys.argv[1:]))"
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, self.directory, str(worker.index), self.log_level, self.log_format,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        worker.started_at = time.monotonic()
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    async def _supervise(self, worker: Worker) -> None:
        delay = RESTART_DELAY[0]
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            if self._stopping:
                return
            if time.monotonic() - worker.started_at > 60:
                delay = RESTART_DELAY[0]  # it ran a while: not a crash loop
            how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            log.error("worker %d (pid %d) %s; its Envoys reconnect to the others; restarting it in %.1fs",
                      worker.index, worker.process.pid, how, delay)  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(RESTART_DELAY[1], delay * 2)
            if self._stopping:
                return
            worker.restarts += 1
            await self._spawn(worker)

    async def stop(self, grace: float) -> None:
        """SIGTERM to every worker (each drains its streams), SIGKILL to those still up after `grace`."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        running = [w.process for w in self.workers if w.alive and w.process is not None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), grace)
        except TimeoutError:
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))

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
        return [{"worker": w.index, "pid": w.process.pid if w.process else None, "alive": w.alive,
                 "restarts": w.restarts} for w in self.workers]  # fmt: skip

    async def streams(self, after: int, limit: int) -> dict[str, Any]:
        """One page of every worker's streams. A stream's id here is its worker's id times the
        number of workers, plus the worker's index - 1: unique, and ordered within each worker."""
        n = len(self.workers)
        pages = await asyncio.gather(*(
            self._each_one(w, f"/v1/streams?after={max(0, (after - w.index + 1) // n)}&limit={limit}")
            for w in self.workers if w.alive
        ))  # fmt: skip
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
        """The owner's exposition with the workers' serving series added up (see SERVED, WHOLE)."""
        texts = [text for _, text in await self._each("/metrics")]
        return merge_metrics(own, texts, self.describe())


def merge_metrics(own: str, workers: Iterable[str], described: list[dict[str, Any]]) -> str:
    """One exposition for the whole server: per-worker families summed, the rest the owner's."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    families: dict[str, Metric] = {m.name: m for m in text_string_to_metric_families(own)}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in workers:
        for family in text_string_to_metric_families(text):
            if family.name not in SERVED and family.name not in WHOLE:
                continue
            into = sums.setdefault(family.name, {})
            if family.name not in families:
                families[family.name] = family
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                into[key] = into.get(key, 0.0) + sample.value
    for name, values in sums.items():
        family = families[name]
        if name in WHOLE:
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                values[key] = values.get(key, 0.0) + sample.value
        family.samples = [type(family.samples[0])(n, dict(labels), v) for (n, labels), v in values.items()]
    for name in SERVED - sums.keys():
        families.pop(name, None)  # no worker answered: the owner's links are not Envoy streams
    alive = GaugeMetricFamily("eds_workers_alive", "Worker processes running (--workers)")
    alive.add_metric([], sum(1 for d in described if d["alive"]))
    restarts = GaugeMetricFamily("eds_worker_restarts", "Worker processes restarted after dying", labels=["worker"])
    for d in described:
        restarts.add_metric([str(d["worker"])], d["restarts"])

    class _All(Collector):
        def collect(self) -> Iterable[Metric]:
            return [*families.values(), alive, restarts]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_All())
    return generate_latest(registry).decode()


async def serve_with_workers(settings: Settings, count: int, log_level: str, log_format: str) -> int:
    """The owner process: start the sources, then the workers; stop on SIGTERM or SIGINT."""
    from . import __version__
    from .cli import start_app, until_signalled

    log.info("eds-server %s starting with %d workers (Python %s)", __version__, count, sys.version.split()[0])
    if not _security_usable(settings):
        return 1
    directory = tempfile.mkdtemp(prefix="eds-server-workers-")  # private (0700): settings and admin sockets
    try:
        pool = WorkerPool(count, directory, log_level, log_format)
        app = await start_app(owner_settings(settings, directory), extra_ports=[("--listen", settings.listen)],
                              workers=pool)  # fmt: skip
        if app is None:
            return 1
        pool.write_settings(settings)
        await pool.start()
        log.info("serving EDS (gRPC) on %s:%s with %d worker processes", *settings.listen, count)
        await until_signalled()
        log.info("shutting down: draining the workers")
        await pool.stop(settings.shutdown_grace + 5.0)
        await app.stop()
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _security_usable(settings: Settings) -> bool:
    """The workers' TLS and authorization files, checked before anything starts: a bad one stops the
    start with the file named, rather than every worker dying on it over and over."""
    from . import security
    from .cli import refuse_security
    from .security import SecurityConfigError

    try:
        if settings.tls_cert:
            security.server_ssl_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if settings.authz:
            security.load_authz(settings.authz)
    except SecurityConfigError as e:
        refuse_security(e)
        return False
    return True


def worker_main(argv: list[str]) -> int:
    """A worker process: `DIRECTORY INDEX LOG_LEVEL LOG_FORMAT`, its settings pickled by the owner in
    its private directory. Ends on SIGTERM, and when its owner is gone."""
    import uvloop

    from .cli import setup_logging

    directory, index, level, fmt = argv
    setup_logging(level, fmt)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Prefix(f"worker {index}: "))
    with open(os.path.join(directory, f"worker-{index}.settings"), "rb") as f:
        settings = pickle.load(f)  # written by our owner, in a directory only it (and we) may write
    return int(uvloop.run(_work(settings, os.getppid())))


async def _work(settings: Settings, owner: int) -> int:
    from .cli import start_app

    app = await start_app(settings)
    if app is None:
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        if os.getppid() != owner:
            log.warning("the owner process is gone: stopping")
            break
    await app.stop()
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
