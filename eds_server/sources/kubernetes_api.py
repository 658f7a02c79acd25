"""The Kubernetes API as the source asks it: the kinds followed, one listing, one watch, the two
probes, and what their failures mean.

The list and watch requests go through the configuration's ApiClient, which adds fresh credentials
to each, and their JSON is read here as it is (`kubernetes_map` maps it). Each watch is short: it
asks the API server to end it after WATCH_SECONDS (4 s), and the watch cache sends a bookmark with
its current resourceVersion 2 s before that, so the next watch resumes from a fresh version. A watch
not ended WATCH_GRACE (1 s) after that, with nothing heard on it for as long, is Stalled: its own
connection died (a proxy or NAT in between stalled or forgot it), whatever the other connections say.
Apart from the source, so that each request, its timeouts and its errors read without the loop that
retries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .base import Hung
from .kubernetes_config import Configuration

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

Scope = tuple[Kind, str | None]  # a kind, in one namespace (None: all)


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


class Requests:
    """The requests the source makes, on the configuration's current ApiClient. Every answer is a
    sign of life, told to `heard` (the heartbeat's beat); `watches_open` counts the watches under way."""

    def __init__(
        self,
        config: Configuration,
        heard: Callable[[], None],
        *,
        request_timeout: float = 30.0,
        watch_timeout: int = WATCH_SECONDS,
        probe_timeout: float = 2.0,
    ) -> None:
        self.config, self.heard = config, heard
        self.request_timeout, self.watch_timeout, self.probe_timeout = request_timeout, watch_timeout, probe_timeout
        self.watches_open = 0

    async def get(self, path: str, query: list[tuple[str, str]], read_timeout: float | None) -> Any:
        """The response to a GET, status 200; Gone on 410, Unauthorized on 401, ApiError otherwise."""
        timeout = aiohttp.ClientTimeout(sock_connect=self.request_timeout, sock_read=read_timeout)
        resp = await self.config.api.call_api(
            path,
            "GET",
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        self.heard()
        if resp.status == 410:
            resp.release()
            raise Gone()
        if resp.status != 200:
            body = (await resp.read())[:500].decode(errors="replace")
            resp.release()
            error = Unauthorized if resp.status == 401 else ApiError
            raise error(f"GET {path}: {resp.status}: {_message(body)}", resp.status)
        return resp

    async def list(self, kind: Kind, namespace: str | None) -> tuple[list[Mapping[str, Any]], str]:
        """Every object of one kind in one scope, page by page, and the list's resourceVersion."""
        items: list[Mapping[str, Any]] = []
        cont = ""
        while True:
            query = [("limit", str(LIST_PAGE))]
            if kind.label_selector:
                query.append(("labelSelector", kind.label_selector))
            if cont:
                query.append(("continue", cont))
            resp = await self.get(kind.path(namespace), query, self.request_timeout)
            try:
                body = json.loads(await resp.read())
            finally:
                resp.release()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(
        self,
        kind: Kind,
        namespace: str | None,
        at: Cursor,
        opened: Callable[[], None],
        event: Callable[[str, Mapping[str, Any]], None],
    ) -> None:
        """Call `opened` once the watch is answered, then `event` for each change (ADDED, MODIFIED,
        DELETED) until the server ends the watch (it is asked to after `watch_timeout` s), keeping
        `at` at the last resourceVersion seen. Stalled when it has not ended WATCH_GRACE after that,
        with nothing heard on it for as long: its connection is dead, whatever the heartbeat hears
        on the others."""
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
                resp = await self.get(kind.path(namespace), query, None)
                self.watches_open += 1
                try:
                    opened()
                    async for line in resp.content:
                        self.heard()
                        if (due := loop.time() + WATCH_GRACE) > (deadline.when() or 0.0):
                            deadline.reschedule(due)  # still talking past its end: not dead
                        if not line.strip():
                            continue
                        change = json.loads(line)
                        etype, obj = change.get("type"), change.get("object") or {}
                        if etype == "ERROR":
                            if obj.get("code") == 410:
                                raise Gone()
                            code = obj.get("code")
                            status = code if isinstance(code, int) else 0
                            raise ApiError(f"watch {kind.name}: {code}: {obj.get('message')}", status)
                        at.version = str((obj.get("metadata") or {}).get("resourceVersion") or at.version)
                        if etype in ("ADDED", "MODIFIED", "DELETED"):
                            event(etype, obj)
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

    async def readyz(self) -> bool:
        """Whether the API server answers GET /readyz within `probe_timeout`. 401 and 403 count (it
        is there and refusing us; the real request will say why); a 5xx or no answer does not."""
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        try:
            resp = await self.config.api.call_api(
                "/readyz",
                "GET",
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout,
            )
            resp.release()
            return resp.status in (200, 401, 403)
        except Exception:
            return False

    async def livez(self) -> None:
        """GET /livez, for the heartbeat: any status is an answer (it asks only whether the server is
        there; what it refuses is the real requests' to say)."""
        resp = await self.config.api.call_api("/livez", "GET", auth_settings=["BearerToken"], _preload_content=False)
        resp.release()


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


def _message(body: str) -> str:
    """The `message` of a Kubernetes Status body, else the body itself."""
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("message") or body)
    return body
