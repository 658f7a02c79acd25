"""The memory watermark: the process's resident memory checked against a limit, and the actions taken
as it is crossed, always against the client address holding the most, never a newcomer.

Why: every budget of the gRPC port (partial messages, streams, unread input) bounds one kind of
holding, and an attack that finds a kind no budget names, or many addresses each under their share,
can still take the process to its cgroup's OOM kill, which ends every Envoy's stream at once.
Envoy's overload manager answers this with resource monitors and ordered actions; this is the same
for the one resource that kills us:

- at PRESSURE of the limit, the address holding the most (its partial messages, unread input, unsent
  responses and open streams, estimated) opens no new stream (its next one ends the connection, as
  a spent stream budget does), until memory is below PRESSURE again;
- at the limit, that address's heaviest connection is closed (GOAWAY NO_ERROR), one per check,
  while memory stays above it.
The event loop's lag is watched the same way: a check that comes LAG_WATERMARK late means the loop
was held that long, every client's updates with it. Then the address that took most of the loop's
recent reading time (more than LAG_SHARE of it, with another address to be fair to) opens no new
stream until a check comes on time: new streams are the work it can still add (each starts a
handler), and the fair reader already bounds what its input costs per turn.
Streams opened that have sent no request yet are bounded server-wide the same way: each is an h2
stream (and on the stock path a handler) held for nothing, and thousands of fresh addresses each
under their own bound held half a million of them (350 MB). Past AWAITING_WATERMARK the connection
holding the most gives way (GOAWAY NO_ERROR), until the total is under it again; an Envoy sends its
request with its stream, so it holds few. A stream whose request is received and waits in the
read scheduler's queue (a DATA frame of it among the first SCAN_FRAMES frames queued) is not
counted: a fleet connecting at once has each fresh connection's HEADERS read before the megabytes
of requests queued behind earlier ones. The rest of such a connection's streams count against the
watermark of streams held back (below), not this one: their requests may be queued past the
frames looked at, or still in the kernel's buffer while the scheduler has its reading paused
(1,000 addresses connecting 100,000 streams at once tripped this watermark that way). A flood
of HEADERS queues more HEADERS, no request: its streams count here.

Each action is logged and counted as `overload` with the address it hit. Sans-IO: the clock is the
caller's (App.start checks every CHECK_INTERVAL), the resident size comes from a function.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from .limits import Gate, PeerBudgets

log = logging.getLogger("eds_server.grpc")

CHECK_INTERVAL = 0.5  # seconds between checks of the resident size
PRESSURE = 0.85  # of the limit: the heaviest address opens no new stream
STREAM_MEMORY = 16 * 1024  # bytes a stream holds, as estimated (the bench measures ~20 KB per stream)
# streams awaiting their first request, server-wide: two addresses' worth of the per-address bound
# (16,384), where an Envoy's streams carry their request from the start
AWAITING_WATERMARK = 32_768
# and, apart, those waiting on a window the client does not know it has yet (it spent HTTP/2's first
# 65,535 bytes, one Envoy request, and has not had our larger window): a fleet of 1,000 Envoys
# connecting at once to a worker holds ~100 a connection until its requests come, 50,000 a worker
# at 100,000 streams on two. On the fast path such a stream is an h2 stream alone, ~700 bytes (half
# a million held 350 MB): 131,072 are ~90 MB. So do those whose requests may be behind input we
# hold (fair.MeteredInput.requests_behind). A flood of HEADERS alone never counts here
HELD_BACK_WATERMARK = 131_072
LAG_WATERMARK = 1.0  # seconds a check came late: the loop was held that long
LAG_SHARE = 0.5  # of the addresses' recent cost of the loop, taken by one, for it to be the one refused


def process_rss() -> int:
    """This process's resident set size, in bytes (Linux; 0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def default_limit() -> int:
    """Bytes: 90% of the cgroup's memory limit if one is set, else of the machine's memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(int(text) * 0.9)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)
    except (OSError, ValueError):
        return 1 << 40


def weight(peer: PeerBudgets) -> int:
    """What an address holds, estimated: its partial messages and each connection's own."""
    return peer.partial + sum(holder.memory() for holder in peer.held)


