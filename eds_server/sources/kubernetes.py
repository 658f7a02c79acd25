"""Kubernetes as a source: annotated Services and their EndpointSlices, by list+watch.

One list+watch per kind (Services, EndpointSlices; Nodes too with --kubernetes-node-regions) and per
namespace followed (all namespaces: one cluster-wide watch per kind), never one per Service. A watch
resumes from the last resourceVersion it saw (bookmarks keep it fresh); `410 Gone` means that version
is no longer kept, so the kind is listed again and the listing replaces what we knew. Connection errors are retried
with jittered backoff; meanwhile the last endpoints keep being served, marked stale. Nothing is
handed to the store before every kind has been listed once, so Envoy never sees a half-read cluster.

An API server that stops answering with its connections open (a frozen process: a watch looks
just like a quiet one) is found by a heartbeat: once nothing was heard for a second, GET /livez
with two seconds to answer, twice running (any status counts); unanswered, every list and watch in
flight is ended and the source is marked stale, about 5 s after its last answer, as for a server that went away.

The heartbeat rides other pooled connections, so it cannot tell that one watch's own connection died
(a proxy or NAT in between stalled or forgot it) while the server answers. So each watch is short: it
asks the API server to end it after WATCH_SECONDS (4 s), and the watch cache sends a bookmark with its
current resourceVersion 2 s before that, so the next watch resumes from a fresh version and a quiet
watch filtered by namespace or label never falls out of the cache's history (no relist per renewal).
A watch not ended WATCH_GRACE (1 s) after that, with nothing heard on it for as long, is Stalled: within
5 s of its last news. If the API server then answers GET /livez on another connection, the watch is
opened again at once from where it was, and the source stays live; if not, the heartbeat's verdict
stands (hung: stale). A watch opened again that way and stalling again before its first proper end
is a failure as any other (stale, backoff): a path that stalls every watch is not hidden.

A backoff grows to 30 s during a long outage, and the server's return should not wait that out: while
the API server is away it is probed (GET /readyz, short timeout) about once a second, and the wait
ends once it answers again. The configuration's files (kubeconfig, the certificates it names) are
watched by their stat: a rewritten kubeconfig (a rotated token, CA or server) is loaded before the next
attempt, and ends a backoff the same way.

kubernetes_asyncio does configuration and authentication (kubeconfig, in-cluster service account
with the token re-read as it rotates); the list and watch requests go through its ApiClient, which
adds fresh credentials to each request, and their JSON is read here as it is (`kubernetes_map`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..ratelimit import LogBudget
from .base import (
    Backoff,
    Comeback,
    Feed,
    FileStamps,
    Followed,
    Heartbeat,
    Hung,
    Liveness,
    SharedProbe,
    SourceStatus,
    WarnOnce,
    pause,
)
from .kubernetes_map import ClusterView, KubernetesOptions

log = logging.getLogger("eds_server.sources.kubernetes")

LIST_PAGE = 500
WATCH_SECONDS = 4  # timeoutSeconds: the API server ends each watch then (a bookmark 2 s before)
WATCH_GRACE = 1.0  # past its end, this long silent: the watch's connection is dead


@dataclass(frozen=True)
class Kind:
    name: str  # for logs
    group_path: str  # /api/v1 or /apis/discovery.k8s.io/v1
    plural: str
    label_selector: str | None = None

    def path(self, namespace: str | None) -> str:
        where = f"/namespaces/{namespace}" if namespace else ""
        return f"{self.group_path}{where}/{self.plural}"


SERVICES = Kind("Services", "/api/v1", "services")
SLICES = Kind("EndpointSlices", "/apis/discovery.k8s.io/v1", "endpointslices", "kubernetes.io/service-name")
NODES = Kind("Nodes", "/api/v1", "nodes")  # cluster-scoped; only with --kubernetes-node-regions


class Gone(Exception):
    """410: the resourceVersion we resume from is no longer kept: list again."""


class Stalled(TimeoutError):
    """A watch not ended by the API server when asked, and silent: its connection is dead or stalled."""


@dataclass
class Cursor:
    """Where a scope resumes: the last resourceVersion seen, an event's or a bookmark's (kept when a
    watch fails midway, so that the next one replays nothing already applied); None: list first."""

    version: str | None = None


class ApiError(Exception):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Unauthorized(ApiError):
    """401: the credentials are no longer accepted (rotated, expired): load the configuration again."""


class ConfigProblem(Exception):
    """The Kubernetes configuration cannot be used (a kubeconfig that is not YAML, a CA file that does
    not exist...): said in one line naming the file, as the operator's to fix, not the API server's."""


async def make_client(options: KubernetesOptions) -> Any:
    """An ApiClient from --kubeconfig, else KUBECONFIG, else in-cluster, else ~/.kube/config;
    ConfigProblem when the configuration found cannot be used."""
    from kubernetes_asyncio import client, config  # imported only when Kubernetes is followed (~1 s)

    logging.getLogger("kubernetes_asyncio").setLevel(logging.ERROR)  # our own warning says it, once

    cfg = client.Configuration()
    files = config_files(options)
    try:
        if options.kubeconfig:
            await config.load_kube_config(config_file=options.kubeconfig, client_configuration=cfg)
        elif in_cluster():
            # try_refresh_token: the service account token file is read again every minute (it rotates)
            config.load_incluster_config(client_configuration=cfg, try_refresh_token=True)  # type: ignore[no-untyped-call]
        else:
            await config.load_kube_config(client_configuration=cfg)
    except Exception as e:
        raise ConfigProblem(config_problem(e, files)) from None
    return client.ApiClient(cfg)


def config_problem(e: BaseException, files: list[str]) -> str:
    """What is wrong with the configuration, in one line naming the file (the library's words run over
    several lines, and some, such as a TypeError for an empty file, say nothing of the file)."""
    import yaml

    where = ", ".join(files) or "the in-cluster service account (/var/run/secrets/kubernetes.io/serviceaccount)"
    missing = [f for f in files if not os.path.exists(f)]
    if missing and len(missing) == len(files):
        return f"{where}: no such file"
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.YAMLError) and mark is not None:
        problem = getattr(e, "problem", None) or "syntax error"
        return f"{mark.name}:{mark.line + 1}:{mark.column + 1}: not YAML: {problem}"
    if isinstance(e, yaml.YAMLError):
        return f"{where}: not YAML: {_one_line(str(e))}"
    text = _one_line(str(e))
    if text.startswith("File does not exists: "):  # the library's words for a CA, certificate or key file
        return f"{where} names a file that does not exist: {text.removeprefix('File does not exists: ')}"
    if isinstance(e, TypeError | AttributeError | KeyError):  # an empty file, or not a mapping
        return f"{where}: not a kubeconfig (empty, or not a mapping of clusters, users and contexts)"
    return f"{where}: {text or type(e).__name__}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def missing_configuration(kubeconfig: str | None) -> str | None:
    """Why --kubernetes can never work as started, or None: no --kubeconfig, not in a cluster, and no
    kubeconfig file where KUBECONFIG or the default (~/.kube/config) says."""
    if kubeconfig or in_cluster():
        return None
    files = config_files(KubernetesOptions())
    if any(os.path.exists(f) for f in files):
        return None
    return (
        f"no Kubernetes configuration: not in a cluster (KUBERNETES_SERVICE_HOST is not set), no --kubeconfig, "
        f"and no {' or '.join(files) or 'kubeconfig'}: give --kubeconfig FILE or set KUBECONFIG"
    )


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG")


def config_files(options: KubernetesOptions) -> list[str]:
    """The kubeconfig files make_client reads (none in-cluster: the library re-reads that token)."""
    if options.kubeconfig:
        return [options.kubeconfig]
    if in_cluster():
        return []
    paths = os.environ.get("KUBECONFIG") or "~/.kube/config"
    return [os.path.expanduser(p) for p in paths.split(os.pathsep) if p]


def cert_files(api: Any) -> list[str]:
    """The CA, client certificate and key files a loaded configuration names (a rotated CA or
    client certificate is a rewrite of one of these, not of the kubeconfig)."""
    cfg = api.configuration
    return [str(f) for f in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file) if f and os.path.isfile(str(f))]


def describe(kind: Kind, e: BaseException, request: str = "request") -> str:
    """What went wrong, in words an operator can act on, rather than an exception's repr."""
    if isinstance(e, Hung | Stalled):
        return f"{kind.name}: {e}"
    if isinstance(e, Unauthorized):
        return f"{kind.name}: the API server refused our credentials (401): {_after_status(e)}"
    if isinstance(e, ApiError):
        return f"{kind.name}: the API server answered {e}"
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return f"{kind.name}: the API server's certificate is not trusted (check the kubeconfig's CA): {_reason(e)}"
    if isinstance(e, aiohttp.ClientSSLError):
        return f"{kind.name}: TLS with the API server failed: {_reason(e)}"
    if isinstance(e, aiohttp.ClientConnectorError):
        where = f"{e.host}:{e.port}"
        return f"{kind.name}: cannot connect to the API server at {where} ({_reason(e)}): it is down or restarting"
    if isinstance(e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return f"{kind.name}: the API server closed the {request} mid-stream: it went away (restarting or stopping)"
    if isinstance(e, TimeoutError):
        return f"{kind.name}: the API server did not answer in time"
    if isinstance(e, aiohttp.ClientOSError):
        return f"{kind.name}: the connection to the API server was lost ({_reason(e)})"
    if isinstance(e, aiohttp.ClientError):
        return f"{kind.name}: the request to the API server failed ({str(e) or type(e).__name__})"
    return f"{kind.name}: {type(e).__name__}: {e}"  # not a fault of the API server's: say exactly what


def _reason(e: BaseException) -> str:
    """An OS or TLS error's own words ("connection refused"), without the errno and the repr around it."""
    err = getattr(e, "certificate_error", None) or getattr(e, "os_error", None) or e
    words = getattr(err, "verify_message", None) or getattr(err, "reason", None)
    errno = getattr(err, "errno", None)
    if not words and isinstance(errno, int):
        words = os.strerror(errno).lower()
    return str(words or getattr(err, "strerror", None) or err or type(err).__name__)


def _after_status(e: ApiError) -> str:
    return str(e).split(f": {e.status}: ", 1)[-1]


def went_away(e: BaseException) -> bool | None:
    """True: the API server is certainly not there (nothing accepts the connection); None: it may
    have gone (a cut response, a timeout, a 5xx); False: it answered, refusing us for a reason of
    its own, and being there again is no reason to try sooner."""
    if isinstance(e, aiohttp.ClientConnectorError) and not isinstance(e, aiohttp.ClientSSLError):
        return True
    if isinstance(e, ApiError):
        return None if e.status >= 500 or e.status == 0 else False
    if isinstance(e, aiohttp.ClientSSLError):
        return False
    return None if isinstance(e, aiohttp.ClientError | TimeoutError | OSError) else False


Scope = tuple[Kind, str | None]  # a kind, in one namespace (None: all)


class Outage:
    """Which scopes are failing and why: said once per outage, and again when its nature changes
    while it lasts (the API server back but refusing the credentials is news to act on, not more of
    the same)."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self.down: dict[Scope, str] = {}  # scopes failing now, and why
        self._said = False  # whether this outage was logged
        self._nature: int | None = None  # and its kind: None away, else the status the server refused us with

    def failed(self, scope: Scope, reason: str, retry_in: float, error: BaseException) -> None:
        self.down[scope] = reason
        # the API server away (whichever way) is one thing; each status it refuses us with is another
        nature = None if went_away(error) is not False else int(getattr(error, "status", 0))
        again = self._said and nature != self._nature
        self._said = True
        self._nature = nature
        self.liveness.lost(reason, retry_in, again=again)

    def recovered(self, scope: Scope) -> bool:
        """`scope` follows again; True when no scope is failing any more."""
        self.down.pop(scope, None)
        if not self.down:
            self._said, self._nature = False, None
        return not self.down


class KubernetesSource(Followed):
    name = "kubernetes"

    def __init__(
        self,
        feed: Feed,
        options: KubernetesOptions,
        *,
        debounce: float = 0.05,
        request_timeout: float = 30.0,
        watch_timeout: int = WATCH_SECONDS,
        probe_every: float = 1.0,
        probe_timeout: float = 2.0,
        backoff: tuple[float, float] = (0.2, 30.0),  # first delay, cap
    ) -> None:
        self.feed = feed
        self.options = options
        self.debounce = debounce
        self.request_timeout = request_timeout
        self.watch_timeout = watch_timeout
        self.probe_every, self.probe_timeout, self.backoff = probe_every, probe_timeout, backoff
        self.probe = SharedProbe(self._probe, fresh=probe_every / 2)
        self.heartbeat = Heartbeat(self._pulse, "the API server", every=probe_every, timeout=probe_timeout)
        self._answering = True  # the last probe's answer, to say once that the server is back
        self.liveness = Liveness(feed, self.name, "the API server")
        self.watches_open = 0
        self.renewals = 0  # watches ended by the API server when asked, and resumed
        self.reopened = 0  # watches gone silent while the API server answered, opened again at once
        self._reopens_said = LogBudget(log, most=1, window=300.0)
        self.events = 0  # watch events applied, for tests and benchmarks
        self.relists = 0
        self.view = ClusterView(options.annotation_prefix)  # the mapper: objects read -> groups
        self.warnings = WarnOnce(log)  # per Service
        # what is listed and watched: each kind in each namespace (or the cluster)
        self.scopes: tuple[Scope, ...] = tuple(
            (kind, ns) for kind in (SERVICES, SLICES) for ns in (options.namespaces or (None,))
        ) + (((NODES, None),) if options.node_regions else ())
        self._listed: set[Scope] = set()  # scopes listed at least once
        self.outage = Outage(self.liveness)  # the scopes failing now, said once per outage
        self._changed = asyncio.Event()
        self._api: Any = None
        self._loaded_at = 0.0
        self._reload_lock = asyncio.Lock()
        self._reloads_said = LogBudget(log, most=1, window=300.0)
        self._stamps = FileStamps(config_files(options))  # the configuration's files as last loaded
        self.loads = 0  # configurations loaded (one more per rotation), for tests

    # -- state ---------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return len(self._listed) == len(self.scopes)

    def apply(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) for a Service, an EndpointSlice or a Node."""
        self.view.apply(kind.plural, event_type, obj)
        self.events += 1

    def replace(self, kind: Kind, namespace: str | None, items: list[Mapping[str, Any]]) -> None:
        """A full listing of one kind in one scope: what it lacks is gone, and the scope is listed."""
        self.view.replace(kind.plural, namespace, items)
        self._listed.add((kind, namespace))

    def publish(self) -> None:
        """Map the Services that changed again, and publish the whole state."""
        groups, warnings = self.view.groups()
        self.warnings.replace(warnings)
        changed = self.feed.publish(self.name, groups)
        if changed:
            log.info("%s: groups changed: %s", self.name, ", ".join(sorted(changed)))

    def status(self) -> SourceStatus:
        return self.liveness.status(
            connected=self.connected,
            services=len(self.view.services),
            endpointslices=len(self.view.slices),
            node_regions=len(self.view.regions) if self.options.node_regions else None,
            watches=self.watches_open,
            relists=self.relists,
            renewals=self.renewals,
            reopened=self.reopened,
            events=self.events,
            namespaces=list(self.options.namespaces) or "all",
        )

    async def start(self) -> None:
        """Nothing to check before serving: until every scope is listed the store waits (not ready)."""

    # -- API server ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Follow the API server until `stop` is set, reconnecting for as long as it takes."""
        backoff = Backoff(*self.backoff)
        while self._api is None and not stop.is_set():
            try:
                await self._reload()
            except Exception as e:  # no usable configuration (yet): say so, retry (at once if rewritten)
                reason = f"configuration error: {e if isinstance(e, ConfigProblem) else _one_line(f'{e!r}')}"
                delay = backoff.next()
                self.liveness.lost(
                    reason,
                    again=reason != self.liveness.last_error,
                    then=f"loaded again when its files change, or in {delay:.1f} s",
                )
                await pause(delay, stop, self._config_changed, self.probe_every)
        if self._api is None:
            return
        try:
            tasks = [asyncio.create_task(self._follow(kind, ns, stop)) for kind, ns in self.scopes]
            tasks.append(asyncio.create_task(self._publisher(stop)))
            tasks.append(asyncio.create_task(self.heartbeat.run(stop)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._api.close()

    async def _reload(self, *, changed: bool = False) -> None:
        """(Re)load the configuration and credentials: on a 401 at most every 10 s however many
        watches ask; with `changed`, once per rewrite of its files."""
        async with self._reload_lock:
            now = asyncio.get_running_loop().time()
            if self._api is not None and (not self._stamps.changed() if changed else now - self._loaded_at < 10.0):
                return
            files = config_files(self.options)
            before = FileStamps(files)  # taken first: a write during the load is seen as a change next time
            try:
                api = await make_client(self.options)
            except Exception:
                self._stamps = before  # this version of the files is not tried again; the next one is
                raise
            stamps = FileStamps([*files, *cert_files(api)])
            stamps.seen = before.seen + stamps.seen[len(files) :]
            old, self._api, self._loaded_at, self._stamps = self._api, api, now, stamps
            self.heartbeat.what = f"the API server at {api.configuration.host}"
            self.loads += 1
            if old is not None and changed:
                log.info("%s: configuration loaded again (its files changed); watches resume with it", self.name)
            elif old is not None:  # every 10 s for as long as a 401 lasts: said now and then, with a count
                self._reloads_said.log(
                    logging.INFO,
                    "%s: configuration loaded again (the credentials were refused); watches resume with it",
                    self.name,
                )
                await old.close()  # watches on it end and resume on the new one

    async def _config_changed(self) -> bool:
        return self._stamps.changed()

    async def _probe(self) -> bool:
        """Whether the API server answers: GET /readyz, briefly. 401 and 403 count (it is there and
        refusing us; the real request will say why); a 5xx or no answer does not."""
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        try:
            resp = await self._api.call_api(
                "/readyz",
                "GET",
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
            resp.release()
            answered = resp.status in (200, 401, 403)
        except Exception:
            answered = False
        if answered and not self._answering:
            log.info("%s: the API server answers again; reconnecting now", self.name)
        self._answering = answered
        return answered

    async def _pulse(self) -> None:
        """GET /livez, for the heartbeat: any status is an answer (it asks only whether the server is
        there; what it refuses is the real requests' to say)."""
        resp = await self._api.call_api("/livez", "GET", auth_settings=["BearerToken"], _preload_content=False)
        resp.release()

    async def _publisher(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._changed.wait()
            await asyncio.sleep(self.debounce)  # coalesce a burst of events into one version
            self._changed.clear()
            if self.loaded:
                self.publish()

    def _touch(self) -> None:
        if self.view.dirty:
            self._changed.set()

    def _failed(self, scope: Scope, reason: str, retry_in: float, error: BaseException) -> None:
        self.outage.failed(scope, reason, retry_in, error)

    def _recovered(self, scope: Scope) -> None:
        if self.outage.recovered(scope) and self.loaded and not self.connected:
            self.liveness.live(f"{len(self.view.services)} annotated Services, {len(self.view.slices)} EndpointSlices")

    async def _follow(self, kind: Kind, namespace: str | None, stop: asyncio.Event) -> None:
        """List, then watch from the list's version, watch after watch; on 410 list again; a watch
        gone silent is opened again at once while the API server answers; on errors back off, until
        the API server answers again or its configuration is rewritten."""
        scope = (kind, namespace)
        backoff = Backoff(*self.backoff)
        comeback = Comeback()
        at = Cursor()
        reopen = True  # a silent watch may be opened again at once (not one opened so, before it ends)
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if self._stamps.changed():
                with contextlib.suppress(Exception):  # kept as it is; the error is the next attempt's
                    await self._reload(changed=True)
            api, loads = self._api, self.loads
            request = "list" if at.version is None else "watch"
            try:
                if at.version is None:
                    async with self.heartbeat.guard():
                        at.version = await self._list(kind, namespace)
                    self._recovered(scope)
                    self._changed.set()  # the first full listing is published even if empty
                started, request = loop.time(), "watch"
                async with self.heartbeat.guard():
                    try:
                        await self._watch(kind, namespace, at, backoff, comeback)
                    except Stalled as e:
                        if not reopen or not await self._answers():  # Hung from the guard if it is hung
                            raise
                        reopen = False
                        self.reopened += 1
                        self._reopens_said.log(
                            logging.INFO,
                            "%s: %s; the API server answers on another connection: opened again from "
                            "resourceVersion %s",
                            self.name,
                            describe(kind, e),
                            at.version,
                        )
                        continue
                if loop.time() - started > 1.0:
                    self.renewals += 1
                    reopen = True
                    continue  # the server ended the watch (its timeout): resume from `at`
                # ended at once: the server may be going away; resume after a pause
                delay = backoff.next()
                log.debug(
                    "%s: the API server ended the %s watch at once; reconnecting in %.1f s", self.name, kind.name, delay
                )
                away: bool | None = None
            except Gone:
                log.info("%s: %s watch expired (410 Gone); listing again", self.name, kind.name)
                self.relists += 1
                at.version = None
                continue
            except Exception as e:
                if self._api is not api or self._stamps.changed():
                    continue  # a new configuration: the next attempt uses it, now
                delay = backoff.next()
                self._failed(scope, describe(kind, e, request), delay, e)
                away = went_away(e)
                if isinstance(e, Unauthorized):
                    with contextlib.suppress(Exception):  # a bad new configuration: retried after the backoff
                        await self._reload()
                    if self.loads != loads:
                        continue
            if away:
                comeback.away()
            await pause(delay, stop, self._try_now(comeback, loads, probe=away is not False), self.probe_every)

    async def _answers(self) -> bool:
        """After a watch went silent: whether the API server answers on another connection. GET /livez
        with the heartbeat's timeout; unanswered, the heartbeat's verdict. Awaited in the heartbeat's
        guard, so that a hung server is said hung in the heartbeat's words (Hung is raised here)
        whichever of the two noticed first."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.probe_timeout):
                await self._pulse()
            self.heartbeat.beat()
            return True
        bound = self.probe_every + 2 * self.probe_timeout
        while loop.time() - asked < 2 * bound:  # the heartbeat decides well before this
            if self.heartbeat.heard_since(asked):
                return True
            await asyncio.sleep(0.05)
        return False

    def _try_now(self, comeback: Comeback, loads: int, probe: bool) -> Callable[[], Any]:
        """When to end a backoff early: the configuration changed, or the API server, seen away,
        answers again."""

        async def check() -> bool:
            if self._stamps.changed() or self.loads != loads:
                return True
            return probe and comeback.probed(await self.probe())

        return check

    async def _get(self, path: str, query: list[tuple[str, str]], read_timeout: float | None) -> Any:
        timeout = aiohttp.ClientTimeout(sock_connect=self.request_timeout, sock_read=read_timeout)
        resp = await self._api.call_api(
            path,
            "GET",
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        self.heartbeat.beat()
        if resp.status == 410:
            resp.release()
            raise Gone()
        if resp.status != 200:
            body = (await resp.read())[:500].decode(errors="replace")
            resp.release()
            error = Unauthorized if resp.status == 401 else ApiError
            raise error(f"GET {path}: {resp.status}: {_message(body)}", resp.status)
        return resp

    async def _list(self, kind: Kind, namespace: str | None) -> str:
        """Every object of one kind in one scope, page by page; returns the list's resourceVersion."""
        items: list[Mapping[str, Any]] = []
        cont = ""
        while True:
            query = [("limit", str(LIST_PAGE))]
            if kind.label_selector:
                query.append(("labelSelector", kind.label_selector))
            if cont:
                query.append(("continue", cont))
            resp = await self._get(kind.path(namespace), query, self.request_timeout)
            try:
                body = json.loads(await resp.read())
            finally:
                resp.release()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                self.replace(kind, namespace, items)
                return str(meta.get("resourceVersion") or "")

    async def _watch(self, kind: Kind, namespace: str | None, at: Cursor, backoff: Backoff, comeback: Comeback) -> None:
        """Apply events until the server ends the watch (it is asked to after `watch_timeout` s),
        keeping `at` at the last resourceVersion seen. Stalled when it has not ended WATCH_GRACE
        after that, with nothing heard on it for as long: its connection is dead, whatever the
        heartbeat hears on the others."""
        loop = asyncio.get_running_loop()
        query = [
            ("watch", "1"),
            ("allowWatchBookmarks", "true"),  # and one 2 s before the end: `at` stays fresh when quiet
            ("resourceVersion", str(at.version)),
            ("timeoutSeconds", str(self.watch_timeout)),
        ]
        if kind.label_selector:
            query.append(("labelSelector", kind.label_selector))
        deadline = asyncio.timeout(self.watch_timeout + WATCH_GRACE)
        try:
            async with deadline:
                resp = await self._get(kind.path(namespace), query, None)
                self.watches_open += 1
                try:
                    self._recovered((kind, namespace))
                    backoff.reset()
                    comeback.reset()
                    async for line in resp.content:
                        self.heartbeat.beat()
                        if (due := loop.time() + WATCH_GRACE) > (deadline.when() or 0.0):
                            deadline.reschedule(due)  # still talking past its end: not dead
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        etype, obj = event.get("type"), event.get("object") or {}
                        if etype == "ERROR":
                            if obj.get("code") == 410:
                                raise Gone()
                            code = obj.get("code")
                            status = code if isinstance(code, int) else 0
                            raise ApiError(f"watch {kind.name}: {code}: {obj.get('message')}", status)
                        at.version = str((obj.get("metadata") or {}).get("resourceVersion") or at.version)
                        if etype in ("ADDED", "MODIFIED", "DELETED"):
                            self.apply(kind, etype, obj)
                            self._touch()
                finally:
                    self.watches_open -= 1
                    resp.release()
        except TimeoutError:
            if not deadline.expired():
                raise
            raise Stalled(
                f"the watch's connection went silent: the API server did not end it within "
                f"{self.watch_timeout + WATCH_GRACE:g} s of asking for {self.watch_timeout} s "
                f"(a proxy or NAT in between stalled or forgot it)"
            ) from None


def _message(body: str) -> str:
    """The `message` of a Kubernetes Status body, else the body itself."""
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("message") or body)
    return body
