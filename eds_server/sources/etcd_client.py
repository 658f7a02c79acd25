"""A small etcd v3 client over the gRPC-JSON gateway, on the aiohttp the server already uses.

Only what registrations need: unary calls (range, txn, lease grant/keepalive/revoke), tried on the
members in turn until a deadline, and one watch stream. Every call is bounded in time, so a write
while etcd is away answers within a few seconds instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from .etcd_wire import EtcdError, EtcdTarget, WatchMessage, error_of, watch_message

log = logging.getLogger("eds_server.sources.etcd")

MAX_LINE = 64 * 1024 * 1024  # one watch message (a batch of events) at most


class EtcdUnavailable(Exception):
    """No member answered in time (for a change: it may or may not have been made)."""


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd: TLS (on when a CA or a client certificate is given) and user/password auth."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


class EtcdClient:
    def __init__(self, target: EtcdTarget, options: EtcdOptions, *, call_timeout: float = 1.5) -> None:
        self.target = target
        self.options = options
        self.call_timeout = call_timeout
        scheme = "https" if options.tls else "http"
        self._bases = [f"{scheme}://[{h}]:{p}" if ":" in h else f"{scheme}://{h}:{p}" for h, p in target.endpoints]
        self._current = 0  # the member tried first (the last one that answered)
        self._ssl = options.ssl_context()
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self.watching = self._bases[0]  # the member the last watch was opened on

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else False, limit=64)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def forget_token(self) -> None:
        """The next call authenticates again (the token expired)."""
        self._token = None

    @property
    def member(self) -> str:
        return self._bases[self._current]

    def rotate(self) -> None:
        self._current = (self._current + 1) % len(self._bases)

    def move_off(self, member: str) -> None:
        """The next call or watch starts on the member after `member` (one that stopped answering)."""
        if member in self._bases:
            self._current = (self._bases.index(member) + 1) % len(self._bases)

    async def _authenticate(self, base: str) -> None:
        opts = self.options
        reply = await self._post(
            base, "/v3/auth/authenticate", {"name": opts.user, "password": opts.password}, auth=False
        )
        token = reply.get("token")
        if not isinstance(token, str):
            raise EtcdError("authentication gave no token")
        self._token = token

    async def _post(self, base: str, path: str, body: dict[str, Any], *, auth: bool = True) -> dict[str, Any]:
        headers = {"Authorization": self._token} if auth and self._token else None
        timeout = aiohttp.ClientTimeout(total=self.call_timeout)
        async with self._http().post(base + path, json=body, headers=headers, timeout=timeout) as r:
            data = await r.read()
        try:
            reply = json.loads(data) if data else {}
        except ValueError:
            raise EtcdError(f"HTTP {r.status}: not JSON: {data[:200]!r}", 14 if r.status >= 500 else 0) from None
        err = error_of(reply)
        if err is not None:
            raise err
        if r.status != 200:
            raise EtcdError(f"HTTP {r.status}", 14 if r.status >= 500 else 0)
        if not isinstance(reply, dict):
            raise EtcdError("not a JSON object")
        return reply

    async def call(
        self, path: str, body: dict[str, Any], *, deadline: float, member: str | None = None, once: bool = False
    ) -> dict[str, Any]:
        """POST `body` to `path`, trying the members in turn until one answers or `deadline` (loop time)
        passes; with `member`, that member only (a probe of the one a watch is on must not succeed
        through another). Raises EtcdError for an answer that says no, EtcdUnavailable when none answered.

        `once`: a change that must not be applied twice. It is sent again only when it cannot have
        been applied (the connection was refused, no leader); after a timeout or a lost answer it
        may still be, later (a member that hung with it resumes): EtcdUnavailable at once."""
        loop = asyncio.get_running_loop()
        reason = "no member tried"
        for _ in range(8 * len(self._bases)):  # bounded: also by the deadline
            left = deadline - loop.time()
            if left <= 0:
                break
            base = member or self.member
            try:
                async with asyncio.timeout(min(left, self.call_timeout)):
                    if self.options.user and self._token is None:
                        await self._authenticate(base)
                    try:
                        return await self._post(base, path, body)
                    except EtcdError as e:
                        if not (e.auth_expired and self.options.user):
                            raise
                        await self._authenticate(base)
                        return await self._post(base, path, body)
            except EtcdError as e:
                if not e.retryable:
                    raise
                reason = f"{base}: {e.message}"
                if once and not e.not_applied:
                    raise EtcdUnavailable(f"{reason}; it may still be applied") from None
            except aiohttp.ClientConnectorError as e:  # never sent
                reason = f"{base}: {type(e).__name__}: {e}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                reason = f"{base}: {type(e).__name__}: {e}" if str(e) else f"{base}: {type(e).__name__}"
                if once:
                    if member is None:
                        self.rotate()  # the next call tries another member first
                    raise EtcdUnavailable(f"{reason} (no answer: it may or may not have been applied)") from None
            if member is None:
                self.rotate()
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
        raise EtcdUnavailable(reason)

    async def watch(
        self,
        body: dict[str, Any],
        connect_timeout: float,
        member: str | None = None,
    ) -> AsyncIterator[WatchMessage]:
        """One watch stream on `member` (default: the current one), kept in `watching`: its messages
        until it ends (raises on an error)."""
        base = self.watching = member or self.member
        if self.options.user and self._token is None:
            await self._authenticate(base)
        headers = {"Authorization": self._token} if self._token else None
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout)
        async with self._http().post(base + "/v3/watch", json=body, headers=headers, timeout=timeout) as r:
            if r.status != 200:
                raise EtcdError(f"watch: HTTP {r.status}: {(await r.read())[:200]!r}")
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                if len(buffer) > MAX_LINE:
                    raise EtcdError("watch: a message over the size limit")
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        message = watch_message(line)
                        yield message
            if buffer.strip():
                yield watch_message(buffer)
