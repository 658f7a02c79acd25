"""HTTP and HTTPS checks over connections kept between checks of the same endpoint, within a
descriptor budget.

A check's cost was mostly its fresh TCP connection (connect, then reset; the kernel's share counts as
ours), and for `tls: true` its handshake (most of an HTTPS check's CPU): a kept connection turns a
check into one write and one read, encrypted or not. TLS is asyncio's layer under the same protocol,
with the context and server name a fresh HTTPS check has always had (probes.tls_context; an address
is no server name, so no SNI), so what is read, and its bounds, are the same over TLS; a kept TLS
connection costs ~47 KB of memory where a plain one costs ~2 KB. To reuse a connection the whole
answer must be read, so it is parsed here, boundedly: the status line and headers within MAX_HEAD
bytes, then a Content-Length or chunked body of at most MAX_BODY bytes. Anything else (a body to be
read until close, `Connection: close`, HTTP/1.0 without keep-alive, a 1xx, a head or body over its
limit, a malformed head, bytes nobody asked for, a timeout) closes the connection, and the check's
result is what it was before keep-alive: the status line decides. A parser of our own rather than h11:
the four headers that matter and a chunk-size line are all a check reads, and h11's state machine and
event objects in pure Python would cost as much CPU per check as the rest of the checker.

A check on a kept connection is driven by callbacks when the checker runs it (`start`): the request
written from the checker's timer, the status read in the connection's data_received and handed to
the checker there, the timeouts of all such checks with one timeout value kept by one timer
(_Expiry). No task, coroutine or Future per check, and no timer made and cancelled per check: about
a fifth of a kept check's CPU (docs/health-checks.md). Its result, counts and bounds are `check`'s, which still runs a
target's first check (a connect) and the fresh retry of a connection found closed, in a task.

Kept connections are per target (address, port, spec): the checker never runs two checks of one
target at once, so a connection is either idle here or carrying its one check. Idle ones are at most
`budget` (half of what the open-file limit leaves after the gRPC port's connections and reserve, at
most MAX_KEPT); when full, the least recently used idle one is closed if it will be needed later than
the newcomer, else the newcomer is: plain LRU would close, under a round robin of more endpoints than
the budget, exactly the one due next, and keep none useful. Kept TLS connections, ~47 KB each, are
also at most TLS_MEMORY_SHARE of the memory watermark's limit, chosen among by the same rule. `forget`
(an endpoint no longer checked) and `close` (the checker stops) close what is kept.

TLS handshakes in flight are at most `max_handshakes` (MAX_HANDSHAKES): a cold start with a thousand
HTTPS endpoints is a thousand handshakes at once, each ~1 ms of this process's CPU, and all of them
interleaved on one loop finish late together, each past its timeout: the checker's congestion, not
the backends'. So an HTTPS check connects first (a backend that does not answer costs no slot), then
waits for a slot, and its timeout is paused while it waits: it covers the connect, the handshake and
the answer, never the queue. A check that gets no slot within its interval (SLOT_WAIT at least)
was never sent: its result is `starved` (not counted, as a check whose timeout fired far too late),
and the next one is due anyway. gRPC checks over TLS (a fresh connection each, probes.check) wait
for a slot the same way, before they connect.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from . import probes
from .probes import MAX_HEAD, request_head, status_of, tls_context
from .spec import HealthSpec
from .tracker import Result

# A health answer's body is a word or a small JSON document. 64 KiB is far more than any of those and
# what one read of the socket brings at most: past it the body is not worth reading to keep the
# connection, which is closed (the status, already read, still decides the check).
MAX_BODY = 65536
# Idle kept connections at most, whatever the open-file limit: the aim is 10,000 endpoints, and each
# costs a descriptor, a socket's kernel memory and one open connection on its backend.
MAX_KEPT = 10_000
MAX_CHUNK_LINE = 1024  # a chunk-size line (hex size and extensions)
# An idle kept TLS connection holds ~47 KB (OpenSSL's state and buffers; a plain one ~2 KB, measured
# RSS). That is the server's own memory, but it counts in the resident size the memory watermark
# compares with --memory-limit: kept TLS connections take at most this share of the limit.
TLS_CONN_BYTES = 48 * 1024
TLS_MEMORY_SHARE = 0.1

Key = tuple[str, int, HealthSpec]
KINDS = ("http", "https")  # the kinds of kept connections, as counted
HOW = ("opened", "reused", "evicted")
# TLS handshakes in flight at most. A client handshake costs ~1 ms of CPU here (P-256, measured with
# bench/health_checks.py --https); 32 at once are ~30 ms of work, inside a 0.5 s timeout on a busy
# 2-core host (not always inside 0.1 s at a load average of 7: docs/health-checks.md), and with 50 ms
# of round trip still ~300 handshakes a second: 1,000 endpoints connected within a few seconds of a
# cold start, after which kept connections need none.
MAX_HANDSHAKES = 32
TIMER_SLACK = 0.001  # a timer may fire this much before it is due (uvloop counts whole milliseconds)
# A check waits for a handshake slot at most its interval, and never less than this: a cold start's
# queue (1,000 endpoints every 0.5 s) drains within it on a loaded 2-core host, where a wait of one
# 0.5 s interval gave up on a thousand checks, each a connection opened and closed unused (a
# handshake error in the backend's log) and a warning here.
SLOT_WAIT = 5.0


def kind_of(spec: HealthSpec) -> str:
    """The kind a kept connection is counted under: `http` or `https` (`tls: true`)."""
    return "https" if spec.tls else "http"


def tls_budget(memory_limit: int) -> int:
    """Idle kept TLS connections allowed by memory: TLS_MEMORY_SHARE of `memory_limit` (0: no limit
    known, none beyond the descriptor budget)."""
    return MAX_KEPT if memory_limit <= 0 else int(memory_limit * TLS_MEMORY_SHARE) // TLS_CONN_BYTES


def budget(reserved: int) -> int:
    """Idle kept connections allowed: half of the open-file limit left after `reserved` (the gRPC
    port's connection limit and its reserve), so those always fit, and the other half stays for checks
    in flight on fresh connections; at most MAX_KEPT."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_KEPT
    return max(0, min(MAX_KEPT, (soft - reserved) // 2))


class _NoSlot(Exception):
    """No TLS handshake slot within the check's interval (or its connection closed while it waited):
    the check was never sent."""

    def __init__(self, waited: float) -> None:
        super().__init__(waited)
        self.waited = waited


class _Stale(Exception):
    """A kept connection closed before any byte of the answer: the backend closed it while idle (the
    race every keep-alive client has). The check is tried once on a fresh connection."""


_REASONS: dict[int, str] = {}  # status -> "HTTP <status>", made once (three digits: 900 at most)


def _reason(status: int) -> str:
    reason = _REASONS.get(status)
    if reason is None:
        reason = _REASONS[status] = f"HTTP {status}"
    return reason


class Answer(Protocol):
    """Where a connection puts the status of the answer in progress: a Future (a check awaited in a
    task) or a _Pending (a check driven by callbacks, KeptConnections.start)."""

    def done(self) -> bool: ...
    def set_result(self, result: int, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


def _expire(answer: Answer) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One connection and the answer in progress on it. `answer` resolves when the connection can say
    the check's status: with the whole answer read (`keep` true: reusable) or at the point it cannot
    be reused (`keep` false: the connection is closed)."""

    def __init__(self, idle: OrderedDict[Key, _Conn], key: Key, request: bytes) -> None:
        self.idle = idle  # where it waits between checks (it leaves if the backend closes it meanwhile)
        self.key = key
        self.request = request  # the check's GET, the same each time
        self.doomed = False  # its target was forgotten while it carried a check: closed after it
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None  # set while a check is in progress
        self.buf = b""
        self.status: int | None = None  # of the answer in progress, once its status line is read
        self.got = False  # a byte of the answer in progress has arrived
        self.keep = False  # the whole answer was read and the connection may carry another
        self.lost = False
        self.state = 0  # 0 head, 1 body by length, 2 chunk-size line, 3 chunk data, 4 trailers
        self.left = 0  # body or chunk bytes still to come
        self.body = 0  # body bytes read
        self.version11 = True
        self.next_use = 0.0  # when idle: when its check is due next (loop time)

    # -- the asyncio side ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.keep = False
        answer = self.answer
        if answer is None and self.idle.get(self.key) is self:
            del self.idle[self.key]  # closed by the backend while idle: its budget slot is free again
        if answer is not None and not answer.done():
            if self.status is not None:
                answer.set_result(self.status)  # the status line was read: it decides, as before
            elif not self.got:
                answer.set_exception(_Stale())
            else:
                answer.set_exception(asyncio.IncompleteReadError(self.buf, None))

    def eof_received(self) -> bool:
        return False  # close: nothing more can be asked on it

    def start(self, answer: Answer) -> None:
        self.answer = answer
        self.buf = b""
        self.status = None
        self.got = self.keep = False
        self.state = self.left = self.body = 0
        assert self.transport is not None
        self.transport.write(self.request)

    def abort(self) -> None:
        self.keep = False
        if self.transport is not None:
            self.transport.abort()

    # -- the answer ----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.done():
            return self.abort()  # bytes nobody asked for: never reused
        self.got = True
        self.buf += data
        try:
            self._parse()
        except ValueError as e:
            self._done(keep=False, error=e)

    def _parse(self) -> None:
        while True:
            state, buf = self.state, self.buf
            if state == 0:
                if not self._head():
                    return
            elif state in (1, 3):
                n = min(len(buf), self.left)
                self.body += n
                self.left -= n
                self.buf = buf[n:]
                if self.left:
                    return
                if state == 1:
                    return self._done(keep=not self.buf)
                if self.buf[:2] == b"\r\n":
                    self.buf, self.state = self.buf[2:], 2
                elif self.buf[:1] == b"\n":
                    self.buf, self.state = self.buf[1:], 2
                elif len(self.buf) >= 2 or self.buf[:1] not in (b"", b"\r"):
                    raise ValueError("malformed chunk")
                else:
                    return
            elif state == 2:
                end = buf.find(b"\n")
                if end < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        raise ValueError("chunk-size line too long")
                    return
                size = buf[:end].split(b";", 1)[0].strip()
                if not size or len(size) > 8 or size.strip(b"0123456789abcdefABCDEF"):
                    raise ValueError("malformed chunk size")
                self.left = int(size, 16)
                self.buf = buf[end + 1 :]
                if self.left == 0:
                    self.state = 4
                elif self.body + self.left > MAX_BODY:
                    return self._done(keep=False)  # too big to read: closed, the status stands
                else:
                    self.state = 3
            else:  # trailers, then an empty line
                end = buf.find(b"\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ValueError("trailers too long")
                    return
                self.buf = buf[end + 1 :]
                if not buf[:end].strip():
                    return self._done(keep=not self.buf)

    def _head(self) -> bool:
        """Parse the status line and headers once they are in; False while more is needed."""
        buf = self.buf
        if self.status is None:
            end = buf.find(b"\n")
            if end < 0 or end > MAX_HEAD:
                if end > MAX_HEAD or len(buf) > MAX_HEAD:
                    self._done(keep=False, error=asyncio.LimitOverrunError("no line break", len(buf)))
                return False
            self.status = status_of(buf[: end + 1])  # ValueError: not HTTP, as before
            self.version11 = buf.startswith(b"HTTP/1.1")
        first = buf.find(b"\n") + 1
        a, b = buf.find(b"\n\r\n", first - 1), buf.find(b"\n\n", first - 1)
        end = min(a, b) if a >= 0 and b >= 0 else max(a, b)
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._done(keep=False)  # a head too long: closed, the status stands
            return False
        if end > MAX_HEAD:
            self._done(keep=False)
            return False
        body_at = end + (3 if end == a else 2)
        length: int | None = None
        chunked = close = keep_alive = False
        for line in buf[first:end].split(b"\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                if line.strip():
                    raise ValueError("malformed header")
                continue
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise ValueError("malformed Content-Length")
                length = int(value)
            elif name == b"transfer-encoding":
                if value.strip().lower() != b"chunked":
                    close = True  # an encoding this reader does not take apart
                chunked = True
            elif name == b"connection":
                tokens = value.lower()
                close |= b"close" in tokens
                keep_alive |= b"keep-alive" in tokens
        status = self.status
        assert status is not None
        self.buf = buf[body_at:]
        if close or not (self.version11 or keep_alive) or 100 <= status < 200:
            self._done(keep=False)
        elif status in (204, 304):
            self._done(keep=not self.buf)
        elif chunked and length is not None:
            self._done(keep=False)  # both framings: ambiguous, not reused
        elif chunked:
            self.state = 2
            return True
        elif length is None:
            self._done(keep=False)  # read until close: the status stands, the connection goes
        elif length > MAX_BODY:
            self._done(keep=False)
        else:
            self.state, self.left = 1, length
            return True
        return False

    def _done(self, keep: bool, error: Exception | None = None) -> None:
        """The answer is over (or cannot be read on): its status, once read, decides the check, as
        before keep-alive, whatever came after it; before it, `error` does."""
        answer = self.answer
        self.keep = keep and not self.lost
        if not self.keep:
            self.abort()
        if answer is not None and not answer.done():
            if self.status is not None:
                answer.set_result(self.status)
            else:
                answer.set_exception(error or ValueError("no status line"))


# What a callback-driven check reports: its Result, or (its kept connection closed before any byte of
# the answer) the same check tried again on a fresh connection, to be awaited in a task.
Outcome = Result | Coroutine[Any, Any, Result]
OnResult = Callable[[Any, Outcome], None]


class _Pending:
    """A check on a kept connection driven by callbacks alone (KeptConnections.start): no task, no
    coroutine, no Future. The connection sets its status (or an error) as it would a Future's; the
    outcome goes to `on_result(arg, ...)` at once, read as KeptConnections.check reads an answer."""

    __slots__ = ("arg", "conn", "deadline", "finished", "key", "loop", "on_result", "owner", "start", "wall")

    def __init__(
        self,
        owner: KeptConnections,
        loop: asyncio.AbstractEventLoop,
        key: Key,
        conn: _Conn,
        on_result: OnResult,
        arg: Any,
        deadline: float,
    ) -> None:
        self.owner = owner
        self.loop = loop
        self.key = key
        self.conn = conn
        self.on_result = on_result
        self.arg = arg
        self.start, self.wall = time.perf_counter(), time.time()
        self.deadline = deadline
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, status: int, /) -> None:
        if not self.finished:
            self.finished = True
            self.owner._answered(self, status, None)

    def set_exception(self, exception: BaseException, /) -> None:
        if not self.finished:
            self.finished = True
            self.owner._answered(self, None, exception)

    def cancel(self) -> None:
        """The checker stops: no outcome, the connection closed."""
        self.finished = True
        self.conn.answer = None
        self.conn.abort()


class _Expiry:
    """The timeouts of callback-driven checks that share one timeout, with one timer rather than one
    per check (a timer made and cancelled costs 3.6 us, of some 50 us a check). They begin in deadline
    order (loop time only grows), so they wait in a queue in that order; the timer is due at the
    deadline of the oldest still unanswered, and each one unanswered by its deadline gets
    TimeoutError then, as its own timer would have given it. Answered ones leave the queue when the
    timer next fires: about once per timeout, not once per check."""

    __slots__ = ("loop", "queue", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: deque[_Pending] = deque()
        self.timer: asyncio.TimerHandle | None = None

    def add(self, pending: _Pending) -> None:
        self.queue.append(pending)
        if self.timer is None:
            self.timer = self.loop.call_at(pending.deadline, self._fire)

    def _fire(self) -> None:
        self.timer = None
        queue = self.queue
        # uvloop's timers fire on whole milliseconds, possibly just before they are due: a
        # per-check timer would have fired here too
        now = self.loop.time() + TIMER_SLACK
        while queue:
            head = queue[0]
            if not head.finished:
                if head.deadline > now:
                    self.timer = self.loop.call_at(head.deadline, self._fire)
                    return
                _expire(head)
            queue.popleft()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()


def _not_sent(waited: float) -> Result:
    return Result(False, f"not sent: no TLS handshake slot in {waited:.2f}s", waited, time.time(), True)


class KeptConnections:
    """The probe with kept connections for HTTP and HTTPS checks (`check`); TCP and gRPC go to
    probes.check, fresh each time. `reserved` (descriptors the gRPC port may hold) sizes the budget,
    one for both: a kept TLS connection holds a descriptor as a plain one does. TLS ones are also at
    most `tls_budget` (by `memory_limit`, the watermark's): each holds ~47 KB where a plain one holds
    ~2 KB. Each kind waits in its own least-recently-used order. TLS handshakes in flight are at most
    `max_handshakes`; `handshaking` and `handshakes_peak` say how many are and have been at once."""

    def __init__(
        self,
        reserved: int = 0,
        budget_: int | None = None,
        memory_limit: int = 0,
        tls_budget_: int | None = None,
        max_handshakes: int = MAX_HANDSHAKES,
        slot_wait: float = SLOT_WAIT,
    ) -> None:
        self.reserved = reserved
        self.memory_limit = memory_limit
        self._budget = budget_
        self._tls_budget = tls_budget_
        self._idle: OrderedDict[Key, _Conn] = OrderedDict()  # plain, least recently used first
        self._idle_tls: OrderedDict[Key, _Conn] = OrderedDict()  # TLS, the same
        self._busy: dict[Key, _Conn] = {}  # carrying a check
        self._closed = False
        # (http|https, how) -> count: connections opened, checks on a kept connection (no connect, no
        # handshake), idle connections closed (or not kept) for the budget
        self.counts: Counter[tuple[str, str]] = Counter()
        self.max_handshakes = max_handshakes
        self.slot_wait = slot_wait
        self._slots = asyncio.Semaphore(max_handshakes)  # first come, first served
        self.handshaking = 0  # TLS handshakes (or gRPC-over-TLS checks) holding a slot now
        self.handshakes_peak = 0  # the most at once so far
        self.handshakes = 0  # TLS handshakes of HTTPS checks completed
        self.slot_waits = 0  # checks that found every slot taken and waited
        self._expiries: dict[float, _Expiry] = {}  # timeout -> callback-driven checks in flight with it

    def _total(self, how: str) -> int:
        return sum(n for (_, h), n in self.counts.items() if h == how)

    @property
    def opened(self) -> int:
        return self._total("opened")

    @property
    def reused(self) -> int:
        return self._total("reused")

    @property
    def evicted(self) -> int:
        return self._total("evicted")

    def idle_by_kind(self) -> Counter[str]:
        """Idle kept connections by kind, for the metrics."""
        return Counter({"http": len(self._idle), "https": len(self._idle_tls)})

    @property
    def budget(self) -> int:
        if self._budget is None:  # first used once the server runs: the open-file limit raised by then
            self._budget = budget(self.reserved)
        return self._budget

    @property
    def tls_budget(self) -> int:
        if self._tls_budget is None:  # as the budget: the memory limit is known once the server runs
            self._tls_budget = min(self.budget, tls_budget(self.memory_limit))
        return self._tls_budget

    @property
    def idle(self) -> int:
        return len(self._idle) + len(self._idle_tls)

    def _idle_of(self, key: Key) -> OrderedDict[Key, _Conn]:
        return self._idle_tls if key[2].tls else self._idle

    async def _slot(self, spec: HealthSpec) -> tuple[float, bool]:
        """Take a TLS handshake slot, waiting at most the check's interval or `slot_wait`, whichever is
        longer: the time waited, and whether every slot was taken. _NoSlot if none came (the check is
        then not sent)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        queued = self._slots.locked()
        if queued:
            self.slot_waits += 1
            try:
                async with asyncio.timeout(max(spec.interval, self.slot_wait)):
                    await self._slots.acquire()
            except TimeoutError:
                raise _NoSlot(loop.time() - began) from None
        else:
            await self._slots.acquire()
        self.handshaking += 1
        self.handshakes_peak = max(self.handshakes_peak, self.handshaking)
        return loop.time() - began, queued

    def _unslot(self) -> None:
        self.handshaking -= 1
        self._slots.release()

    async def _handshake(self, conn: _Conn, address: str, spec: HealthSpec, deadline: float) -> float:
        """TLS over `conn`, connected, in a slot: the time spent waiting for it (the check's timeout
        is moved on by that much)."""
        waited, queued = await self._slot(spec)
        try:
            if conn.lost or conn.transport is None:
                if queued:
                    raise _NoSlot(waited)  # closed while it queued: the wait's doing, not a check
                raise ConnectionResetError("connection closed before the TLS handshake")
            loop = asyncio.get_running_loop()
            async with asyncio.timeout_at(deadline + waited):
                tls = await loop.start_tls(conn.transport, conn, tls_context(), server_hostname=address)
            assert tls is not None
            conn.transport = tls
            self.handshakes += 1
        finally:
            self._unslot()
        return waited

    async def _fresh_tls(self, address: str, port: int, spec: HealthSpec) -> Result:
        """A check on a fresh TLS connection of its own (gRPC), in a slot; its timeout starts there."""
        try:
            await self._slot(spec)
        except _NoSlot as e:
            return _not_sent(e.waited)
        try:
            return await probes.check(address, port, spec)
        finally:
            self._unslot()

    async def check(
        self, address: str, port: int, spec: HealthSpec, since: tuple[float, float, float] | None = None
    ) -> Result:
        """One check, awaited. `since`: (perf_counter, wall time, loop deadline) of a check begun by
        `start` whose kept connection turned out closed: its retry keeps its timing."""
        if spec.kind != "http":
            if spec.tls:
                return await self._fresh_tls(address, port, spec)
            return await probes.check(address, port, spec)
        key = (address, port, spec)
        kind = kind_of(spec)
        loop = asyncio.get_running_loop()
        if since is None:
            start, wall = time.perf_counter(), time.time()
            deadline = loop.time() + spec.timeout
        else:
            start, wall, deadline = since
        idle = self._idle_of(key)
        conn = idle.pop(key, None)
        status: int | None = None
        try:
            if conn is not None:
                try:
                    status = await self._ask(key, conn, loop, deadline)
                except _Stale:
                    conn = None  # closed before it could carry the check: not one reused
                finally:
                    if conn is not None:  # counted once it carried the check: a counter never goes down
                        self.counts[(kind, "reused")] += 1
            if conn is None:
                request = request_head(address, spec.port or port, spec.path, keep=True)
                async with asyncio.timeout_at(deadline):  # the connect; the answer has its own timer
                    _, conn = await loop.create_connection(
                        lambda: _Conn(idle, key, request), address, spec.port or port
                    )
                if spec.tls:  # in a slot; the server name: the address, as before (no SNI for an IP)
                    self._busy[key] = conn  # so that `forget` while it waits for a slot closes it after
                    waited = await self._handshake(conn, address, spec, deadline)
                    deadline += waited  # the wait is not the backend's: its timeout stood still
                    start += waited
                self.counts[(kind, "opened")] += 1
                status = await self._ask(key, conn, loop, deadline)
        except TimeoutError:
            if conn is not None:
                conn.abort()
                status = conn.status  # the status line was read, the rest of the answer was slow
            if status is None:
                return Result(False, f"timed out after {spec.timeout:g}s", time.perf_counter() - start, wall)
        except _NoSlot as e:
            if conn is not None:
                conn.abort()
            return _not_sent(e.waited)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _Stale) as e:
            if conn is not None:
                conn.abort()
            why = "connection closed before a status line" if isinstance(e, _Stale) else probes._why(e)
            return Result(False, why, time.perf_counter() - start, wall)
        finally:
            if conn is not None:
                busy = self._busy.pop(key, None)
                if busy is not None and busy is not conn:
                    self._busy[key] = busy  # a check of a target that came back meanwhile
                self._release(key, conn, loop.time() + spec.interval)
        assert status is not None
        return Result(spec.expects(status), _reason(status), time.perf_counter() - start, wall)

    def start(self, loop: asyncio.AbstractEventLoop, key: Key, on_result: OnResult, arg: Any) -> bool:
        """Begin an HTTP(S) check of `key` on its idle kept connection, if it has one, driven by
        callbacks: its outcome goes to `on_result(arg, outcome)`, from the connection's callback. False
        (nothing begun): no such connection, or not an HTTP check; await `check` instead. The same
        check as `check` makes on a kept connection, without a task and its coroutines (about a
        fifth of the CPU of a check on a kept connection). `loop`: the running one, handed in (asyncio's
        get_running_loop asks the kernel for the process id each time)."""
        spec = key[2]
        if spec.kind != "http":
            return False
        idle = self._idle_tls if spec.tls else self._idle
        conn = idle.get(key)
        if conn is None or conn.lost:
            return False  # none, or closed: `check` opens one (a closed one is tried fresh, as ever)
        del idle[key]
        pending = _Pending(self, loop, key, conn, on_result, arg, loop.time() + spec.timeout)
        self._busy[key] = conn
        expiry = self._expiries.get(spec.timeout)
        if expiry is None or expiry.loop is not loop:
            expiry = self._expiries[spec.timeout] = _Expiry(loop)
        expiry.add(pending)
        try:
            conn.start(pending)
        except BaseException:
            pending.cancel()
            if self._busy.get(key) is conn:
                del self._busy[key]
            raise
        return True

    def _answered(self, pending: _Pending, status: int | None, error: BaseException | None) -> None:
        """A callback-driven check's answer (or its end): as `check` reads one from `_ask`."""
        key, conn, spec = pending.key, pending.conn, pending.key[2]
        conn.answer = None
        if isinstance(error, _Stale):  # closed before any byte of the answer: tried once, fresh
            address, port, _ = key
            retry = self.check(address, port, spec, since=(pending.start, pending.wall, pending.deadline))
            pending.on_result(pending.arg, retry)
            return
        self.counts[(kind_of(spec), "reused")] += 1
        why: str | None = None
        if isinstance(error, TimeoutError):
            conn.abort()
            status = conn.status  # the status line was read, the rest of the answer was slow
            if status is None:
                why = f"timed out after {spec.timeout:g}s"
        elif error is not None:  # malformed, cut short, a status line too long: as `check` has them
            conn.abort()
            why = probes._why(error)
        took = time.perf_counter() - pending.start
        if why is None:
            assert status is not None
            result = Result(spec.expects(status), _reason(status), took, pending.wall)
        else:
            result = Result(False, why, took, pending.wall)
        busy = self._busy.pop(key, None)
        if busy is not None and busy is not conn:
            self._busy[key] = busy  # a check of a target that came back meanwhile
        self._release(key, conn, pending.loop.time() + spec.interval)
        pending.on_result(pending.arg, result)

    async def _ask(self, key: Key, conn: _Conn, loop: asyncio.AbstractEventLoop, deadline: float) -> int:
        """Send the check on `conn` and wait for its status until `deadline`: a plain timer on the
        answer rather than asyncio.timeout (a check on a kept connection is this and nothing else)."""
        if conn.lost:
            raise _Stale()
        self._busy[key] = conn
        answer: asyncio.Future[int] = loop.create_future()
        timer = loop.call_at(deadline, _expire, answer)
        conn.start(answer)
        try:
            return await answer
        finally:
            timer.cancel()
            conn.answer = None

    def _release(self, key: Key, conn: _Conn, next_use: float) -> None:
        """Keep the connection for the next check of `key`, if it may be and the budget allows."""
        if not conn.keep or conn.lost or conn.doomed or self._closed:
            conn.abort()
            return
        conn.next_use = next_use
        idle = self._idle_of(key)
        if key[2].tls and len(idle) >= self.tls_budget:
            among: tuple[OrderedDict[Key, _Conn], ...] | None = (idle,)  # TLS ones at their memory bound
        elif self.idle >= self.budget:
            among = (self._idle, self._idle_tls)
        else:
            among = None
        if among is not None and not self._make_room(key, next_use, among):
            conn.abort()
            return
        idle[key] = conn

    def _make_room(self, key: Key, next_use: float, among: tuple[OrderedDict[Key, _Conn], ...]) -> bool:
        """Close the least recently used idle connection (of `among`'s kinds, the one due later) if it
        is needed later than the newcomer; else the newcomer is not kept (False). Counted as evicted."""
        found: tuple[Key, _Conn, OrderedDict[Key, _Conn]] | None = None
        for idle in among:
            if idle:
                head_key, head = next(iter(idle.items()))
                if found is None or head.next_use > found[1].next_use:
                    found = (head_key, head, idle)
        if found is None:
            self.counts[(kind_of(key[2]), "evicted")] += 1
            return False
        oldest_key, oldest, idle = found
        if oldest.next_use <= next_use:  # the oldest is needed sooner than the newcomer
            self.counts[(kind_of(key[2]), "evicted")] += 1
            return False
        del idle[oldest_key]
        self.counts[(kind_of(oldest_key[2]), "evicted")] += 1
        oldest.abort()
        return True

    def forget(self, key: Key) -> None:
        """`key` is no longer checked: close its connection (at once, or when its check ends)."""
        conn = self._idle_of(key).pop(key, None)
        if conn is not None:
            conn.abort()
        busy = self._busy.get(key)
        if busy is not None:
            busy.doomed = True

    def close(self) -> None:
        """The checker stops: close every kept connection; those carrying a check close after it."""
        self._closed = True
        for conn in self._busy.values():
            conn.doomed = True
            if isinstance(conn.answer, _Pending):
                conn.answer.cancel()  # a callback-driven check: nothing awaits it to be cancelled
        for expiry in self._expiries.values():
            expiry.close()
        for idle in (self._idle, self._idle_tls):
            while idle:
                idle.popitem()[1].abort()
