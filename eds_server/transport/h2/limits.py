"""What a client may take of the gRPC port, and what each limit charges. Pure bookkeeping: no
socket and no other library's internals, so the rules are unit-testable.

The rule: charge what misbehaves, not what is merely large. An Envoy with thousands of EDS
clusters opens thousands of streams at once, each sending its request straight away, and many
Envoys may share one address (a NAT, a Docker proxy); none of that costs a budget. What does:
- streams that end, or are refused, or time out, without ever sending a request (stream churn,
  idle streams); an IP's streams awaiting their first request are bounded while its connection
  has window to send them, as far as the client knows (a big Envoy's first requests may wait on
  flow control: not charged; see FirstWindow);
- stream resets, the client's and those h2 sends on its own (DATA after END_STREAM);
- control frames that carry no work: PING, PRIORITY, empty DATA, unknown frame types, SETTINGS
  after the connection's first, WINDOW_UPDATEs not paid for by our DATA. A connection's first
  SETTINGS, the ACKs of ours and the PING ACKs echoing our keepalive are free, so a fleet that
  reconnects at once (a server restart) costs nothing.
Past a budget, GOAWAY ENHANCE_YOUR_CALM. Connections: a total, and per IP, but the per-IP cap
binds only once the server holds half its total, so one NAT address in front of many Envoys is
served while the server has room. Every refusal is counted by reason and logged, rate-limited.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...ratelimit import Bucket
from .fair import AddressCost, ReadScheduler
from .keepalive import KeepaliveCounts

log = logging.getLogger("eds_server.grpc")

RECOVERY = 0.1  # share of its stream budget an address that spent it must get back before opening streams
BUDGET_WINDOW = 10.0  # seconds: budgets are "N per 10 s", refilled continuously
COST_FORGOTTEN = 0.001  # seconds of loop an address's cost has decayed to when it may be forgotten
SMALL_MESSAGE = 256 * 1024  # bytes: a request this small is never refused for others' partial messages
INITIAL_WINDOW = 65_535  # bytes: HTTP/2's connection window until the client has our WINDOW_UPDATE
# bytes of that window left under which a client cannot send its next request: a connection's
# streams awaiting one are held back by flow control (less than a default-size frame)
SPENT_WINDOW = 16_384

# Why a connection, stream or message was refused or shed: the label values of eds_refused_total.
REASONS = (
    "connection_limit",  # closed to make room: its address held the most connections, or over its own cap
    "no_stream",  # a connection that opened no stream in time
    "idle",  # a connection that held no stream for the idle timeout
    "no_request",  # a stream that sent no request in time
    "pending_streams",  # a stream refused (REFUSED_STREAM): too many of the IP's streams await a request
    "calm",  # GOAWAY ENHANCE_YOUR_CALM: over a budget
    "frame_size",  # a frame longer than we allow, refused from its header
    "header_size",  # a header block (HEADERS and CONTINUATION) longer than we allow, refused as it grows
    "bad_headers",  # a request whose headers break RFC 9113 section 8 (RST_STREAM PROTOCOL_ERROR)
    "protocol_error",  # any other HTTP/2 protocol error (GOAWAY)
    "partial_messages",  # a message refused: the partial-message budget is held by others
    "message_size",  # a message over --max-message-size, refused from its length prefix
    "overload",  # a connection shed: it held the most unread input while the server held too much
    "slow_input",  # a message or frame drip-fed past the request timeout (the stream or connection ended)
    "keepalive",  # a connection whose PING went unanswered (keepalive.py)
)


@dataclass
class ConnectionLimits:
    """What one client (connection, or IP) may take of the gRPC port."""

    max_streams: int = 10_000  # concurrent streams per connection (MAX_CONCURRENT_STREAMS)
    stream_budget: int = 1_000  # per IP: streams ended (or refused) without a request per BUDGET_WINDOW
    pending_streams: int = 16_384  # per IP: streams awaiting their first request (16 Envoy connections' worth)
    reset_budget: int = 10_000  # stream resets (sent by the client or by h2) per IP per BUDGET_WINDOW
    control_budget: int = 1_000  # control frames per connection per BUDGET_WINDOW
    max_connections: int = 10_000  # in total
    max_connections_per_ip: int = 100  # binds once the server holds half of max_connections
    request_timeout: float = 10.0  # to open a first stream, to send a first request, to finish a message
    idle_timeout: float = 300.0  # a connection holding no stream this long is closed (GOAWAY NO_ERROR)
    max_header_block: int = 64 * 1024  # bytes of one header block, HEADERS and CONTINUATION frames together
    tls_handshake_timeout: float = 5.0
    keepalive_time: float = 30.0  # a PING every this long (0: none)
    keepalive_timeout: float = 10.0  # closed when its ACK has not come within this (keepalive.py)
    partial_message_budget: int = 64 * 1024 * 1024  # bytes of messages being received, server-wide
    memory_limit: int = 0  # resident bytes past which the heaviest address gives way (overload.py; 0: derived)
    # descriptors kept out of the connection limit: the admin and REST ports (256 each by default),
    # the sources' connections, the upstreams reload and logs (FILE_HEADROOM)
    file_reserve: int = 2 * 256 + 88  # 2 * HttpLimits.max_connections + FILE_HEADROOM


FILE_HEADROOM = 88  # descriptors for the sources, the upstreams reload, logs and the listening sockets


@dataclass
class HttpLimits:
    """The aiohttp ports (admin, registration API, REST EDS): connections at once, and the time a
    request has to arrive and be handled."""

    max_connections: int = 256
    timeout: float = 10.0


class Holder(Protocol):
    """A connection the gate may close to make room for another."""

    def busy(self) -> bool:
        """Whether it holds a stream."""

    def give_way(self, why: str) -> None:
        """Close with GOAWAY saying why (the gate has already released its slot)."""

    def memory(self) -> int:
        """Bytes it holds, as estimated: unread input, unsent output, its streams (overload.py)."""

    def awaiting(self) -> int:
        """Its streams opened that have sent no request yet, less those whose requests are
        received and wait in the read scheduler's queue (overload.py)."""

    def held_back(self) -> bool:
        """Whether those streams wait on a window the client does not know it has yet
        (PeerBudgets.held_back): their requests come once it does. Or on us: requests of some of
        them wait in the read scheduler's queue, and the rest may be behind them, in the kernel's
        buffer while its reading is paused (fair.MeteredInput.requests_behind)."""


