"""Admin HTTP (aiohttp): liveness, readiness and what is being served, as JSON; every error is JSON
too. `GET /` is the same data as a small HTML page (status_page.py)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from . import __version__, status_page
from .encoded import Resource
from .metrics import public_exposition
from .model import Endpoint, endpoint_json
from .registration_api import RegistrationPolicy, add_routes, registration_json
from .serving_state import serving_state, source_kind

if TYPE_CHECKING:
    from .sources.registrations import Registrations

log = logging.getLogger("eds_server.admin")

PATHS = (
    "/",
    "/healthz",
    "/readyz",
    "/v1/groups",
    "/v1/groups/{name}",
    "/v1/sources",
    "/v1/stats",
    "/v1/streams",
    "/metrics",
)
PROBE_PATHS = ("/metrics", "/healthz", "/readyz")  # all that --metrics-listen serves
REGISTRATIONS_OFF = (
    "the registration API is off: start eds-server with --state FILE and/or --admin-token TOKEN "
    "(EDS_STATE, EDS_ADMIN_TOKEN)"
)


def json_errors(registrations_on: bool, paths: tuple[str, ...] = PATHS) -> Callable[..., Awaitable[web.StreamResponse]]:
    """aiohttp's own errors (unknown path, wrong method, a handler's crash) as JSON with a hint, like
    every answer of the admin API, instead of `404: Not Found` text."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400 or e.content_type == "application/json":
                raise
            body: dict[str, Any] = {"error": (e.reason or "error").lower(), "path": request.path}
            if e.status == 404:
                registration_path = request.path.startswith("/v1/registrations") or (
                    request.path.startswith("/v1/groups/") and "/endpoints" in request.path
                )
                if registration_path and not registrations_on and paths is PATHS:
                    body["hint"] = REGISTRATIONS_OFF
                else:
                    body["hint"] = "paths: " + ", ".join(paths)
            elif e.status == 405:
                body["hint"] = f"allowed: {e.headers.get('Allow', 'GET')}"
            headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
            return web.json_response(body, status=e.status, headers=headers)
        except Exception:
            log.exception("admin %s %s failed", request.method, request.path)
            return web.json_response({"error": "internal error (logged)", "path": request.path}, status=500)

    return middleware


Checks = Callable[[Endpoint], dict[str, Any] | None]  # an endpoint's last health check (health/checker.py)


class ServedGroups(Protocol):
    """What the admin port reads of the store (`store.Store`): readiness, the groups served and
    where each one's endpoints came from. Nothing here writes to it or follows it."""

    @property
    def ready(self) -> bool: ...
    @property
    def pending_sources(self) -> tuple[str, ...]: ...
    def resources(self) -> Mapping[str, Resource]: ...
    def sources_of(self, name: str) -> list[str]: ...
    def endpoint_sources(self, name: str) -> dict[tuple[str, int], str]: ...
    def is_stale(self, name: str) -> bool: ...
    def conflict(self, name: str) -> str | None: ...


def group_json(
    store: ServedGroups, resource: Resource, *, endpoint_sources: bool = False, checks: Checks | None = None
) -> dict[str, Any]:
    group = resource.group
    endpoints = [endpoint_json(e) for e in group.endpoints]
    if checks is not None:
        for ep, out in zip(group.endpoints, endpoints, strict=True):
            if (check := checks(ep)) is not None:
                out["check"] = check
    if endpoint_sources:
        given_by = store.endpoint_sources(resource.name)
        for ep, out in zip(group.endpoints, endpoints, strict=True):
            out["source"] = given_by.get(ep.key)
    return {
        "name": resource.name,
        "version": resource.version,
        "sources": store.sources_of(resource.name),
        "stale": store.is_stale(resource.name),
        "error": store.conflict(resource.name),  # why the sources' merged endpoints are not what is served
        "endpoints": endpoints,
        "localities": [
            {"region": loc.region, "zone": loc.zone, "subzone": loc.subzone, "weight": w}
            for loc, w in group.locality_weights.items()
        ],
    }


class WorkerAnswers(Protocol):
    """What the admin port asks of `--workers N`'s workers (workers.WorkerPool), named here so the
    port knows nothing of what runs above it."""

    async def not_ready(self) -> list[int]: ...
    async def streams(self, after: int, limit: int) -> dict[str, Any]: ...
    async def stats(self, own: dict[str, Any]) -> dict[str, Any]: ...
    async def metrics(self, own: str) -> str: ...


