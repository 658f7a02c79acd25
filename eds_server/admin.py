"""Admin HTTP (aiohttp): liveness, readiness and what is being served, as JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .model import endpoint_json
from .registration_api import RegistrationPolicy, add_routes
from .store import Resource, Store

if TYPE_CHECKING:
    from .sources.registrations import RegistrationSource


def group_json(store: Store, resource: Resource, *, endpoint_sources: bool = False) -> dict[str, Any]:
    group = resource.group
    endpoints = [endpoint_json(e) for e in group.endpoints]
    if endpoint_sources:
        given_by = store.endpoint_sources(resource.name)
        for ep, out in zip(group.endpoints, endpoints, strict=True):
            out["source"] = given_by.get(ep.key)
    return {
        "name": resource.name,
        "version": resource.version,
        "sources": store.sources_of(resource.name),
        "stale": store.is_stale(resource.name),
        "endpoints": endpoints,
        "localities": [
            {"region": loc.region, "zone": loc.zone, "subzone": loc.subzone, "weight": w}
            for loc, w in group.locality_weights.items()
        ],
    }


def make_app(
    store: Store,
    source_status: Callable[[], list[dict[str, Any]]],
    stats: Callable[[], dict[str, Any]],
    streams: Callable[[], list[dict[str, Any]]],
    registry: CollectorRegistry,
    registrations: RegistrationSource | None = None,
    admin_token: str | None = None,
    registration_policy: RegistrationPolicy | None = None,
) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        body = {"ready": store.ready, "pending_sources": list(store.pending_sources)}
        return web.json_response(body, status=200 if store.ready else 503)

    async def groups(_: web.Request) -> web.Response:
        resources = store.resources()
        return web.json_response(
            {"groups": [group_json(store, resources[n]) for n in sorted(resources)]}
        )

    async def group(request: web.Request) -> web.Response:
        found = store.resources().get(request.match_info["name"])
        if found is None:
            return web.json_response({"error": "no such group"}, status=404)
        return web.json_response(group_json(store, found, endpoint_sources=True))

    async def sources(_: web.Request) -> web.Response:
        return web.json_response({"sources": source_status()})

    async def stats_handler(_: web.Request) -> web.Response:
        return web.json_response(stats())

    async def streams_handler(_: web.Request) -> web.Response:
        return web.json_response({"streams": streams()})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/groups", groups)
    app.router.add_get("/v1/groups/{name}", group)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/stats", stats_handler)
    app.router.add_get("/v1/streams", streams_handler)
    app.router.add_get("/metrics", metrics)
    if registrations is not None:
        add_routes(app, registrations, admin_token, policy=registration_policy)
    return app
