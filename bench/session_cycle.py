"""The session's share of a fan-out, per stream and change, in one process: a change marked and
polled, then the response's ACK read and settled by the session driver (no sockets, no HTTP/2).

    .venv/bin/python bench/session_cycle.py [--streams 1000] [--node BYTES] [--runs 7]

`--node BYTES`: every ACK carries a Node of about that size (Envoy without
set_node_on_first_message_only). Prints each run's ns per stream per change and the median, for the
change and for the ACK apart. Works on versions with and without the fused one-name path: run it
with another checkout's eds_server first on PYTHONPATH (from another directory) to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from eds_server.encoded import Resource
from eds_server.model import Group
from eds_server.observe import Counters, Observers, StreamLog
from eds_server.protowire import length_delimited, string_field
from eds_server.xds import session
from eds_server.xds.common import EDS_TYPE_URL, Nonces, SubscriptionLimits
from eds_server.xds.sotw import SotwStream

NAME = "web"
CHANGES = 10  # per run


class OneGroup:
    """The store as a stream sees it, holding one group."""

    withholds = False
    ready = True

    def __init__(self) -> None:
        self.resource = Resource(NAME, "v0", b"x", Group(NAME))

    def get(self, name: str) -> Resource:
        return self.resource

    def resources(self) -> dict[str, Resource]:
        return {NAME: self.resource}

    def follow(self, *args: Any, **kwargs: Any) -> None:
        pass


def ack(version: str, nonce: str, node: bytes) -> bytes:
    return (
        string_field(1, version) + node + string_field(3, NAME) + string_field(4, EDS_TYPE_URL) + string_field(5, nonce)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--node", type=int, default=0, help="bytes of Node on every ACK (0: none)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    view = OneGroup()
    nonces, limits = Nonces(), SubscriptionLimits()
    node = length_delimited(2, string_field(1, "envoy") + string_field(2, "x" * args.node)) if args.node else b""
    drivers = [
        session.SessionDriver(
            session.SOTW, view, limits, nonces, Observers(Counters(), StreamLog()), "peer", lambda: None
        )  # type: ignore[arg-type]
        for _ in range(args.streams)
    ]
    first = length_delimited(2, string_field(1, "envoy")) + string_field(3, NAME) + string_field(4, EDS_TYPE_URL)
    for d in drivers:
        d.receive(first, True)
    names = frozenset((NAME,))
    fused = hasattr(SotwStream, "changed_due")
    changes: list[float] = []
    acks: list[float] = []
    for run in range(args.runs):
        spent_change = spent_ack = 0
        for k in range(CHANGES):
            view.resource = Resource(NAME, f"v{run}-{k}", b"x", Group(NAME))
            start = time.process_time_ns()
            for d in drivers:
                sm: Any = d.sm
                if fused:
                    due = sm.changed_due(names)
                else:
                    sm.changed(names)
                    due = sm.wants_poll
                if due:
                    sm.poll()
            polled = time.process_time_ns()
            requests = [ack(d.sm.in_flight.version_info, d.sm.in_flight.nonce, node) for d in drivers]  # type: ignore[attr-defined]
            built = time.process_time_ns()
            for d, data in zip(drivers, requests, strict=True):
                d.receive(data, False)
            spent_change += polled - start
            spent_ack += time.process_time_ns() - built
            assert all(d.sm.in_flight is None for d in drivers)  # type: ignore[attr-defined]
        changes.append(spent_change / (CHANGES * args.streams))
        acks.append(spent_ack / (CHANGES * args.streams))
    print(
        f"{'fused' if fused else 'general'} path, {args.streams} streams, Node on ACKs {args.node} B, ns per stream "
        f"per change: change+poll {[round(x) for x in changes]} median {statistics.median(changes):.0f}; "
        f"ACK {[round(x) for x in acks]} median {statistics.median(acks):.0f}"
    )


if __name__ == "__main__":
    main()
