"""Assembly: sources feed the aggregator (in MERGE_ORDER), it the store, the store the gRPC service; admin looks on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Coroutine
from ssl import SSLContext
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import admin, security
from .encode import Encoders
from .health.checker import Checker
from .metrics import HealthChecks, make_registry
from .security import SecurityConfigError
from .settings import Settings
from .sources.aggregator import Aggregator
from .sources.base import Source
from .sources.docker import DockerSource
from .sources.etcd_wire import is_etcd, parse_target
from .sources.registrations import RegistrationSource
from .sources.relay import RelaySource
from .sources.swarm import SwarmSource
from .sources.upstreams_file import UpstreamsFileSource
from .store import Store
from .transport.grpc import EdsService, make_server
from .transport.h2 import (
    FILE_HEADROOM,
    PassThroughCodec,
    http_runner,
    keepalive_config,
    overload,
    runner_port,
)
from .transport.rest import make_rest_app

if TYPE_CHECKING:
    from .sources.kubernetes import KubernetesSource
    from .sources.registrations_etcd import EtcdRegistrationSource

log = logging.getLogger("eds_server")

# The merge order of the sources, by kind: on a duplicate address in a group the first source's
# endpoint wins (docs/fail-static.md). Started, listed (/v1/sources, the status page, metrics) and
# merged in this order, whatever order they are built in. A relay is its server's only source.
MERGE_ORDER: tuple[str, ...] = ("file", "docker", "swarm", "kubernetes", "registrations", "relay")


class App:
    """One running server. `start()` refuses a bad upstreams file by raising UpstreamsError, and
    unusable TLS or authorization files by raising SecurityConfigError."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        src, reg, net = settings.sources, settings.registrations, settings.transport
        self.encoders = Encoders()  # and their caches: this server's, handed to the store, gRPC and REST
        self.store = Store(self.encoders.encode_group)
        self.aggregator = Aggregator(self.store)  # the sources' only way to the store
        # Health checks run where the sources are: not in a relay, nor in a worker (a relay of its
        # owner), so with --workers N one process checks and every worker serves the results.
        self.checker = Checker(self.store) if src.upstream_eds is None else None
        feed = self.aggregator
        self.file_source = (
            UpstreamsFileSource(feed, src.upstreams, debounce=src.debounce, max_size=src.max_upstreams_size)
            if src.upstreams
            else None
        )
        self.docker_source = (
            DockerSource(feed, src.docker, host=src.docker_host, debounce=src.debounce)
            if src.docker is not None
            else None
        )
        self.swarm_source = (
            SwarmSource(feed, src.swarm, host=src.docker_host, debounce=src.debounce) if src.swarm is not None else None
        )
        self.kubernetes_source: KubernetesSource | None = None
        if src.kubernetes is not None:
            from .sources.kubernetes import KubernetesSource

            self.kubernetes_source = KubernetesSource(feed, src.kubernetes, debounce=src.debounce)
        self.registrations: RegistrationSource | EtcdRegistrationSource | None = None
        if is_etcd(reg.state):
            from .sources.registrations_etcd import EtcdRegistrationSource

            assert reg.state is not None
            self.registrations = EtcdRegistrationSource(
                feed, parse_target(reg.state), reg.etcd, max_registrations=reg.max_registrations
            )
        elif reg.wanted:
            self.registrations = RegistrationSource(feed, reg.state, max_registrations=reg.max_registrations)
        self.relay = None
        if src.upstream_eds is not None:  # its client: bytes as they are, keepalive every 30 s
            config = keepalive_config(30.0, 10.0)
            self.relay = RelaySource(feed, src.upstream_eds, codec=PassThroughCodec(), config=config)
        by_kind: dict[str, Source | None] = {
            "file": self.file_source,
            "docker": self.docker_source,
            "swarm": self.swarm_source,
            "kubernetes": self.kubernetes_source,
            "registrations": self.registrations,
            "relay": self.relay,
        }
        self.sources: list[Source] = [s for s in (by_kind[kind] for kind in MERGE_ORDER) if s is not None]
        self.aggregator.declare([s.name for s in self.sources])
        self.service = EdsService(
            self.store,
            net.limits,
            send_timeout=net.send_timeout,
            max_streams=net.max_streams,
            responses=self.encoders.responses,
        )
        self.grpc = make_server(
            self.service,
            max_streams_per_connection=net.max_streams_per_connection,
            keepalive_time=net.keepalive_time,
            keepalive_timeout=net.keepalive_timeout,
            max_message_size=net.max_message_size,
            reset_budget=net.reset_budget,
            limits=dataclasses.replace(  # the admin and REST ports' descriptors kept out of the gRPC port's
                net.connection_limits, file_reserve=2 * net.http_limits.max_connections + FILE_HEADROOM
            ),
            http2=net.http2,
        )
        if self.checker is not None:  # kept health-check connections fit beside the gRPC port's
            reserve = 2 * net.http_limits.max_connections + FILE_HEADROOM
            self.checker.connections.reserved = net.connection_limits.max_connections + reserve
            # and kept TLS ones (~47 KB each) within a share of what the memory watermark allows
            self.checker.connections.memory_limit = net.connection_limits.memory_limit or overload.default_limit()
        # an observer of the streams from the first one on (made before anything serves)
        self.registry = make_registry(
            self.store,
            self.service.counters,
            self.service.observers,
            self.source_status,
            lambda: (self.grpc.connections, self.grpc.refused),
        )
        if self.checker is not None:
            self.registry.register(HealthChecks(self.checker))
        self._http: list[web.AppRunner] = []
        self.workers: admin.WorkerAnswers | None = None  # set before start() by the owner of --workers N
        self._stop_sources = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.grpc_port: int | None = None
        self.admin_port: int | None = None
        self.rest_port: int | None = None
        self.metrics_port: int | None = None
        self.admin_ssl: SSLContext | None = None  # --admin-tls: its running context, which SIGHUP reloads

    def source_status(self) -> list[dict[str, Any]]:
        """What each source says of itself, in merge order (for /v1/sources, the status page, metrics)."""
        out = [source.status().as_json() for source in self.sources]
        if self.checker is not None and (self.checker.frozen_since is not None or self.checker.has_targets):
            out.append(self.checker.status())  # listed as a source would be: degraded while cut off
        return out

    def stats(self) -> dict[str, Any]:
        counters = dataclasses.asdict(self.service.counters)
        return {
            **counters,
            "streams_open": self.service.open_streams,
            "encodes": self.store.encodes,
            "connections_open": self.grpc.connections,
            "refused_by_reason": self.grpc.refused,
            "reading": self.grpc.reading,
            "keepalive": self.grpc.keepalive,
            "http2_path": "fast" if self.grpc.fast else "stock",
        }

    async def start(self) -> None:
        net, adm, own = self.settings.transport, self.settings.admin, self.settings.workers
        ssl = self._security()
        admin_ssl = self._admin_ssl()  # before anything starts: unusable files refuse the start
        self.admin_ssl = admin_ssl if own.admin_unix is None else None  # a worker's admin is its owner's
        for source in self.sources:
            await source.start()  # raises UpstreamsError, RegistrationStateError: refuse to start
        for source in self.sources:
            self._spawn(source.run(self._stop_sources), f"source {source.name}", source.name)
        if self.checker is not None:
            self._spawn(self.checker.run(self._stop_sources), "health checks")
        if self.settings.sources.startup_timeout is not None:
            self._spawn(self._startup_deadline(self.settings.sources.startup_timeout), "startup deadline")
        host, port = net.listen
        if ssl is not None:
            self.grpc.ssl = ssl
        if own.listen_unix is not None:
            await self.grpc.start(path=own.listen_unix)
            self.grpc_port = 0
            log.info("serving EDS (gRPC) to the workers on %s", own.listen_unix)
        else:
            sock = socket.socket(fileno=own.listen_fd) if own.listen_fd is not None else None
            await self.grpc.start(host, port, sock=sock)
            self.grpc_port = self.grpc.port
            log.info("serving EDS (gRPC) on %s:%s", host, self.grpc_port)
        watermark = overload.watch(
            self.grpc.gate, net.connection_limits.memory_limit, forgotten=self.service.heap.forgotten
        )
        self._spawn(watermark, "memory watermark")
        if adm.metrics_listen is not None and own.admin_unix is None:  # not a worker's
            # before the admin port: once that answers (a test, a supervisor), so does this one
            app = admin.make_app(
                self.store,
                self.source_status,
                self.stats,
                self.service.describe_streams,
                self.registry,
                workers=self.workers,
                read_only_probes=True,
            )
            self.metrics_port = await self._serve_http(
                app, adm.metrics_listen, "metrics and probes (read-only: /metrics, /healthz, /readyz)"
            )
        if adm.address is not None or own.admin_unix is not None:
            app = admin.make_app(
                self.store,
                self.source_status,
                self.stats,
                self.service.describe_streams,
                self.registry,
                self.registrations,
                self.settings.registrations.admin_token,
                self.settings.registrations.policy,
                self.workers,
                self._shed if own.admin_unix is not None else None,
                checks=self.checker.endpoint_check if self.checker is not None else None,
            )
            if own.admin_unix is not None:
                await self._serve_unix(app, own.admin_unix)
            else:
                assert adm.address is not None
                self.admin_port = await self._serve_http(app, adm.address, "admin", admin_ssl)
        if net.rest_listen is not None:
            app = make_rest_app(self.store, net.limits, net.max_message_size, self.encoders)
            self.rest_port = await self._serve_http(app, net.rest_listen, "EDS (REST)")

    def _security(self) -> SSLContext | None:
        """The gRPC port's TLS context, and the authorization hook, from the settings."""
        s = self.settings.security  # a key or CA without a certificate: refused by SecuritySettings
        ssl = security.server_ssl_context(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None
        if ssl is not None:
            mtls = f"client certificates required (CA {s.tls_client_ca})" if s.tls_client_ca else "no client certs"
            log.info("gRPC over TLS: certificate %s, %s", s.tls_cert, mtls)
        if s.authz:
            policy = security.load_authz(s.authz)
            self.service.authorize = policy.for_client
            log.info("authorization: %s: %d rules, default %s", s.authz, len(policy.rules), policy.default)
            if policy.uses_certificates and not s.tls_client_ca:
                log.warning(
                    "authorization: without --tls-client-ca no client has a certificate: "
                    "san_uri and san_dns rules match nobody"
                )
        return ssl

    async def _shed(self, streams: int, one_under: int) -> dict[str, int]:
        if not self.grpc.fast:  # the stock path cannot end one connection: its streams would come back here
            return {"connections": 0, "streams": 0}
        return await self.service.shed(streams, one_under, self.grpc.goaway)

    def reload(self) -> None:
        """SIGHUP: read the TLS certificate and key and the authorization file again. A file that does
        not load is logged and the running one kept; what loads applies to connections (TLS) and
        streams (authorization) opened from now on. The upstreams file needs no signal: it is followed."""
        s = self.settings.security
        self.reload_admin_tls()
        if not s.tls_cert and not s.authz:
            if self.admin_ssl is not None:  # the --workers owner: its admin port's TLS alone
                return
            log.info(
                "SIGHUP: nothing to reload (no --tls-cert, no --authz; the upstreams file is followed as it changes)"
            )
            return
        if s.tls_cert and self.grpc.ssl is not None:
            try:
                security.server_ssl_context(s.tls_cert, s.tls_key, s.tls_client_ca)  # the whole check, first
                self.grpc.ssl.load_cert_chain(s.tls_cert, s.tls_key)  # the running context: new handshakes
                if s.tls_client_ca:
                    self.grpc.ssl.load_verify_locations(s.tls_client_ca)
                log.info("SIGHUP: TLS certificate %s reloaded", s.tls_cert)
            except (SecurityConfigError, OSError, ValueError) as e:
                why = "; ".join(e.problems) if isinstance(e, SecurityConfigError) else str(e)
                log.error("SIGHUP: TLS files not reloaded, the running ones kept: %s", why)
        if s.authz:
            try:
                policy = security.load_authz(s.authz)
            except SecurityConfigError as e:
                log.error("SIGHUP: authorization not reloaded, the running rules kept: %s", "; ".join(e.problems))
            else:
                self.service.authorize = policy.for_client
                log.info(
                    "SIGHUP: authorization %s reloaded: %d rules, default %s (for streams opened from now on)",
                    s.authz,
                    len(policy.rules),
                    policy.default,
                )

    def reload_admin_tls(self) -> None:
        """SIGHUP with --admin-tls: the admin port's certificate and key read again, for connections
        from now on; a pair that does not load is logged and the running one kept."""
        s = self.settings.admin
        if self.admin_ssl is None or s.tls_cert is None:
            return
        try:
            security.http_ssl_context(s.tls_cert, s.tls_key)  # the whole check, first
            self.admin_ssl.load_cert_chain(s.tls_cert, s.tls_key)
            log.info("SIGHUP: admin TLS certificate %s reloaded", s.tls_cert)
        except (SecurityConfigError, OSError, ValueError) as e:
            why = "; ".join(e.problems) if isinstance(e, SecurityConfigError) else str(e)
            log.error("SIGHUP: admin TLS files not reloaded, the running ones kept: %s", why)

    def _admin_ssl(self) -> SSLContext | None:
        s = self.settings.admin
        if s.tls_cert is None or s.address is None:
            return None
        ssl = security.http_ssl_context(s.tls_cert, s.tls_key)
        log.info("admin over TLS: certificate %s", s.tls_cert)
        return ssl

    async def _serve_http(
        self, app: web.Application, address: tuple[str, int], what: str, ssl: SSLContext | None = None
    ) -> int:
        runner = http_runner(app, self.settings.transport.http_limits, self.settings.transport.http2)
        await runner.setup()
        self._http.append(runner)
        site = web.TCPSite(runner, *address, ssl_context=ssl)
        await site.start()
        port = runner_port(runner)
        log.info("%s on %s://%s:%s", what, "https" if ssl else "http", address[0], port)
        return port

    async def _serve_unix(self, app: web.Application, path: str) -> None:
        runner = http_runner(app, self.settings.transport.http_limits, self.settings.transport.http2)
        await runner.setup()
        self._http.append(runner)
        await web.UnixSite(runner, path).start()

    async def _startup_deadline(self, timeout: float) -> None:
        if self.store.ready:
            return
        await asyncio.sleep(timeout)
        if not self.store.ready:
            log.warning(
                "startup timeout (%gs): sources never loaded: %s; serving what is loaded "
                "(Envoy drops endpoints only those sources would give)",
                timeout,
                ", ".join(self.store.pending_sources),
            )
            self.store.force_ready()

    async def stop(self) -> None:
        """Stop accepting, end streams cleanly (Envoy keeps its endpoints and reconnects), then
        close everything: all within `shutdown_grace` seconds (--shutdown-timeout), however many
        streams are open. Streams still open at 60% of it are cut (Envoy keeps its endpoints then
        too, and reconnects); closing the connections and the sources gets the rest."""
        loop = asyncio.get_running_loop()
        start, budget = loop.time(), self.settings.transport.shutdown_grace
        streams = self.service.open_streams
        if self.grpc_port is not None:
            self.grpc.stop_accepting()  # first
        self.service.stop(end_streams=False)
        await self.service.end_streams_by(start + 0.6 * budget)
        cut = self.service.open_streams
        if streams:
            log.info("shutdown: %d streams ended cleanly, %d cut (--shutdown-timeout %gs)", streams - cut, cut, budget)
        if self.grpc_port is not None:
            self.grpc.close()
            try:
                await asyncio.wait_for(self.grpc.wait_closed(), max(0.05, start + 0.8 * budget - loop.time()))
            except TimeoutError:
                log.warning("some gRPC handlers did not finish in time: left to the exit")
        self.service.stream_log.summarise()  # the count of stream lines left out, not lost with the process
        self._stop_sources.set()
        for task in self._tasks:
            task.cancel()
        rest = [asyncio.ensure_future(t) for t in (*self._tasks, *(runner.cleanup() for runner in self._http))]
        if not rest:  # a start refused before anything ran (a bad state file): nothing to wait for
            return
        _, pending = await asyncio.wait(rest, timeout=max(0.05, start + budget - loop.time()))
        if pending:
            log.warning("shutdown: %d tasks had not finished by --shutdown-timeout: left to the exit", len(pending))

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str, source: str | None = None) -> None:
        """Run a background task; a failure is logged at once (not found at shutdown), and the
        source it fed is marked stale: its last state is still served, but no longer followed."""
        task = asyncio.create_task(coro, name=what)

        def done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("%s stopped: %r", what, t.exception(), exc_info=t.exception())
                if source is not None:
                    self.aggregator.mark_stale(source, True)

        task.add_done_callback(done)
        self._tasks.append(task)
