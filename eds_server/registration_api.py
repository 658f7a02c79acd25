"""The registration API (aiohttp): endpoints that are not containers register, renew and leave.

    PUT    /v1/groups/{group}/endpoints/{id}   register (201) or replace/renew (200); needs the token
    DELETE /v1/groups/{group}/endpoints/{id}   204, or 404; needs the token
    GET    /v1/groups/{group}/endpoints/{id}   one registration, or 404
    GET    /v1/groups/{group}/endpoints        the registrations of one group (an empty list if none)
    GET    /v1/registrations                   all of them

Errors are JSON, `{"error": "...", "field": "..." | null}`, and change nothing. A 2xx answer to a
write is sent only once the state file holds the change and the store serves it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from aiohttp import web

from .admin import endpoint_json
from .sources.registrations import (
    REGISTRATION_KEYS,
    TTL_KEY,
    Registration,
    RegistrationError,
    RegistrationSource,
    check_group,
    check_id,
    check_ttl,
    parse_endpoint,
    reject_constant,
)

MAX_BODY = 64 * 1024
BODY_TIMEOUT = 10.0  # seconds to receive a whole request body
ENDPOINT_PATH = "/v1/groups/{group}/endpoints/{id}"
NO_TOKEN = (
    "registration writes are disabled: start eds-server with --admin-token TOKEN "
    "(or EDS_ADMIN_TOKEN) and send it as 'Authorization: Bearer TOKEN'"
)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status, headers=headers)


def registration_json(source: RegistrationSource, reg: Registration) -> dict[str, Any]:
    out: dict[str, Any] = {"group": reg.group, "id": reg.id, **endpoint_json(reg.endpoint)}
    if reg.ttl is not None:
        out["ttl"] = reg.ttl
        out["expires_in"] = round(source.expires_in(reg) or 0.0, 3)
    return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


class _Api:
    def __init__(self, source: RegistrationSource, token: str | None, max_body: int, body_timeout: float) -> None:
        self.source = source
        token = (token or "").strip()  # e.g. EDS_ADMIN_TOKEN="$(cat file)" with a newline
        self.token = token.encode() if token else None  # an empty token is no token: writes stay off
        self.max_body = max_body
        self.body_timeout = body_timeout

    # -- checks --------------------------------------------------------------------------------
    def _authorize(self, request: web.Request) -> web.Response | None:
        if self.token is None:
            return error(403, NO_TOKEN)
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: aiohttp hands non-UTF-8 header bytes over as surrogates; this gives them back
        given = presented.strip().encode("utf-8", "surrogateescape")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given, self.token)
        if ok:
            return None
        challenge = 'Bearer realm="eds-server"' + (', error="invalid_token"' if presented else "")
        return error(401, "a valid 'Authorization: Bearer TOKEN' header is needed", headers={
            "WWW-Authenticate": challenge,
        })  # fmt: skip

    @staticmethod
    def _path(request: web.Request, with_id: bool = True) -> tuple[str, str]:
        try:
            group = check_group(request.match_info["group"])
        except ValueError as e:
            raise RegistrationError(422, str(e), "group") from None
        if not with_id:
            return group, ""
        try:
            return group, check_id(request.match_info["id"])
        except ValueError as e:
            raise RegistrationError(422, str(e), "id") from None

    async def _body(self, request: web.Request) -> bytes:
        too_big = RegistrationError(413, f"the body is over {self.max_body} bytes")
        if request.content_length is not None and request.content_length > self.max_body:
            raise too_big
        chunks: list[bytes] = []
        total = 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:  # bounded: ends at the end of the body or once over the limit
                    chunk = await request.content.read(min(65536, self.max_body + 1 - total))
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > self.max_body:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise RegistrationError(408, f"the body did not arrive within {self.body_timeout:g}s") from None
        return b"".join(chunks)

    def _parse(self, body: bytes) -> dict[str, Any]:
        try:
            value = json.loads(
                body.decode("utf-8"),
                object_pairs_hook=_no_duplicates, parse_constant=reject_constant, parse_float=_finite,
            )  # fmt: skip
        except _DuplicateKey as e:
            raise RegistrationError(422, "duplicate key", e.key) from None
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise RegistrationError(400, f"the body is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise RegistrationError(400, "the body must be a JSON object with the endpoint's fields")
        return value

    # -- handlers ------------------------------------------------------------------------------
    async def put(self, request: web.Request) -> web.Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        try:
            group, id = self._path(request)
            spec = self._parse(await self._body(request))
            endpoint = parse_endpoint({k: v for k, v in spec.items() if k != TTL_KEY}, REGISTRATION_KEYS)
            try:
                ttl = check_ttl(spec.get(TTL_KEY))
            except ValueError as e:
                raise RegistrationError(422, str(e), TTL_KEY) from None
            reg, created = await self.source.put(group, id, endpoint, ttl)
        except RegistrationError as e:
            return error(e.status, e.message, e.field)
        headers = {"Location": str(request.rel_url)} if created else None
        return web.json_response(registration_json(self.source, reg), status=201 if created else 200, headers=headers)

    async def delete(self, request: web.Request) -> web.Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        try:
            group, id = self._path(request)
            await self.source.delete(group, id)
        except RegistrationError as e:
            return error(e.status, e.message, e.field)
        return web.Response(status=204)

    async def get_one(self, request: web.Request) -> web.Response:
        group, id = request.match_info["group"], request.match_info["id"]
        reg = self.source.get(group, id)
        if reg is None:
            return error(404, f"no registration {id!r} in group {group!r}")
        return web.json_response(registration_json(self.source, reg))

    async def list_group(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        regs = sorted(self.source.registrations(group), key=lambda r: r.id)
        return web.json_response({"group": group, "registrations": [registration_json(self.source, r) for r in regs]})

    async def list_all(self, _: web.Request) -> web.Response:
        regs = sorted(self.source.registrations(), key=lambda r: (r.group, r.id))
        return web.json_response({
            "registrations": [registration_json(self.source, r) for r in regs],
            "count": len(regs),
            "max_registrations": self.source.max_registrations,
        })  # fmt: skip


def add_routes(
    app: web.Application,
    source: RegistrationSource,
    token: str | None,
    *,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT,
) -> None:
    """Serve the registration API from `app` (before it starts). With no token, writes answer 403."""
    api = _Api(source, token, max_body, body_timeout)
    app.router.add_put(ENDPOINT_PATH, api.put)
    app.router.add_delete(ENDPOINT_PATH, api.delete)
    app.router.add_get(ENDPOINT_PATH, api.get_one)
    app.router.add_get("/v1/groups/{group}/endpoints", api.list_group)
    app.router.add_get("/v1/registrations", api.list_all)