class PeerBudgets:
    """One client IP's connections and budgets, shared by all its connections."""

    __slots__ = (
        "connections",
        "cost",
        "held",
        "held_back",
        "ip",
        "partial",
        "pending",
        "resets",
        "spent",
        "throttled",
        "wasted",
    )

    def __init__(self, limits: ConnectionLimits, ip: str = "?") -> None:
        self.ip = ip
        self.connections = 0
        # its connections, least recently active first (touch() moves one to the end)
        self.held: dict[Holder, None] = {}
        self.partial = 0  # bytes of its messages being received
        self.pending = 0  # streams opened that have not sent a request yet
        self.held_back = 0  # of those, on connections whose window the client knows is spent (FirstWindow)
        self.wasted = Bucket(limits.stream_budget, BUDGET_WINDOW)  # streams ended without a request
        self.spent = False  # it ran out of that budget, and not a tenth of it has come back since
        self.resets = Bucket(limits.reset_budget, BUDGET_WINDOW)
        self.cost = AddressCost()  # its recent share of the loop's time, spent reading its input (fair.py)
        self.throttled = False  # it holds the most while memory is short: it opens no stream (overload.py)

    @property
    def idle(self) -> bool:
        return not (self.connections or self.partial or self.pending) and self.wasted.full and self.resets.full

    def may_open(self) -> bool:
        """Whether it may open a stream: not while its stream budget is spent, nor until a tenth of
        it has come back. A stream is charged only once h2, or a handler, has done its work, and one
        read brings hundreds of them: a single refilled token let a whole connection's worth in
        (a refused health Watch costs a handler each: 500 handlers per token)."""
        if self.throttled or (self.spent and self.wasted.share < RECOVERY):
            return False
        self.spent = not self.wasted.peek()
        return not self.spent

    def waste(self) -> bool:
        """Charge a stream that ended, or was refused, without a request: False over the budget."""
        if self.wasted.take():
            return True
        self.spent = True
        return False

    def pending_room(self, limit: int) -> int:
        """How many of its streams may await their first request: all of `limit` while it has
        wasted none lately, less as it spends its stream budget. A stream is charged only when it
        times out, after h2 has taken its header block; a flat limit let an address whose budget
        was spent open a whole limit's worth again for each token refilled (a thousand streams'
        work per token: connections of 1,000 idle streams kept the loop from everyone else for
        seconds after the attacker had gone)."""
        return int(limit * self.wasted.share)

    def touch(self, holder: Holder) -> None:
        """The connection sent a request (or opened a stream): it is the last one to give way."""
        held = self.held
        if holder in held:
            del held[holder]
            held[holder] = None

    def idlest(self, look: int = 32) -> Holder:
        """The connection to give way: of the `look` least recently active, the first that holds no
        stream, else the least recently active (a bounded look: an address may hold thousands)."""
        first: Holder | None = None
        for i, holder in enumerate(self.held):
            if first is None:
                first = holder
            if not holder.busy():
                return holder
            if i + 1 >= look:
                break
        assert first is not None, "idlest() of an address that holds no connection"
        return first