class MemoryWatermark:
    """One server's watermark (see the module's docstring)."""

    def __init__(
        self,
        gate: Gate,
        limit: int,
        rss: Callable[[], int] = process_rss,
        awaiting_watermark: int = AWAITING_WATERMARK,
        held_back_watermark: int = HELD_BACK_WATERMARK,
        forgotten: Callable[[int], None] | None = None,
    ) -> None:
        """`forgotten`: told how many addresses a check forgot (the heap's trim follows, see HeapTrim)."""
        self.gate = gate
        self.forgotten = forgotten
        self.limit = limit
        self.awaiting_watermark = awaiting_watermark
        self.held_back_watermark = held_back_watermark
        self.rss = rss
        self.throttled: PeerBudgets | None = None
        # what it did: addresses refused new streams, connections closed
        self.throttles = 0
        self.closed = 0

    def check(self, lag: float = 0.0) -> None:
        """One check; `lag`: how late it came (seconds past its interval)."""
        if (forgotten := self.gate.sweep()) and self.forgotten is not None:
            try:
                self.forgotten(forgotten)
            except Exception:  # the heap's trim: never the end of the watermark's checks
                log.exception("after %d addresses forgotten", forgotten)
        self._streams()
        rss = self.rss()
        if rss < self.limit * PRESSURE:
            self._lagging(lag)
            return
        held, heaviest = max(
            ((weight(p), p) for p in self.gate.peers.values() if p.held), key=lambda x: x[0], default=(0, None)
        )
        if heaviest is None or not held:
            return  # nothing any client holds is worth closing: the memory is the server's own
        mb = rss / (1 << 20)
        if heaviest is not self.throttled:
            self._throttle(heaviest)
            self.gate.shed(
                "overload",
                heaviest.ip,
                f"refusing its new streams: memory at {mb:.0f} MB "
                f"(limit {self.limit / (1 << 20):.0f} MB), it holds the most "
                f"(~{held / (1 << 20):.1f} MB)",
            )
        if rss >= self.limit:
            holder = max(heaviest.held, key=lambda h: h.memory(), default=None)
            if holder is None:
                return
            self.closed += 1
            why = f"server memory at {mb:.0f} MB, over its limit, and {heaviest.ip} holds the most"
            self.gate.release(heaviest, holder)
            self.gate.shed("overload", heaviest.ip, f"closing its heaviest connection (GOAWAY): {why}")
            holder.give_way(why)

    def _lagging(self, lag: float) -> None:
        """The loop held LAG_WATERMARK or more: the address that cost it most opens no new stream."""
        costliest = None
        if lag >= LAG_WATERMARK:
            now = self.gate.reads.clock()
            costs = [(p.cost.now(now), p) for p in self.gate.peers.values() if p.held]
            total = sum(cost for cost, _ in costs)
            top = max(costs, key=lambda x: x[0], default=None)
            if top is not None and len(costs) > 1 and top[0] > LAG_SHARE * total:
                costliest = top
        if costliest is None:
            self._throttle(None)
            return
        cost, peer = costliest
        if peer is not self.throttled:
            self._throttle(peer)
            why = f"the event loop ran {lag:.1f} s late, and it took {cost / total:.0%} of its recent reading time"
            self.gate.shed("overload", peer.ip, f"refusing its new streams: {why}")

    def _streams(self) -> None:
        """Past the watermark of streams awaiting a request (or that of those held back by the
        client's first window), the connections holding the most of them give way, the heaviest
        first, until the total is under it."""
        peers = self.gate.peers.values()
        back, pending = sum(p.held_back for p in peers), sum(p.pending for p in peers)
        # `back` counts those held back by the window alone; those whose requests may be behind
        # input we hold are found below, so the quick way out assumes every stream might be
        if pending - back <= self.awaiting_watermark and pending <= self.held_back_watermark:
            return
        holders = sorted(
            ((h.awaiting(), h.held_back(), peer, h) for peer in peers for h in peer.held), key=lambda x: -x[0]
        )
        # less those whose requests may wait in our queue
        totals = {False: 0, True: 0}
        for held, waits, _, _ in holders:
            totals[waits] += held
        limits = {False: self.awaiting_watermark, True: self.held_back_watermark}
        for held, waits, peer, holder in holders:
            if not held or (totals[False] <= limits[False] and totals[True] <= limits[True]):
                break
            if totals[waits] <= limits[waits]:
                continue
            totals[waits] -= held
            self.closed += 1
            what = "await a request" if not waits else "await the window the client does not know yet, or our reading"
            why = f"{totals[waits] + held} streams {what} server-wide (limit {limits[waits]})"
            self.gate.release(peer, holder)
            self.gate.shed("overload", peer.ip, f"closing its connection holding {held} of them (GOAWAY): {why}")
            holder.give_way(why)

    def _throttle(self, peer: PeerBudgets | None) -> None:
        if self.throttled is not None:
            self.throttled.throttled = False
        self.throttled = peer
        if peer is not None:
            peer.throttled = True
            self.throttles += 1


async def watch(
    gate: Gate,
    limit: int = 0,
    interval: float = CHECK_INTERVAL,
    forgotten: Callable[[int], None] | None = None,
) -> None:
    """Check `gate`'s server against the watermark every `interval` (0: the default limit), until cancelled."""
    watermark = MemoryWatermark(gate, limit or default_limit(), forgotten=forgotten)
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        watermark.check(lag=loop.time() - started - interval)
