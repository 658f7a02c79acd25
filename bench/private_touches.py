"""What a private touch of transport/h2 buys: each case runs its work with the touch and without
it (the library's own or public way), in one process, and reports the medians of interleaved
rounds as a ratio; with --callgrind each variant runs again under `valgrind --tool=callgrind`, and
the instructions per operation are reported (repeatable on a shared, noisy host).

    .venv/bin/python bench/private_touches.py [--only NAME[,NAME]] [--callgrind] [--rounds N]

Cases (NAME):
- repr: h2 reading Envoy-sized first requests (60 KB in 16 KB DATA frames on a new stream each),
  hyperframe's own frame repr against fast_connection.short_frame_reprs (`_raw_data_repr`);
- open_streams: a connection opening 2,000 streams one after another (HEADERS built by hand, no
  request yet), h2's `_open_streams` against GuardedH2Connection's, which looks at touched streams
  only (the cost per stream grows with the streams: --callgrind-ops 2000 gives streams 1,000-2,000);
- headers: 2,000 new streams answered their first response, HEADERS built once and queued with
  the first DATA against grpclib's own send_initial_metadata (the process's CPU, server and client);
- direct: 20 changes fanned out to 1,000 streams and ACKed (per change), ACKs read straight from
  their DATA frames (direct.py) against through h2 and grpclib;
- queue: the same fan-out, responses queued as shared frames and written once per connection and
  batch (fast_writer.queue_message) against each stream's own send;
- acknowledge: a first request's bytes acknowledged to h2 (its WINDOW_UPDATEs), by the window
  managers and frames as bytes (GuardedH2Connection.acknowledged) against h2's own
  acknowledge_received_data;
- data_to_send: taking h2's output before queueing a message when it holds none (every message
  of a fan-out): a test of h2's private `_data_to_send` first against the public `data_to_send()`.

The results go to private.py's table by hand (the figure per touch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import hyperframe.frame

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import in_process
from in_process import UNBOUNDED

from eds_server.transport.h2.fast_connection import GuardedH2Connection, short_frame_reprs
from eds_server.transport.h2.limits import PeerBudgets

PATH = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PATH),
    (":authority", "eds"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


Connection = h2.connection.H2Connection


def _pair(server_class: type[Connection]) -> tuple[Connection, Connection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    config = h2.config.H2Configuration(client_side=False, validate_inbound_headers=False, header_encoding="utf-8")
    if server_class is h2.connection.H2Connection:
        server = h2.connection.H2Connection(config)
    else:
        server = server_class(config, PeerBudgets(UNBOUNDED), UNBOUNDED)  # type: ignore[call-arg]
    server.local_settings = h2.settings.Settings(
        client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1 << 20}
    )
    client.initiate_connection()
    server.initiate_connection()
    server.increment_flow_control_window(1 << 30)  # as grpclib's connection window, and more
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


def repr_case(variant: str, n: int) -> Callable[[], None]:
    """n first requests of 60 KB read by h2 (the server acknowledges them, as grpclib does)."""
    original = hyperframe.frame._raw_data_repr
    if variant == "touch":
        short_frame_reprs()
    client, server = _pair(h2.connection.H2Connection)
    payload = bytes(range(256)) * 240  # 61,440 bytes

    def run() -> None:
        for _ in range(n):
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, HEADERS)
            for pos in range(0, len(payload), 16_384):
                client.send_data(sid, payload[pos : pos + 16_384])
            for event in server.receive_data(client.data_to_send()):
                if isinstance(event, h2.events.DataReceived):
                    server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            client.receive_data(server.data_to_send())

    run.restore = lambda: setattr(hyperframe.frame, "_raw_data_repr", original)  # type: ignore[attr-defined]
    return run


def open_streams_case(variant: str, n: int) -> Callable[[], None]:
    """n streams opened on one connection, each HEADERS on its own (as Envoy's clusters start)."""

    class H2Count(GuardedH2Connection):
        _open_streams = h2.connection.H2Connection._open_streams

    def run() -> None:
        _, server = _pair(GuardedH2Connection if variant == "touch" else H2Count)
        encoder = hpack.Encoder()  # frames built by hand: h2's own client would walk its streams too
        for i in range(n):
            block = encoder.encode(HEADERS)
            server.receive_data(hyperframe.frame.HeadersFrame(1 + 2 * i, data=block, flags=["END_HEADERS"]).serialize())

    return run


def acknowledge_case(variant: str, n: int) -> Callable[[], float]:
    """n first requests (48 KB each, on streams of their own) acknowledged to h2, their WINDOW_UPDATEs
    taken: GuardedH2Connection.acknowledged (h2's window managers, `_inbound_flow_control_window_manager`
    and `_inbound_window_manager`, frames as bytes) against h2's acknowledge_received_data and
    data_to_send. Returns the CPU of the acknowledgements alone."""
    _, server = _pair(GuardedH2Connection)
    encoder = hpack.Encoder()
    for i in range(n):
        sid = 1 + 2 * i
        block = encoder.encode(HEADERS)
        opening = hyperframe.frame.HeadersFrame(sid, data=block, flags=["END_HEADERS"]).serialize()
        server.receive_data(opening + hyperframe.frame.DataFrame(sid, data=b"x" * 16_000).serialize() * 3)
    server.data_to_send()

    def run() -> float:
        start = time.process_time()
        for i in range(n):
            if variant == "touch":
                server.acknowledged(48_000, 1 + 2 * i)  # type: ignore[attr-defined]
            else:
                server.acknowledge_received_data(48_000, 1 + 2 * i)
                server.data_to_send()
        return time.process_time() - start

    return run


def data_to_send_case(variant: str, n: int) -> Callable[[], None]:
    """n messages queued while h2 holds no output (what queue_message checks first, every message)."""
    _, server = _pair(h2.connection.H2Connection)
    server.data_to_send()
    pending: list[bytes] = []

    if variant == "touch":

        def run() -> None:
            for _ in range(n):
                if server._data_to_send:
                    pending.append(server.data_to_send())
    else:

        def run() -> None:
            for _ in range(n):
                queued = server.data_to_send()
                if queued:
                    pending.append(queued)

    return run


def headers_case(variant: str, n: int) -> Callable[[], None]:
    """n new streams on 4 connections, each answered its first response: the fast path's HEADERS
    built once and queued with the first DATA (queue_initial_headers: grpclib's `_content_type`,
    `_dispatch._listeners`, `_send_initial_metadata_done`) against grpclib's own send_initial_metadata.
    Server and raw client (bench/loadgen.py) in this process: the client's share is the same in both."""
    import asyncio

    import loadgen
    from in_process import serving

    from eds_server.model import Endpoint, Group
    from eds_server.transport.h2 import fast_server

    def run() -> None:
        async def main() -> None:
            async with serving(Group("web", (Endpoint("127.0.0.1", 8080),)), n) as (_store, port):
                queue = fast_server.queue_initial_headers
                if variant != "touch":
                    fast_server.queue_initial_headers = lambda stream, headers: False  # type: ignore[assignment]
                generator = loadgen.Generator(2_000)
                try:
                    await generator.open(port, [["web"] * (n // 4)] * 4, node_every=False)
                    done = await generator.wait({}, 60, {"web": 1})
                    assert done["ok"], done
                finally:
                    fast_server.queue_initial_headers = queue
                    generator.close()

        asyncio.run(main())

    return run


def direct_case(variant: str, n: int) -> Callable[[], float]:
    """n changes fanned out to 1,000 streams on 4 connections, each response ACKed: an established
    stream's ACKs read straight from its DATA frames (direct.py: grpclib's Buffer `_eof`,
    `_acked_size`, `_unacked`, `_acked`; h2's FrameBuffer `_data`, `_preamble_len`, `_headers_buffer`)
    against read through h2 and grpclib. Returns the CPU of the changes alone."""
    return _fanout(variant, n, "direct")


def queue_case(variant: str, n: int) -> Callable[[], float]:
    """As direct, but each response queued as shared frames and written once per connection and
    batch (fast_writer.queue_message: grpclib's `_stream`, `_send_message_done`) against sent by
    each stream's own send (send_frames, one socket write per stream)."""
    return _fanout(variant, n, "queue")


def _fanout(variant: str, n: int, touch: str) -> Callable[[], float]:
    import asyncio

    import loadgen
    from in_process import serving

    from eds_server.model import Endpoint, Group
    from eds_server.transport.h2 import fast_reader, fast_server

    streams = 1_000

    def group(i: int) -> Group:
        return Group("web", tuple(Endpoint("127.0.0.1", 1000 + p) for p in range(i % 7, i % 7 + 20)))

    def run() -> float:
        async def main() -> float:
            async with serving(group(0), streams) as (store, port):
                direct, queue = fast_reader.MessageReader.direct, fast_server.queue_message
                if variant != "touch" and touch == "direct":

                    def never(self: object, stream: object, on_message: object) -> None:
                        return None

                    fast_reader.MessageReader.direct = never  # type: ignore[assignment,method-assign]
                elif variant != "touch":
                    fast_server.queue_message = lambda stream, message: False  # type: ignore[assignment]
                generator = loadgen.Generator(2_000)
                try:
                    await generator.open(port, [["web"] * (streams // 4)] * 4, node_every=False)
                    assert (await generator.wait({}, 60, {"web": 1}))["ok"]
                    start = time.process_time()
                    for i in range(1, n + 1):
                        store.update("bench", {"web": group(i)})
                        done = await generator.wait({}, 60, {"web": i + 1})
                        assert done["ok"], done
                    spent = time.process_time() - start
                finally:
                    fast_reader.MessageReader.direct = direct  # type: ignore[method-assign]
                    fast_server.queue_message = queue
                    generator.close()
            return spent

        return asyncio.run(main())

    return run


CASES: dict[str, tuple[Callable[[str, int], Callable[[], Any]], int]] = {
    "direct": (direct_case, 20),
    "queue": (queue_case, 20),
    "headers": (headers_case, 2_000),
    "repr": (repr_case, 200),
    "open_streams": (open_streams_case, 2_000),
    "data_to_send": (data_to_send_case, 200_000),
    "acknowledge": (acknowledge_case, 2_000),
}


def timed(name: str, rounds: int) -> tuple[float, float]:
    """Medians of interleaved rounds, seconds per operation: (with the touch, without)."""
    make, n = CASES[name]
    times: dict[str, list[float]] = {"touch": [], "public": []}
    for _ in range(rounds):
        for variant in ("touch", "public"):
            run = make(variant, n)
            start = time.process_time()
            spent = run()  # the case's own measure, where it has one (not its setup)
            times[variant].append((spent if spent is not None else time.process_time() - start) / n)
            getattr(run, "restore", lambda: None)()
    return statistics.median(times["touch"]), statistics.median(times["public"])


def instructions(name: str, variant: str, n: int) -> int:
    """Instructions of one run of the case under callgrind (setup included: see per_op)."""
    return in_process.instructions(__file__, "--one", name, variant, str(n))


def per_op(name: str, variant: str, n: int) -> float:
    """Instructions per operation: the difference between a run of n and one of n/2, so the
    interpreter's start and the setup cancel out (for open_streams: the cost of streams n/2 to n)."""
    n = max(2, n)
    return (instructions(name, variant, n) - instructions(name, variant, n // 2)) / (n - n // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--callgrind-ops", type=int, default=0, help="operations per callgrind run (default: a tenth)")
    parser.add_argument("--one", nargs=3, metavar=("NAME", "VARIANT", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, variant, n = args.one
        CASES[name][0](variant, int(n))()
        return
    for name in args.only.split(","):
        touch, public = timed(name, args.rounds)
        line = f"{name}: {touch * 1e6:.2f} us/op with the touch, {public * 1e6:.2f} without ({public / touch:.2f}x)"
        if args.callgrind:
            n = args.callgrind_ops or CASES[name][1] // 10
            ci, cp = per_op(name, "touch", n), per_op(name, "public", n)
            line += f"; callgrind {ci:,.0f} / {cp:,.0f} instructions per op ({cp / ci:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
