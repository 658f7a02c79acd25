"""grpclib's method table, with a say for the methods it does not have: Envoy configured for ADS (or
asking for v2) gets UNIMPLEMENTED either way, but eds-server now logs why, once per client, with the fix."""

from __future__ import annotations

import collections
import logging
from typing import Any

import grpclib.const
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Cardinality, Status

from ..observe import clip

log = logging.getLogger("eds_server.grpc")


ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
ADS_FIX = (
    "eds-server serves EDS without ADS: remove `ads_config` from the Envoy bootstrap and give each EDS cluster "
    "`eds_config: {resource_api_version: V3, api_config_source: {api_type: GRPC, transport_api_version: V3, "
    "grpc_services: [{envoy_grpc: {cluster_name: xds_cluster}}]}}` instead of `ads: {}`"
)


class UnknownMethods(dict[str, grpclib.const.Handler]):
    """grpclib's method table, answering a method it does not have with a handler that says why
    (UNIMPLEMENTED, as grpclib would) and logs one warning per client address and method, naming
    the method and, for ADS, the fix. Bounded: client-chosen names cannot grow it past `most`."""

    def __init__(self, handlers: dict[str, grpclib.const.Handler], served: str, most: int = 1024) -> None:
        super().__init__(handlers)
        self._served = served
        self._warned: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._most = most

    def get(self, name: str, default: Any = None) -> Any:
        found = super().get(name)
        if found is not None:
            return found

        async def unknown(stream: grpclib.server.Stream[bytes, bytes]) -> None:
            raise GRPCError(Status.UNIMPLEMENTED, self._complain(name, stream))

        return grpclib.const.Handler(unknown, Cardinality.STREAM_STREAM, bytes, bytes)

    def _complain(self, path: str, stream: grpclib.server.Stream[Any, Any]) -> str:
        service = path.strip("/").partition("/")[0]
        if service == ADS_SERVICE:
            why = ADS_FIX
        elif service.startswith("envoy.api.v2.") or ".v2." in service:
            why = "the v2 xDS API is not served: use transport_api_version: V3 and resource_api_version: V3"
        else:
            why = f"eds-server serves only {self._served} (EDS), gRPC health and reflection"
        addr = stream.peer.addr()
        key = (str(addr[0]) if addr else "?", path[:200])
        if key not in self._warned:
            self._warned[key] = None
            if len(self._warned) > self._most:
                self._warned.popitem(last=False)
            log.warning(
                "unknown gRPC method %s from %s: %s",
                clip(path, 200),
                key[0],
                why,
                extra={"event": "unknown_method", "peer": key[0]},
            )
        return f"unknown method {clip(path, 200)}: {why}"
