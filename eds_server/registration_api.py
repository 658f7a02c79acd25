"""The registration API (aiohttp): endpoints that are not containers register, renew and leave.

    PUT    /v1/groups/{group}/endpoints/{id}   register (201) or replace/renew (200); needs the token
    DELETE /v1/groups/{group}/endpoints/{id}   204, or 404; needs the token
    GET    /v1/groups/{group}/endpoints/{id}   one registration, or 404
    GET    /v1/groups/{group}/endpoints        the registrations of one group (an empty list if none)
    GET    /v1/registrations                   all of them

Errors are JSON, `{"error": "...", "field": "..." | null}`, and change nothing. A 2xx answer to a
write is sent only once the state (a file, or etcd) holds the change and the store serves it.

Writes need the admin token (every group) or a scoped token (the groups its patterns match, from
`--registration-tokens FILE`); tokens are at least 16 characters. A client IP that fails to
authenticate too often gets 429 for a while, its correct guesses included. Targets must not be
loopback, link-local (cloud metadata), unspecified or multicast addresses unless a CIDR of
`--registration-allow-cidr` holds them: a registration must not point Envoy at itself or its host.

Every write, done or refused, is one INFO line of the `eds_server.audit` logger: id, group,
address:port, the token's name (never the token), the peer and the result, as fields of their own
with `--log-format json`, so who changed what Envoy sees can be answered afterwards.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web

from .model import Endpoint, endpoint_json
from .ratelimit import PerKey
from .security import Glob
from .sources.registrations import (
    REGISTRATION_KEYS,
    TTL_KEY,
    Registration,
    RegistrationError,
    Registrations,
    check_group,
    check_id,
    check_ttl,
    parse_endpoint,
    reject_constant,
)

MIN_TOKEN_LENGTH = 16
AUTH_FAILURES = 20  # failed authentications per client IP per AUTH_WINDOW, then 429
AUTH_WINDOW = 60.0
MAX_BODY = 64 * 1024
BODY_TIMEOUT = 10.0  # seconds to receive a whole request body
ENDPOINT_PATH = "/v1/groups/{group}/endpoints/{id}"
NO_TOKEN = (
    "registration writes are disabled: start eds-server with --admin-token TOKEN "
    "(or EDS_ADMIN_TOKEN) and send it as 'Authorization: Bearer TOKEN'"
)


audit_log = logging.getLogger("eds_server.audit")
ADMIN = "admin"  # the token name of the admin token in audit lines


class RegistrationConfigError(Exception):
    """Unusable registration settings (token, token file, CIDRs): the server must not start."""


def check_token(token: str, what: str = "--admin-token") -> str:
    token = token.strip()  # e.g. EDS_ADMIN_TOKEN="$(cat file)" with a newline
    if len(token) < MIN_TOKEN_LENGTH:
        raise RegistrationConfigError(
            f"{what} is {len(token)} characters; at least {MIN_TOKEN_LENGTH} are needed (e.g. `openssl rand -hex 16`)"
        )
    return token


@dataclass(frozen=True)
class ScopedToken:
    token: bytes = field(repr=False)
    groups: tuple[Glob, ...]  # the groups it may write
    name: str = "scoped"  # what audit lines call it: the file's `name:`, else `tokens[i]`

    def may_write(self, group: str) -> bool:
        return any(g.match(group) for g in self.groups)


@dataclass(frozen=True)
class RegistrationPolicy:
    """Who may write which group, and which addresses may be registered."""

    scoped_tokens: tuple[ScopedToken, ...] = ()
    allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()  # CIDRs exempt from the refusals
    auth_failures: int = AUTH_FAILURES
    auth_window: float = AUTH_WINDOW

    def address_problem(self, address: str) -> str | None:
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.allow):
            return None
        for kind, bad in (
            ("loopback", ip.is_loopback),
            ("link-local", ip.is_link_local),
            ("unspecified", ip.is_unspecified),
            ("multicast", ip.is_multicast),
        ):
            if bad:
                return (
                    f"{address} is a {kind} address; registering it takes --registration-allow-cidr "
                    "(EDS_REGISTRATION_ALLOW_CIDR) holding it"
                )
        return None


def parse_cidrs(values: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    out = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                try:
                    out.append(ipaddress.ip_network(part.strip(), strict=False))
                except ValueError as e:
                    raise RegistrationConfigError(f"--registration-allow-cidr: {e}") from None
    return tuple(out)


def load_scoped_tokens(path: str) -> tuple[ScopedToken, ...]:
    """`tokens: [{token: "...", groups: ["shop-*", "web"], name: "shop-ci"}, ...]` (`*`: any run of
    characters; `name`, optional, is what audit lines call the token: `tokens[i]` without it)."""
    try:
        with open(path, "rb") as f:
            data = yaml.safe_load(f.read(1024 * 1024))
    except (OSError, yaml.YAMLError) as e:
        raise RegistrationConfigError(f"{path}: {e}") from None
    entries = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(entries, list) or set(data) != {"tokens"}:
        raise RegistrationConfigError(f"{path}: expected a mapping with one key, tokens: a list")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: tokens[{i}]"
        if not isinstance(entry, dict) or not {"token", "groups"} <= set(entry) <= {"token", "groups", "name"}:
            raise RegistrationConfigError(f"{where}: expected the keys token and groups (and name, optional)")
        token, groups, name = entry["token"], entry["groups"], entry.get("name", f"tokens[{i}]")
        if not isinstance(name, str) or not name.strip():
            raise RegistrationConfigError(f"{where}.name: expected a non-empty string")
        if not isinstance(token, str):
            raise RegistrationConfigError(f"{where}.token: expected a string")
        if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and g for g in groups):
            raise RegistrationConfigError(f"{where}.groups: expected a list of group patterns")
        out.append(
            ScopedToken(check_token(token, f"{where}.token").encode(), tuple(Glob(g) for g in groups), name.strip())
        )
    return tuple(out)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status, headers=headers)


def registration_json(source: Registrations, reg: Registration) -> dict[str, Any]:
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


@dataclass
class _Audit:
    """What one write did, filled in as it becomes known, logged once when it is answered."""

    method: str
    peer: str
    group: str
    id: str
    token_name: str | None = None  # None: no valid token was presented
    address: str | None = None
    port: int | None = None
    result: str | None = None  # created, updated, renewed, deleted; else the refusal's status

    def endpoint(self, endpoint: Endpoint) -> None:
        self.address, self.port = endpoint.address, endpoint.port

    def log(self, response: web.StreamResponse) -> None:
        result = self.result or str(response.status)
        where = f"[{self.address}]" if self.address and ":" in self.address else self.address
        target = f"{where}:{self.port}" if self.address is not None else "-"
        audit_log.info(
            "registration %s %s: group=%r id=%r endpoint=%s token=%s peer=%s",
            self.method,
            result,
            self.group,
            self.id,
            target,
            self.token_name or "-",
            self.peer,
            extra={
                "event": "registration",
                "method": self.method,
                "result": result,
                "status": response.status,
                "group": self.group,
                "id": self.id,
                "address": self.address,
                "port": self.port,
                "token_name": self.token_name,
                "peer": self.peer,
            },
        )


def audited(
    handler: Callable[[_Api, web.Request, _Audit], Awaitable[web.Response]],
) -> Callable[[_Api, web.Request], Awaitable[web.Response]]:
    """One audit line per answered write, whatever path the handler took to its answer."""

    async def wrapper(self: _Api, request: web.Request) -> web.Response:
        audit = _Audit(
            request.method, request.remote or "?", request.match_info.get("group", ""), request.match_info.get("id", "")
        )
        response = await handler(self, request, audit)
        audit.log(response)
        return response

    return wrapper


class _Api:
    def __init__(
        self,
        source: Registrations,
        token: str | None,
        max_body: int,
        body_timeout: float,
        policy: RegistrationPolicy,
    ) -> None:
        self.source = source
        token = (token or "").strip()
        # an empty token is no token: writes stay off (unless scoped tokens are given)
        self.token = check_token(token).encode() if token else None
        self.policy = policy
        self.failures = PerKey(policy.auth_failures, policy.auth_window)
        self.max_body = max_body
        self.body_timeout = body_timeout

    # -- checks --------------------------------------------------------------------------------
    def _authenticate(self, request: web.Request) -> web.Response | list[ScopedToken] | None:
        """The refusal, or who is asking: None for the admin token, else the scoped tokens presented
        (which groups they may write is `_may_write`'s)."""
        if self.token is None and not self.policy.scoped_tokens:
            return error(403, NO_TOKEN)
        peer = request.remote or "?"
        failures = self.failures.get(peer)
        if not failures.peek():
            retry = max(1, round(failures.seconds_to_next))
            return error(
                429,
                "too many failed authentications from this address; retry later",
                headers={"Retry-After": str(retry)},
            )
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # surrogateescape: aiohttp hands non-UTF-8 header bytes over as surrogates; this gives them back
        given = presented.strip().encode("utf-8", "surrogateescape")
        bearer = scheme.lower() == "bearer"
        if bearer and self.token is not None and hmac.compare_digest(given, self.token):
            return None
        scoped = [t for t in self.policy.scoped_tokens if hmac.compare_digest(given, t.token)] if bearer else []
        if scoped:
            return scoped
        failures.take()
        challenge = 'Bearer realm="eds-server"' + (', error="invalid_token"' if presented else "")
        return error(
            401,
            "a valid 'Authorization: Bearer TOKEN' header is needed",
            headers={
                "WWW-Authenticate": challenge,
            },
        )

    @staticmethod
    def _may_write(scoped: list[ScopedToken] | None, group: str, audit: _Audit) -> web.Response | None:
        if scoped is None:
            audit.token_name = ADMIN
            return None
        allowed = [t for t in scoped if t.may_write(group)]
        audit.token_name = (allowed or scoped)[0].name
        if allowed:
            return None
        return error(403, f"this token may not write group {group!r}", "group")

    def _check_address(self, endpoint: Endpoint) -> None:
        problem = self.policy.address_problem(endpoint.address)
        if problem is not None:
            raise RegistrationError(422, problem, "address")

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
                object_pairs_hook=_no_duplicates,
                parse_constant=reject_constant,
                parse_float=_finite,
            )
        except _DuplicateKey as e:
            raise RegistrationError(422, "duplicate key", e.key) from None
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise RegistrationError(400, f"the body is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise RegistrationError(400, "the body must be a JSON object with the endpoint's fields")
        return value

    # -- handlers ------------------------------------------------------------------------------
    @audited
    async def put(self, request: web.Request, audit: _Audit) -> web.Response:
        caller = self._authenticate(request)
        if isinstance(caller, web.Response):
            return caller
        try:
            group, id = self._path(request)
            if (denied := self._may_write(caller, group, audit)) is not None:
                return denied
            spec = self._parse(await self._body(request))
            endpoint = parse_endpoint({k: v for k, v in spec.items() if k != TTL_KEY}, REGISTRATION_KEYS)
            audit.endpoint(endpoint)
            self._check_address(endpoint)
            try:
                ttl = check_ttl(spec.get(TTL_KEY))
            except ValueError as e:
                raise RegistrationError(422, str(e), TTL_KEY) from None
            before = self.source.get(group, id)
            reg, created = await self.source.put(group, id, endpoint, ttl)
        except RegistrationError as e:
            return error(e.status, e.message, e.field)
        renewed = before is not None and before.endpoint == endpoint and before.ttl == ttl
        audit.result = "created" if created else "renewed" if renewed else "updated"
        headers = {"Location": str(request.rel_url)} if created else None
        return web.json_response(registration_json(self.source, reg), status=201 if created else 200, headers=headers)

    @audited
    async def delete(self, request: web.Request, audit: _Audit) -> web.Response:
        caller = self._authenticate(request)
        if isinstance(caller, web.Response):
            return caller
        try:
            group, id = self._path(request)
            if (denied := self._may_write(caller, group, audit)) is not None:
                return denied
            if (known := self.source.get(group, id)) is not None:
                audit.endpoint(known.endpoint)
            gone = await self.source.delete(group, id)
        except RegistrationError as e:
            return error(e.status, e.message, e.field)
        if gone is not None:
            audit.endpoint(gone.endpoint)
        audit.result = "deleted"
        return web.Response(status=204)

    async def get_one(self, request: web.Request) -> web.Response:
        group, id = request.match_info["group"], request.match_info["id"]
        try:
            reg = await self.source.read(group, id)
        except RegistrationError as e:
            return error(e.status, e.message, e.field)
        if reg is None:
            return error(404, f"no registration {id!r} in group {group!r}")
        return web.json_response(registration_json(self.source, reg))

    async def list_group(self, request: web.Request) -> web.Response:
        group = request.match_info["group"]
        regs = sorted(self.source.registrations(group), key=lambda r: r.id)
        return web.json_response({"group": group, "registrations": [registration_json(self.source, r) for r in regs]})

    async def list_all(self, _: web.Request) -> web.Response:
        regs = sorted(self.source.registrations(), key=lambda r: (r.group, r.id))
        return web.json_response(
            {
                "registrations": [registration_json(self.source, r) for r in regs],
                "count": len(regs),
                "max_registrations": self.source.max_registrations,
            }
        )


async def _write_needs_an_id(request: web.Request) -> web.Response:
    """A POST to a group's list, as many APIs take: say where a registration is written instead."""
    group = request.match_info["group"]
    return web.json_response(
        {
            "error": f"{request.method} is not allowed here: a registration is written under an id of its own",
            "field": None,
            "hint": f'PUT /v1/groups/{group}/endpoints/{{id}} with {{"address": ..., "port": ...}}',
        },
        status=405,
        headers={"Allow": "GET,HEAD"},
    )


def add_routes(
    app: web.Application,
    source: Registrations,
    token: str | None,
    *,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT,
    policy: RegistrationPolicy | None = None,
) -> None:
    """Serve the registration API from `app` (before it starts). With no token, writes answer 403."""
    api = _Api(source, token, max_body, body_timeout, policy or RegistrationPolicy())
    app.router.add_put(ENDPOINT_PATH, api.put)
    app.router.add_delete(ENDPOINT_PATH, api.delete)
    app.router.add_get(ENDPOINT_PATH, api.get_one)
    app.router.add_get("/v1/groups/{group}/endpoints", api.list_group)
    app.router.add_route("*", "/v1/groups/{group}/endpoints", _write_needs_an_id)
    app.router.add_get("/v1/registrations", api.list_all)
