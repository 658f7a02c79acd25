"""The leases registrations with a TTL are kept on: granted, kept alive, revoked.

A registration with a TTL is a key on a lease of its own, so it expires even while every eds-server
is down; a renewal keeps that lease alive, and a replaced or deleted registration's lease is
revoked. Apart from the source, so that the rules of a lease's life (whole seconds, a revocation
that may fail harmlessly) read in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

from . import etcd_wire as wire
from .etcd_client import EtcdClient, EtcdUnavailable
from .etcd_kv import WRITE_DEADLINE

log = logging.getLogger("eds_server.sources.registrations")


def lease_ttl(ttl: float) -> int:
    """etcd leases are whole seconds: round up (etcd itself raises it to its minimum, ~2 s by default)."""
    return max(1, math.ceil(ttl))


class Leases:
    """Lease calls through `client`, each bounded by the caller's deadline."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client

    async def grant(self, ttl: float, deadline: float) -> int:
        """A new lease of `ttl` (rounded up to whole seconds): its id."""
        reply = await self.client.call("/v3/lease/grant", {"TTL": str(lease_ttl(ttl))}, deadline=deadline)
        return int(reply["ID"])

    async def keep_alive(self, lease: int, deadline: float) -> bool:
        """Renew `lease`; False when it is gone (expired, revoked)."""
        reply = await self.client.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline=deadline)
        result = reply.get("result", reply)
        return int(result.get("TTL", 0) or 0) > 0

    async def revoke(self, lease: int, deadline: float) -> None:
        """Revoke the lease a replaced or deleted registration was on, before answering. The key is
        already off it (the transaction moved or deleted it), so if etcd cannot be reached now the
        lease keeps nothing alive and expires by itself."""
        log.debug("registrations: revoking lease %d", lease)
        try:
            await self.client.call("/v3/lease/revoke", {"ID": str(lease)}, deadline=deadline)
        except (EtcdUnavailable, TimeoutError, wire.EtcdError) as e:
            log.debug("registrations: lease %x not revoked (%s); it expires by itself", lease, e)

    def revoke_later(self, lease: int) -> None:
        """A lease granted for a write that did not happen: best effort, in the background."""

        async def revoke() -> None:
            with contextlib.suppress(Exception):
                await self.revoke(lease, asyncio.get_running_loop().time() + WRITE_DEADLINE)

        task = asyncio.create_task(revoke())
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()  # revocations under way (a reference, so they are not collected)
