"""What happens on xDS streams, told to whoever watches: the stream log, the counters behind
/metrics and /v1/stats, the push-latency histogram, heap trimming. As go-control-plane's server
`Callbacks`: the session driving a stream knows nothing of metrics or logs, and a new watcher is
one more observer, not another hook in the session.

An observer's methods run on the event loop, inside the stream's work: they must be cheap and
must not raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .encoded import Resource
from .ratelimit import Bucket

log = logging.getLogger("eds_server.grpc")


class StreamView(Protocol):
    """What an observer may read of a stream."""

    id: int
    requested: bool  # its first request was read
    node: str
    cluster: str
    peer: str
    opened_at: float

    @property
    def transport(self) -> str: ...  # "sotw" or "delta"
    @property
    def subscribed(self) -> Iterable[str]: ...
    def fields(self, event: str) -> dict[str, str]: ...  # structured fields for JSON logs


class StreamObserver:
    """Every event with nothing done: an observer overrides what it watches."""

    def started(self, s: StreamView) -> None:
        """The service took the stream (within its limits); its first request is still to come.
        Every started stream is `closed` once."""

    def opened(self, s: StreamView) -> None:
        """The stream's first request was read (its node is known)."""

    def request(self, s: StreamView) -> None:
        """Any request was read."""

    def ack(self, s: StreamView, names: Sequence[str]) -> None: ...

    def nack(self, s: StreamView, names: Sequence[str], groups: Sequence[str], version: str, message: str) -> None:
        """Envoy rejected `version` of `names`; `groups`: each name, or "(unknown name)" if not served."""

    def subscribed(self, s: StreamView, added: Sequence[str], removed: Sequence[str]) -> None: ...

    def responded(self, s: StreamView, resources: Iterable[Resource]) -> None:
        """A response was sent (or queued for the connection's next write)."""

    def access_denied(self, s: StreamView | None, names: Sequence[str], why: str) -> None:
        """Refused by the authorization hook (a stream, or a fetch: None)."""

    def stopped_reading(self, s: StreamView) -> None:
        """Ended for not reading its responses."""

    def closed(self, s: StreamView) -> None: ...


class Observers(StreamObserver):
    """Several observers as one, told in the order they were added."""

    def __init__(self, *observers: StreamObserver) -> None:
        self.observers = list(observers)

    def add(self, observer: StreamObserver) -> None:
        self.observers.append(observer)

    def started(self, s: StreamView) -> None:
        for o in self.observers:
            o.started(s)

    def opened(self, s: StreamView) -> None:
        for o in self.observers:
            o.opened(s)

    def request(self, s: StreamView) -> None:
        for o in self.observers:
            o.request(s)

    def ack(self, s: StreamView, names: Sequence[str]) -> None:
        for o in self.observers:
            o.ack(s, names)

    def nack(self, s: StreamView, names: Sequence[str], groups: Sequence[str], version: str, message: str) -> None:
        for o in self.observers:
            o.nack(s, names, groups, version, message)

    def subscribed(self, s: StreamView, added: Sequence[str], removed: Sequence[str]) -> None:
        for o in self.observers:
            o.subscribed(s, added, removed)

    def responded(self, s: StreamView, resources: Iterable[Resource]) -> None:
        for o in self.observers:
            o.responded(s, resources)

    def access_denied(self, s: StreamView | None, names: Sequence[str], why: str) -> None:
        for o in self.observers:
            o.access_denied(s, names, why)

    def stopped_reading(self, s: StreamView) -> None:
        for o in self.observers:
            o.stopped_reading(s)

    def closed(self, s: StreamView) -> None:
        for o in self.observers:
            o.closed(s)


@dataclass
class Counters(StreamObserver):
    """What /metrics and /v1/stats count of the streams."""

    streams_opened: int = 0
    denied: int = 0  # streams and fetches refused by the authorization hook
    dropped: int = 0  # streams ended for not reading (send timeout)
    refused: int = 0  # streams refused at the total limit
    nacks_by_group: dict[str, int] = field(default_factory=dict)  # known groups only: bounded
    requests: int = 0
    responses: int = 0
    acks: int = 0
    nacks: int = 0

    def started(self, s: StreamView) -> None:
        self.streams_opened += 1

    def request(self, s: StreamView) -> None:
        self.requests += 1

    def ack(self, s: StreamView, names: Sequence[str]) -> None:
        self.acks += 1

    def nack(self, s: StreamView, names: Sequence[str], groups: Sequence[str], version: str, message: str) -> None:
        self.nacks += 1
        for group in groups:
            self.nacks_by_group[group] = self.nacks_by_group.get(group, 0) + 1

    def responded(self, s: StreamView, resources: Iterable[Resource]) -> None:
        self.responses += 1

    def access_denied(self, s: StreamView | None, names: Sequence[str], why: str) -> None:
        self.denied += 1

    def stopped_reading(self, s: StreamView) -> None:
        self.dropped += 1


def clip(text: str, most: int = 1000) -> str:
    """Client-chosen text made safe for a one-line log entry."""
    text = text if len(text) <= most else text[:most] + "..."
    return text.encode("unicode_escape").decode("ascii")


