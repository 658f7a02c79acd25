"""`serve`'s options for the ports Envoy reads (gRPC and REST): addresses, streams, messages,
timeouts, the per-client limits of docs/limits.md, and which HTTP/2 path runs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .parsing import Option, Refused, duration, host_port, optional_address, positive_int

if TYPE_CHECKING:
    from ..settings import TransportSettings


def _http2_mode(value: str) -> str:
    """argparse checks `choices` on the command line only, not on a default from EDS_HTTP2."""
    if value not in ("auto", "fast", "stock"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, fast, stock)")
    return value


OPTIONS = (
    Option(
        "--listen",
        "gRPC address [EDS_LISTEN] (default 127.0.0.1:18000, loopback: plaintext EDS tells every "
        "group to whoever connects, so other hosts' Envoys need 0.0.0.0:18000, said on purpose)",
        "127.0.0.1:18000",
        host_port,
        "HOST:PORT",
    ),
    Option(
        "--rest-listen",
        "REST-JSON EDS for api_type: REST, or 'off' [EDS_REST_LISTEN] (default off)",
        "off",
        optional_address,
        "HOST:PORT",
    ),
    Option(
        "--shutdown-timeout",
        "on SIGTERM: end open streams cleanly (Envoy keeps its endpoints and reconnects) "
        "for up to 60%% of this, cut the rest, and exit within it, however many streams are open; keep it below "
        "the stop timeout (docker stop: 10s; Kubernetes: 30s) (default 5s)",
        "5s",
        duration,
        "DURATION",
    ),
    Option(
        "--max-streams-per-connection",
        "HTTP/2 concurrent streams per connection (default 10000)",
        "10000",
        positive_int,
        "N",
    ),
    Option("--keepalive-time", "HTTP/2 ping interval towards clients (default 30s)", "30s", duration, "DURATION"),
    Option(
        "--keepalive-timeout",
        "close a connection whose ping is not answered in this time (default 10s)",
        "10s",
        duration,
        "DURATION",
    ),
    # limits
    Option("--max-streams", "open xDS streams in total (default 100000)", "100000", positive_int, "N"),
    Option(
        "--max-message-size",
        "largest request accepted, judged from its length prefix (default 4 MiB)",
        str(4 * 1024 * 1024),
        positive_int,
        "BYTES",
    ),
    Option("--max-names", "resource names a stream may follow (default 10000)", "10000", positive_int, "N"),
    Option("--max-name-length", "characters in a name (default 1024)", "1024", positive_int, "N"),
    Option(
        "--send-timeout",
        "drop a client that has not taken a response in this time (default 30s)",
        "30s",
        duration,
        "DURATION",
    ),
    Option(
        "--reset-budget",
        "stream resets (the client's, and h2's own) per client IP per 10 s before GOAWAY (default 10000)",
        "10000",
        positive_int,
        "N",
    ),
    # limits per client
    Option(
        "--max-connections",
        "gRPC connections in total (kept under the open-file limit); when full, a newcomer "
        "takes the place of the idlest connection of the address holding the most, which gets GOAWAY "
        "(default 10000)",
        "10000",
        positive_int,
        "N",
    ),
    Option(
        "--max-connections-per-ip",
        "gRPC connections from one client IP, once the server holds half of "
        "--max-connections (many Envoys behind one NAT are served while there is room); past it, the IP's "
        "newcomer takes the place of its idlest connection (default 100)",
        "100",
        positive_int,
        "N",
    ),
    Option(
        "--stream-budget",
        "streams one client IP may end without sending a request (reset, ended, refused or "
        "timed out) per 10 s before GOAWAY; once spent, it opens none until a tenth is back. Streams that send "
        "their requests cost nothing; past 16384 of an IP's streams awaiting their first request while they could "
        "send it (fewer as it spends this budget), new ones are refused with REFUSED_STREAM (default 1000)",
        "1000",
        positive_int,
        "N",
    ),
    Option(
        "--control-frame-budget",
        "PING, PRIORITY, empty DATA, unknown, unpaid WINDOW_UPDATE and repeated "
        "SETTINGS frames one connection may send per 10 s before GOAWAY; a connection's first SETTINGS and its "
        "ACKs of ours are free (default 1000)",
        "1000",
        positive_int,
        "N",
    ),
    Option(
        "--request-timeout",
        "for a connection to open a stream, a stream to send its first request, and a "
        "started request to arrive whole (default 10s)",
        "10s",
        duration,
        "DURATION",
    ),
    Option(
        "--connection-idle-timeout",
        "close a gRPC connection (GOAWAY NO_ERROR) that has held no stream this long, "
        "PINGs answered or not; closed between one and two of these after its last stream (default 5m)",
        "5m",
        duration,
        "DURATION",
    ),
    Option(
        "--partial-message-budget",
        "bytes of requests being received at once, server-wide (default 64 MiB)",
        str(64 * 1024 * 1024),
        positive_int,
        "BYTES",
    ),
    Option(
        "--memory-limit",
        "resident memory past which the client address holding the most is closed, one "
        "connection at a time (from 85%% of it, that address opens no new stream); 0: 90%% of the cgroup's "
        "limit, or of the machine's memory (default 0)",
        "0",
        int,
        "BYTES",
    ),
    Option(
        "--tls-handshake-timeout", "longest TLS handshake on the gRPC port (default 5s)", "5s", duration, "DURATION"
    ),
    Option(
        "--http-max-connections",
        "connections to the admin port, and to the REST port, each (default 256)",
        "256",
        positive_int,
        "N",
    ),
    Option(
        "--http-timeout",
        "admin and REST ports: longest wait for a request's headers and body, and keepalive of "
        "an idle connection (default 10s)",
        "10s",
        duration,
        "DURATION",
    ),
    Option(
        "--http2",
        "HTTP/2 path: 'fast' (the per-client limits and fan-out of docs/limits.md) needs the grpclib, "
        "h2, hpack, hyperframe and aiohttp versions it was tested with; 'auto' falls back to 'stock' (their "
        "public API only) with a warning otherwise [EDS_HTTP2] (default auto)",
        "auto",
        _http2_mode,
        choices=["auto", "fast", "stock"],
    ),
)


def settings(args: argparse.Namespace) -> TransportSettings:
    """The transport settings, or Refused: `--http2 fast` on versions it was not tested with (said here
    in one line, not from deep inside the start as a traceback)."""
    from ..settings import TransportSettings
    from ..transport.h2 import ConnectionLimits, HttpLimits
    from ..xds.common import SubscriptionLimits

    if args.http2 == "fast":
        from ..transport.h2 import compat

        try:
            compat.fast_path("fast")
        except compat.UnverifiedVersions as e:
            raise Refused(f"not starting: {e}") from None
    connections = ConnectionLimits(
        max_connections=args.max_connections,
        max_connections_per_ip=args.max_connections_per_ip,
        stream_budget=args.stream_budget,
        control_budget=args.control_frame_budget,
        request_timeout=args.request_timeout,
        idle_timeout=args.connection_idle_timeout,
        partial_message_budget=args.partial_message_budget,
        memory_limit=args.memory_limit,
        tls_handshake_timeout=args.tls_handshake_timeout,
    )
    return TransportSettings(
        listen=args.listen,
        rest_listen=args.rest_listen,
        max_streams_per_connection=args.max_streams_per_connection,
        keepalive_time=args.keepalive_time,
        keepalive_timeout=args.keepalive_timeout,
        max_message_size=args.max_message_size,
        max_streams=args.max_streams,
        send_timeout=args.send_timeout,
        reset_budget=args.reset_budget,
        limits=SubscriptionLimits(max_names=args.max_names, max_name_length=args.max_name_length),
        connection_limits=connections,
        http_limits=HttpLimits(max_connections=args.http_max_connections, timeout=args.http_timeout),
        http2=args.http2,
        shutdown_grace=args.shutdown_timeout,
    )
