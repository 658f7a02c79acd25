"""Admin HTTP (aiohttp): liveness, readiness and what is being served, as JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .model import Endpoint
from .store import Resource, Store

if TYPE_CHECKING:
    from .sources.registrations import RegistrationSource


def endpoint_json(ep: Endpoint) -> dict[str, Any]:
    out: dict[str, Any] = {"address": ep.address, "port": ep.port, "health": ep.health.name.lower()}
    if ep.weight is not None:
        out["weight"] = ep.weight
    if ep.priority:
        out["priority"] = ep.priority
    for key in ("region", "zone", "subzone"):
        if value := getattr(ep.locality, key):
            out[key] = value
    if ep.hostname:
        out["hostname"] = ep.hostname
    if ep.metadata:
        out["metadata"] = dict(ep.metadata)
    return out


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
    streams: Callable[[int, int], dict[str, Any]],  # (after, limit) -> one page
    registry: CollectorRegistry,
    registrations: RegistrationSource | None = None,
    admin_token: str | None = None,
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

    async def streams_handler(request: web.Request) -> web.Response:
        # paged: a server may hold 100,000 streams; ?after=<next_after of the previous page>
        try:
            after = int(request.query.get("after", "0"))
            limit = min(int(request.query.get("limit", "100")), 1000)
            if limit < 1:
                raise ValueError
        except ValueError:
            return web.json_response({"error": "after and limit must be integers, limit >= 1"}, status=400)
        return web.json_response(streams(after, limit))

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
        from .registration_api import add_routes  # not at the top: registration_api imports this module

        add_routes(app, registrations, admin_token)
    return app