def names_shown(names: Iterable[str], most: int = 10) -> str:
    """A bounded rendering of a client-chosen list of names, for logs."""
    names = list(names)
    shown = ",".join(clip(n, 100) for n in names[:most])
    return shown + (f",... ({len(names)} names)" if len(names) > most else "")


STREAM_LINES = 300  # opened and closed lines logged one by one at once, refilled over...
STREAM_LINES_WINDOW = 10.0  # ...these seconds; past them, one line counts what was not logged
DROP_LINES = 20  # "dropping ...: not reading" WARNINGs per window, before they are counted instead


class StreamLog(StreamObserver):
    """The stream lines of the log: opened, closed, NACKs, denials, drops (ACKs at debug).

    Opened and closed lines are rate limited: a fleet of 10,000 Envoys reconnecting at once would
    write 10,000 lines (a tenth of the CPU it takes to connect them) that nobody reads one by one.
    Past STREAM_LINES in STREAM_LINES_WINDOW, one line per window says how many were left out;
    /v1/streams and the metrics still show every stream. Drops (a stream ended for not reading)
    are WARNINGs, DROP_LINES per window, then counted into one line per window (2,000 non-reading
    streams dropped at once wrote 2,000 lines). NACKs and denials are always logged.
    """

    def __init__(self, lines: int = STREAM_LINES, window: float = STREAM_LINES_WINDOW) -> None:
        self._bucket = Bucket(lines, window)
        self._drops = Bucket(DROP_LINES, window)
        self._window = window
        self._left_out = {"opened": 0, "closed": 0, "dropped": 0}
        self._summary: asyncio.TimerHandle | None = None

    def _may_log(self, event: str, bucket: Bucket | None = None) -> bool:
        bucket = bucket or self._bucket
        if bucket.peek():  # not take() alone: a refusal would empty the bucket, and a steady
            return bucket.take()  # rate over the budget would never log a line again
        self._left_out[event] += 1
        if self._summary is None:
            with contextlib.suppress(RuntimeError):  # no event loop (a unit test): counted only
                self._summary = asyncio.get_running_loop().call_later(self._window, self.summarise)
        return False

    def summarise(self) -> None:
        """Log how many stream lines were left out since the last summary, if any."""
        if self._summary is not None:
            self._summary.cancel()  # called before its time (the server stops)
            self._summary = None
        opened, closed, dropped = self._left_out["opened"], self._left_out["closed"], self._left_out["dropped"]
        self._left_out = {"opened": 0, "closed": 0, "dropped": 0}
        if dropped:
            log.warning(
                "%d more streams dropped for not reading were not logged one by one (over %d lines in "
                "%gs); eds_clients_dropped_total counts them all",
                dropped,
                int(self._drops.capacity),
                self._window,
                extra={"event": "drop_lines_left_out", "dropped": dropped},
            )
        if opened or closed:
            fields = {"event": "stream_lines_left_out", "opened": opened, "closed": closed}
            log.info(
                "%d streams opened and %d closed were not logged one by one (over %d stream lines "
                "in %gs); /v1/streams lists every stream",
                opened,
                closed,
                int(self._bucket.capacity),
                self._window,
                extra=fields,
            )

    def opened(self, s: StreamView) -> None:
        if self._may_log("opened"):
            log.info(
                "%s stream opened: node=%s cluster=%s peer=%s names=%s",
                s.transport,
                s.node,
                s.cluster,
                s.peer,
                names_shown(s.subscribed),
                extra=s.fields("stream_opened"),
            )

    def ack(self, s: StreamView, names: Sequence[str]) -> None:
        if log.isEnabledFor(logging.DEBUG):  # names_shown is not free, and every ACK passes here
            log.debug("ACK from node=%s for %s", s.node, names_shown(names))

    def nack(self, s: StreamView, names: Sequence[str], groups: Sequence[str], version: str, message: str) -> None:
        log.warning(
            "NACK from node=%s cluster=%s peer=%s for %s version %s: %s",
            s.node,
            s.cluster,
            s.peer,
            names_shown(names),
            version,
            message,
            extra=s.fields("nack"),
        )

    def subscribed(self, s: StreamView, added: Sequence[str], removed: Sequence[str]) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("node=%s subscribed %s, unsubscribed %s", s.node, names_shown(added), names_shown(removed))

    def access_denied(self, s: StreamView | None, names: Sequence[str], why: str) -> None:
        if s is not None:  # a fetch logs its own line: it has no stream
            log.warning(
                "PERMISSION_DENIED %s stream: node=%s cluster=%s peer=%s (%s) may not read %s",
                s.transport,
                s.node,
                s.cluster,
                s.peer,
                why,
                names_shown(names),
                extra=s.fields("denied"),
            )

    def stopped_reading(self, s: StreamView) -> None:
        if self._may_log("dropped", self._drops):
            log.warning("dropping node=%s peer=%s: not reading", s.node, s.peer)

    def closed(self, s: StreamView) -> None:
        if not s.requested:  # never sent a request: nothing was logged of it (and churn cannot flood the log)
            return
        if self._may_log("closed"):
            log.info("%s stream closed: node=%s peer=%s", s.transport, s.node, s.peer, extra=s.fields("stream_closed"))
