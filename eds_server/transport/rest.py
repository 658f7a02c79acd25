"""REST-JSON EDS (`api_type: REST`): Envoy POSTs a DiscoveryRequest every `refresh_delay`.

Envoy treats any status but 200 and 304 as a failure (and keeps what it has), so unknown names get
an empty assignment rather than a 404, and a server that has not loaded its sources yet answers
503. There is no NACK: Envoy simply asks for the version it has again.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from ..encode import Encoders
from ..xds.common import (
    EDS_TYPE_URL,
    WILDCARD,
    ProtocolError,
    Resources,
    SubscriptionLimits,
    check_request,
    response_version,
)
from ..xds.wire import CONTROL_PLANE_ID

log = logging.getLogger("eds_server.rest")

PATH = "/v3/discovery:endpoints"


def make_rest_app(
    store: Resources, limits: SubscriptionLimits, max_body: int, encoders: Encoders | None = None
) -> web.Application:
    """The REST port's app; `encoders`: the server's (its JSON cache), or one of its own."""
    resource_json = (encoders or Encoders()).resource_json

    async def discovery(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            names = body.get("resourceNames", body.get("resource_names", []))
            version = body.get("versionInfo", body.get("version_info", ""))
            type_url = body.get("typeUrl", body.get("type_url", ""))
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("resourceNames must be a list of strings")
            check_request(type_url, names, limits)
        except ProtocolError as e:
            return web.json_response({"code": e.status, "message": e.message}, status=400)
        except (ValueError, AttributeError) as e:
            return web.json_response({"message": f"not a DiscoveryRequest: {e}"}, status=400)
        except RecursionError:  # json.loads on a deeply nested body
            return web.json_response({"message": "not a DiscoveryRequest: JSON nested too deeply"}, status=400)
        if not store.ready:
            return web.json_response({"message": "sources not loaded yet"}, status=503)
        wanted = [n for n in dict.fromkeys(names) if n != WILDCARD]  # EDS has no wildcard
        if missing := store.unanswered(wanted):  # a relay: only names its streams follow are held
            return web.json_response(
                {"message": f"not received from the upstream eds-server: {missing[:10]}"}, status=503
            )
        resources = [store.get(n) for n in wanted]
        current = response_version(resources) if resources else ""
        if version and version == current:
            return web.Response(status=304)
        return web.json_response(
            {
                "versionInfo": current,
                "resources": [resource_json(r) for r in resources],
                "typeUrl": EDS_TYPE_URL,
                "controlPlane": {"identifier": CONTROL_PLANE_ID},
            }
        )

    async def wrong_method(request: web.Request) -> web.Response:
        """A curl or browser GET gets JSON saying what this port serves, not aiohttp's plain `405`."""
        return web.json_response(
            {
                "message": f"{request.method} {request.path}: the REST port answers only POST {PATH} "
                "with a DiscoveryRequest (Envoy's api_type: REST)"
            },
            status=405 if request.path == PATH else 404,
            headers={"Allow": "POST"},
        )

    app = web.Application(client_max_size=max_body)
    app.router.add_post(PATH, discovery)
    app.router.add_route("*", PATH, wrong_method)
    app.router.add_route("*", "/{tail:.*}", wrong_method)
    return app
