"""Every private name of grpclib, h2, hpack, hyperframe and aiohttp this package touches: where,
why, and what it buys. A touch stays only if its gain is measured (a figure) or it is what a
protection needs (the test that fails without it); one whose gain could not be measured was
replaced by the public API. tests/transport/h2/test_private.py reads the package's source and
fails on a touch missing here, and on an entry no longer touched, so the table stays true.

Figures marked "bench" come from `bench/private_touches.py NAME` (with the touch against without
it, medians of interleaved rounds in one process; `--callgrind` for instruction counts, where a
case runs under valgrind in reasonable time); "changelog" names the figure measured when the
piece was added (CHANGELOG.md, 0.1.0). All hold for the versions compat.py verified only;
elsewhere the stock path runs.

Replaced by public API, for no measurable gain (taking one back means an entry with its figure):
grpclib's `_set_nodelay` (the socket's own setsockopt), `Stream._codec` (the reader's codec),
`Stream._h2_connection`, `Stream._transport` and `Connection._connection` (the public
`Stream.connection`, which is the fast path's FlushingConnection, holds both), `Server._loop`
(the running loop); h2's `H2Connection._data_to_send` (the public `data_to_send()`, whose frames
are queued on our own transport: bench data_to_send, +0.10-0.14 us (+1,811 instructions,
callgrind) per queued message, 0.3-0.4% of the 36.8 us a stream costs per change on the 1,000 x
1,000 Node-first shape of docs/performance.md, far under that bench's +-10% between rounds).

Two public names are replaced rather than read: grpclib's protocol module makes each stream's three
events and its data queue with the `Event` and `Queue` it imported from asyncio, and the fast server
sets those names to `events.LeanEvent` and `events.LeanQueue` (~100 bytes each against 857 and
2,700; memory: 10,000 request streams held 19.8 KB each before, 13.3 KB after, RSS over the idle
server, two runs each). They have asyncio's interfaces and behaviour (tests/unit/test_events.py
runs one script on both), so grpclib's uses of them are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Touch:
    library: str  # the distribution whose private names these are
    names: tuple[str, ...]
    where: tuple[str, ...]  # modules of this package (transport/h2/<name>.py)
    why: str
    figure: str


QUEUE_FIGURE = (
    "a change fanned out to 1,000 streams and ACKed costs 1.82-2.13x the CPU when each stream "
    "sends its own response (26.6-32.1 against 56.6-58.6 ms per change, server and client in one "
    "process, two runs; changelog: 1.20x for one encoding written once per connection)"
)
DIRECT_FIGURE = (
    "a change fanned out to 1,000 streams and ACKed costs 2.36-2.46x the CPU without the direct "
    "read path (29.6-39.4 against 72.7-93.0 ms per change, server and client in one process, two "
    "runs; changelog: 2.00x when it was added)"
)
HEADERS_FIGURE = (
    "a new stream answered its first response costs 1.14-1.21x the CPU with grpclib's own "
    "send_initial_metadata (516-595 against 590-695 us per stream, server and client in one "
    "process, three runs; callgrind: 1.99M against 1.73M instructions per stream, 1.15x); one "
    "write per connection and batch instead of one per stream"
)

TOUCHES: tuple[Touch, ...] = (
    Touch(
        "grpclib",
        ("_stream",),
        ("fast_reader", "fast_server", "fast_writer"),
        "grpclib's server Stream keeps its protocol stream (id, connection, buffer, recv_data, "
        "window_updated) private; the reader and the writer work on it",
        f"bench queue: {QUEUE_FIGURE}; protection: a message refused from its length prefix "
        "(grpclib buffers any announced length): tests/transport/test_grpc.py "
        "test_oversize_length_prefix_is_refused_before_the_body",
    ),
    Touch(
        "grpclib",
        ("_send_initial_metadata_done", "_send_message_done", "_send_trailing_metadata_done"),
        ("fast_server", "fast_writer"),
        "the writer sends headers, messages and trailers itself; grpclib's own later calls (its "
        "trailers, its checks on end) read these flags",
        f"bench queue: {QUEUE_FIGURE}; error trailers with no RST_STREAM after them: "
        "tests/transport/test_xds_edge_cases.py test_grpclib_clients_read_the_status_not_a_reset",
    ),
    Touch(
        "grpclib",
        ("_content_type",),
        ("fast_writer",),
        "the response's content-type, for the HEADERS block built once per server (ResponseHeaders)",
        f"bench headers: {HEADERS_FIGURE}",
    ),
    Touch(
        "grpclib",
        ("_dispatch", "_listeners"),
        ("fast_writer",),
        "the headers are queued past grpclib only when nothing listens for SendInitialMetadata "
        "(otherwise grpclib's own send runs, and its event)",
        f"part of queue_initial_headers (the entry above), bench headers: {HEADERS_FIGURE}",
    ),
    Touch(
        "grpclib",
        ("_eof", "_acked_size", "_unacked", "_acked"),
        ("direct", "fast_reader"),
        "the direct read path starts only on an empty stream buffer, and puts a message begun back "
        "in front of it when the stream falls back to grpclib",
        f"bench direct: {DIRECT_FIGURE}; tests/transport/h2/test_direct.py checks the path is taken",
    ),
    Touch(
        "grpclib",
        ("_protocol_factory",),
        ("fast_server", "stock"),
        "the only hook that puts a protocol of ours under grpclib's server: the fast protocol, and "
        "the stock path's guard below grpclib",
        "protection, no speed figure: tests/transport/h2/test_attacks.py, test_guard.py and "
        "tests/hostile/test_clients.py fail without the guard and the budgets",
    ),
    Touch(
        "grpclib",
        ("_handlers", "_tasks", "_cancelled", "_error"),
        ("handlers",),
        "grpclib keeps each connection's Handler in its server's `_handlers`, and the Handler its "
        "calls' tasks in `_tasks` and `_cancelled`, pruned only every tenth new connection or call; "
        "a call ended by a reset or its connection closing leaves its Wrapper's `_error` in a cycle "
        "through its traceback. Each task is dropped as it ends, and the Handler once it is closed",
        "memory: 100 connections of 100 request streams, opened and closed round after round, left "
        "the server at 53 -> 274 -> 479 -> 462 MB (fast) and 53 -> 284 -> 495 -> 477 MB (stock) "
        "without it, 53 -> 240 -> 256 -> 255 and 52 -> 256 -> 268 -> 265 MB with it; "
        "tests/transport/h2/test_closed_connections.py and tests/hostile/test_memory.py fail without it",
    ),
    Touch(
        "grpclib",
        ("_server", "_server_closed_fut"),
        ("fast_server",),
        "start() as grpclib's, plus a TLS handshake timeout and a listening socket handed over by "
        "--workers N; the port, and closing the listener alone",
        "protection: TLS handshakes bounded (tests/transport/h2/test_limits.py "
        "test_an_unfinished_tls_handshake_is_dropped)",
    ),
    Touch(
        "grpclib",
        ("_mapping",),
        ("fast_server",),
        "the method table, wrapped so an unknown method is answered and logged once (unknown.py)",
        "behaviour, no speed figure: tests/e2e/envoy/test_unknown_method.py",
    ),
    Touch(
        "grpclib",
        (
            "_keepalive_time",
            "_keepalive_timeout",
        ),
        ("base",),
        "grpclib's Configuration takes its keepalive settings as private keyword arguments; named "
        "in keepalive_config only (the relay's client; the server runs its own, keepalive.py)",
        "behaviour: a dead peer is found (keepalive), no public way to set it",
    ),
    Touch(
        "h2",
        ("_receive_frame", "_prepare_for_sending"),
        ("fast_connection",),
        "every frame received charged to the connection's and the IP's budgets before h2 reads it; "
        "h2's own RST_STREAM answers charged like a client's",
        "protection, no speed figure: tests/hostile/test_clients.py and "
        "tests/transport/h2/test_limits.py fail without it",
    ),
    Touch(
        "h2",
        ("_open_streams", "_closed_streams"),
        ("fast_connection",),
        "open streams counted from the streams touched since the last count, not by walking every "
        "stream on each new one (quadratic)",
        "bench open_streams: 2,000 streams opened on one connection cost 2.51-2.74x the CPU without "
        "it (59-70 against 163-176 us per stream, two runs); callgrind, streams 1,000 to 2,000: "
        "486k against 2.70M instructions per stream (5.56x), growing with the streams; 10,000 "
        "streams: h2 looks ~5e7 times, ours at most 3e4 (tests/transport/h2/test_limits.py "
        "test_ten_thousand_streams_cost_linear_work)",
    ),
    Touch(
        "h2",
        ("_data", "_preamble_len", "_headers_buffer"),
        ("fast_protocol", "fast_reader"),
        "the direct read path cuts frames itself only while h2's frame buffer is empty, and never "
        "inside a header block",
        f"bench direct: {DIRECT_FIGURE}",
    ),
    Touch(
        "h2",
        ("_inbound_flow_control_window_manager", "_inbound_window_manager"),
        ("fast_connection", "fast_protocol"),
        "a stream's first request read past h2 (direct.EarlyRequest) is counted against h2's own "
        "receive windows as h2 counts the DATA it reads, and acknowledged to h2 when taken: the "
        "same flow control as through h2 (a client over its window refused, the same grants back); "
        "every acknowledgement's grants are decided by the same managers, the WINDOW_UPDATEs "
        "written as bytes (GuardedH2Connection.acknowledged) rather than as hyperframe objects",
        "connecting 10,000 streams with a 60 KB first request each: 0.85-0.94x the CPU without "
        "the early read (docs/performance.md, three rounds); tests/transport/h2/test_early_requests.py "
        "fails without the counting; bench acknowledge: 0.94 against 3.81 us an acknowledgement "
        "(h2's acknowledge_received_data and data_to_send; medians of 7 interleaved rounds), the "
        "same bytes (tests/transport/h2/test_acknowledged.py)",
    ),
    Touch(
        "hyperframe",
        ("_raw_data_repr",),
        ("fast_connection",),
        "h2 builds repr(frame) of every frame received, and hyperframe's hex-encodes a DATA frame's "
        "whole payload to show 20 digits of it",
        "bench repr: a 60 KB first request read by h2 costs 1.49x the instructions without it "
        "(callgrind: 2.01M against 3.00M per request; time 1.30-1.46x, two runs)",
    ),
    Touch(
        "aiohttp",
        ("_loop", "_kwargs"),
        ("http",),
        "the aiohttp ports' protocol factory: each connection's handler built as aiohttp's web.Server "
        "builds it, under a connection cap and a deadline for the request's headers",
        "protection, no speed figure: tests/transport/h2/test_http.py",
    ),
)


def by_name() -> dict[str, Touch]:
    """Each private name, and its entry."""
    return {name: touch for touch in TOUCHES for name in touch.names}