class FirstWindow:
    """What a connection's client knows of its window to send (RFC 9113 section 6.9): HTTP/2's
    initial 65,535 bytes, until it has acknowledged a SETTINGS we sent after our WINDOW_UPDATE
    raising it (frames are read in order), or sent more than it: it knew then.

    Why: a client's first flight is 65,535 bytes of DATA at most (one 60 KB Envoy request) with
    all its HEADERS (a hundred), whatever window we raised the connection to as it opened. Its
    other streams wait on flow control, not because it sends nothing; judged by our own window
    (4 MiB at once), a whole first flight counted as idle, and an address's connections opened
    at once were refused. Only our first raise is followed: later WINDOW_UPDATEs give back what
    was read, and are judged by our own window as before (an RTT in flight)."""

    __slots__ = ("acks", "known_at", "left", "sent", "unknown")

    def __init__(self) -> None:
        self.left = INITIAL_WINDOW  # of the initial window, what the client has not used yet
        self.unknown = False  # our raise is sent, the client may not know it yet
        self.sent = 0  # SETTINGS frames we sent
        self.acks = 0  # of those, acknowledged
        self.known_at = 0  # the acknowledgement (counted) that says the client has our raise

    def raised(self) -> None:
        """Our WINDOW_UPDATE raising the connection's window is sent (the first only)."""
        if not self.known_at:
            self.unknown = True
            self.known_at = self.sent + 1  # the SETTINGS sent next follows it

    def settings(self) -> None:
        """A SETTINGS frame of ours is sent."""
        self.sent += 1

    def ack(self) -> None:
        """The client acknowledged a SETTINGS of ours."""
        self.acks += 1
        if self.unknown and self.acks >= self.known_at:
            self.unknown = False

    def data(self, length: int) -> bool:
        """The client sent `length` bytes of DATA (while our raise is unknown): whether the
        window it knows has less than SPENT_WINDOW left."""
        left = self.left = self.left - length
        if left < 0:  # more than the initial window: it had our raise
            self.unknown = False
        return self.unknown and left < SPENT_WINDOW


class ThrottledLog:
    """At most `most` warnings per BUDGET_WINDOW: a client that keeps tripping a limit cannot fill the log."""

    def __init__(self, most: int = 20) -> None:
        self.bucket = Bucket(most, BUDGET_WINDOW)
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        """Log (at most `most` per window); what is left out is counted into the next line that is not."""
        if self.bucket.take():
            if self.suppressed:
                msg += f" ({self.suppressed} similar messages suppressed)"
                self.suppressed = 0
            log.warning(msg, *args)
        else:
            self.suppressed += 1