def make_app(
    store: ServedGroups,
    source_status: Callable[[], list[dict[str, Any]]],
    stats: Callable[[], dict[str, Any]],
    streams: Callable[[int, int], dict[str, Any]],  # (after, limit) -> one page
    registry: CollectorRegistry,
    registrations: Registrations | None = None,
    admin_token: str | None = None,
    registration_policy: RegistrationPolicy | None = None,
    workers: WorkerAnswers | None = None,  # --workers N: streams, stats and metrics are the workers'
    shed: Callable[[int, int], Awaitable[dict[str, int]]] | None = None,  # a worker's: its owner moves load
    read_only_probes: bool = False,  # --metrics-listen: /metrics, /healthz and /readyz, nothing else
    checks: Checks | None = None,  # each endpoint's last health check, shown with it
) -> web.Application:
    async def all_streams(after: int, limit: int) -> dict[str, Any]:
        return await workers.streams(after, limit) if workers is not None else streams(after, limit)

    async def all_stats() -> dict[str, Any]:
        return await workers.stats(stats()) if workers is not None else stats()

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        pending = store.pending_sources
        statuses = source_status()
        state = serving_state(store.ready, statuses)
        # degraded stays 200: Envoy-facing readiness must not flap while the last good state is served
        if read_only_probes:  # for other hosts: the state, and which kinds of source; the why on --admin
            body: dict[str, Any] = {
                "ready": store.ready,
                "state": state.name,
                "detail": state.describe(public=True),
                "degraded": [{"source": source_kind(d.source)} for d in state.degraded],
                "pending_sources": [source_kind(name) for name in pending],
            }
        else:
            body = {
                "ready": store.ready,
                "state": state.name,
                "detail": state.describe(),
                "degraded": [{"source": d.source, "reason": d.reason} for d in state.degraded],
                "pending_sources": list(pending),
                # what each source still waited on is saying, so an unhealthy container says why
                "waiting_for": [
                    {"source": s["name"], "last_error": s.get("last_error")} for s in statuses if s["name"] in pending
                ],
            }
        if workers is not None:  # Envoy is served by the workers: ready once they all are
            waiting = await workers.not_ready()
            body["workers_not_ready"] = waiting
            body["ready"] = store.ready and not waiting
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def groups(_: web.Request) -> web.Response:
        resources = store.resources()
        shown = [group_json(store, resources[n], checks=checks) for n in sorted(resources)]
        return web.json_response({"groups": shown})

    async def group(request: web.Request) -> web.Response:
        found = store.resources().get(request.match_info["name"])
        if found is None:
            return web.json_response(
                {
                    "error": "no such group",
                    "group": request.match_info["name"],
                    "hint": "every group served: GET /v1/groups",
                },
                status=404,
            )
        return web.json_response(group_json(store, found, endpoint_sources=True, checks=checks))

    async def sources(_: web.Request) -> web.Response:
        return web.json_response({"sources": source_status()})

    async def stats_handler(_: web.Request) -> web.Response:
        return web.json_response(await all_stats())

    async def streams_handler(request: web.Request) -> web.Response:
        # paged: a server may hold 100,000 streams; ?after=<next_after of the previous page>
        try:
            after = int(request.query.get("after", "0"))
            limit = min(int(request.query.get("limit", "100")), 1000)
            if limit < 1:
                raise ValueError
        except ValueError:
            return web.json_response({"error": "after and limit must be integers, limit >= 1"}, status=400)
        return web.json_response(await all_streams(after, limit))

    async def index(_: web.Request) -> web.Response:
        resources = store.resources()
        names = sorted(resources)
        shown = await all_streams(0, status_page.MOST_STREAMS)
        statuses = source_status()
        regs: list[dict[str, Any]] | None = None
        total_regs = 0
        if registrations is not None:
            everyone = sorted(registrations.registrations(), key=lambda r: (r.group, r.id))
            regs = [registration_json(registrations, r) for r in everyone[: status_page.MOST_GROUPS]]
            total_regs = len(everyone)
        page = status_page.render(
            version=__version__,
            state=serving_state(store.ready, statuses),
            sources=statuses,
            groups=[
                group_json(store, resources[n], endpoint_sources=True, checks=checks)
                for n in names[: status_page.MOST_GROUPS]
            ],
            total_groups=len(names),
            total_endpoints=sum(len(r.group.endpoints) for r in resources.values()),
            streams=shown["streams"],
            total_streams=shown["total"],
            stats=await all_stats(),
            registrations=regs,
            total_registrations=total_regs,
        )
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        if workers is not None:
            body = (await workers.metrics(body.decode())).encode()
        if read_only_probes:
            body = public_exposition(body.decode()).encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    if read_only_probes:  # nothing that names groups, sources or clients, and nothing that writes
        app = web.Application(middlewares=[json_errors(False, PROBE_PATHS)])
        for path, handler in (("/metrics", metrics), ("/healthz", healthz), ("/readyz", readyz)):
            app.router.add_get(path, handler)
        return app
    app = web.Application(middlewares=[json_errors(registrations is not None)])
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/groups", groups)
    app.router.add_get("/v1/groups/{name}", group)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/stats", stats_handler)
    app.router.add_get("/v1/streams", streams_handler)
    app.router.add_get("/metrics", metrics)
    if shed is not None:  # only on a worker's admin socket, which only its owner may reach

        async def shed_handler(request: web.Request) -> web.Response:
            streams, one_under = int(request.query["streams"]), int(request.query.get("one_under", "0"))
            return web.json_response(await shed(streams, one_under))

        app.router.add_post("/v1/worker/shed", shed_handler)
    if registrations is not None:
        add_routes(app, registrations, admin_token, policy=registration_policy)
    return app