@dataclass
class Gate:
    """Connection limits and per-IP budgets of one server, and what it refused."""

    limits: ConnectionLimits
    peers: dict[str, PeerBudgets] = field(default_factory=dict)
    reads: ReadScheduler = field(default_factory=ReadScheduler)  # every connection's input, metered
    keepalive: KeepaliveCounts = field(default_factory=KeepaliveCounts)  # PINGs sent and answered
    connections: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _prune_at: int = 0  # table size at which idle peers are forgotten next
    # one log budget per reason: a flood of one kind of refusal does not hide the others
    _logs: dict[str, ThrottledLog] = field(default_factory=dict)
    # addresses by how many connections they hold (count -> IPs, in the order they reached it), and
    # the highest count: the address that gives way is found in O(1), not by walking every address
    _by_count: dict[int, dict[str, None]] = field(default_factory=dict)
    _top: int = 0
    # addresses whose last connection closed, oldest first: forgotten by sweep() once idle
    _gone: dict[str, None] = field(default_factory=dict)

    def shed(self, reason: str, peer: str, detail: str, count: int = 1) -> None:
        """Count `count` refusals and log them in one line (rate-limited per reason, with a count of
        the lines left out), with the client's address and why."""
        self.refused[reason] += count
        log_limit = self._logs.get(reason)
        if log_limit is None:
            log_limit = self._logs[reason] = ThrottledLog()
        log_limit.warning("%s from %s: %s", reason.replace("_", " "), peer, detail)

    def admit(self, ip: str, holder: Holder) -> PeerBudgets:
        """Take `holder` in for `ip`, closing another connection first if the table is full (of the
        address holding the most) or `ip` is over its own cap (one of its own): never the newcomer."""
        limits = self.limits
        peer = self.peers.get(ip)
        if peer is None:
            if len(self.peers) >= max(self._prune_at, limits.max_connections):
                self.sweep()  # before its next turn: a burst of fresh addresses may fill it first
                # next time at twice what is left: a table of busy peers is not walked per connection
                self._prune_at = 2 * len(self.peers)
            peer = self.peers[ip] = PeerBudgets(limits, ip)
        if peer.connections >= limits.max_connections_per_ip and 2 * self.connections >= limits.max_connections:
            self._make_room(
                peer, f"{ip} holds its limit of {limits.max_connections_per_ip} connections (server half full)"
            )
        elif self.connections >= limits.max_connections:
            top = self._top_peer()
            self._make_room(
                top,
                f"server holds its limit of {limits.max_connections} connections, "
                f"{top.ip} the most ({top.connections})",
            )
        self._count(peer, +1)
        peer.held[holder] = None
        return peer

    def release(self, peer: PeerBudgets, holder: Holder) -> None:
        """The connection is gone (a no-op for one the gate closed to make room: released then)."""
        if peer.held.pop(holder, 0) is None:
            self._count(peer, -1)

    def held_by(self) -> Iterator[tuple[str, int]]:
        """(IP, connections) of every address holding one, the most first."""
        for count in sorted(self._by_count, reverse=True):
            for ip in self._by_count[count]:
                yield ip, count

    def _make_room(self, peer: PeerBudgets, why: str) -> None:
        holder = peer.idlest()
        self.release(peer, holder)
        self.shed("connection_limit", peer.ip, f"closing one of its connections (GOAWAY) to make room: {why}")
        holder.give_way(why)

    def _top_peer(self) -> PeerBudgets:
        return self.peers[next(iter(self._by_count[self._top]))]

    def _count(self, peer: PeerBudgets, step: int) -> None:
        by_count, ip = self._by_count, peer.ip
        if peer.connections:
            at = by_count[peer.connections]
            del at[ip]
            if not at:
                del by_count[peer.connections]
        peer.connections += step
        self.connections += step
        if peer.connections:
            by_count.setdefault(peer.connections, {})[ip] = None
            self._top = max(self._top, peer.connections)
            if peer.connections == 1:
                self._gone.pop(ip, None)
        else:
            self._gone[ip] = None
        while self._top and self._top not in by_count:
            self._top -= 1

    def sweep(self) -> int:
        """Forget the addresses gone idle since their last connection closed; how many. One rule
        whether the overload check calls it (every half second) or a full table does: no connection,
        budgets full, cost decayed (nobody's debt forgotten); it walks only the addresses gone.

        Why soon, not when the table fills: each address's state is allocated among its
        connections' streams, and one small object left in a 1 MiB arena of the allocator keeps the
        whole arena: a hundred addresses' budgets kept 110 MB of freed streams from going back."""
        now, forgotten = self.reads.clock(), 0
        for ip in list(self._gone):
            peer = self.peers.get(ip)
            if peer is not None and not (peer.idle and peer.cost.now(now) < COST_FORGOTTEN):
                continue
            del self._gone[ip]
            if peer is not None and not peer.connections:
                del self.peers[ip]
                forgotten += 1
        return forgotten


class PartialBudget:
    """Bytes of request messages announced but not yet fully received: server-wide, and per client
    IP (a quarter of the total, at least one message). Past the total, a message up to
    SMALL_MESSAGE (Envoy's requests, node included, are ~60 KB) still goes on if its address holds
    less than SMALL_MESSAGE, up to twice the total: a client that holds the whole budget cannot stop
    the others' requests, and many addresses holding small messages cannot take more than twice the
    budget (each address's quarter alone let 40 addresses hold 2.9 GB)."""

    def __init__(self, total: int, max_message_size: int = 0) -> None:
        self.total = total
        self.per_ip = max(total // 4, max_message_size)
        self.used = 0
        self.refused = 0
        self.too_big = 0  # messages refused over --max-message-size (the readers count them here too)

    def take(self, n: int, peer: PeerBudgets | None = None) -> bool:
        if peer is not None and peer.partial + n > self.per_ip:
            self.refused += 1
            return False
        if self.used + n > self.total and (
            n > SMALL_MESSAGE or self.used + n > 2 * self.total or (peer is not None and peer.partial >= SMALL_MESSAGE)
        ):
            self.refused += 1
            return False
        self.used += n
        if peer is not None:
            peer.partial += n
        return True

    def give(self, n: int, peer: PeerBudgets | None = None) -> None:
        self.used -= n
        if peer is not None:
            peer.partial -= n


def fit_to_file_limit(limits: ConnectionLimits) -> None:
    """Raise the open-file limit to its hard limit, and keep the connection limit under it, less
    `limits.file_reserve` (the admin and REST ports, the sources, the upstreams reload): running out
    of descriptors fails everything at once, the admin port and the reload included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return
    room = max(16, soft - limits.file_reserve)
    if limits.max_connections > room:
        log.warning("open-file limit %d: gRPC connections limited to %d (not %d)", soft, room, limits.max_connections)
        limits.max_connections = room
