"""The stream log's rate limit: a burst of streams opening and closing is logged one by one up to
a budget, then counted in one line, while NACKs are always logged."""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from eds_server.observe import StreamLog
from tests.support.waiting import loop_past, wait_for


@dataclass
class View:
    id: int
    requested: bool = True
    node: str = "envoy-1"
    cluster: str = "edge"
    peer: str = "127.0.0.1:5000"
    opened_at: float = 0.0
    transport: str = "sotw"

    @property
    def subscribed(self) -> Iterable[str]:
        return ["web"]

    def fields(self, event: str) -> dict[str, str]:
        return {"event": event}


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_stream_lines_past_the_budget_are_counted_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "eds_server.grpc")
    stream_log = StreamLog(lines=3, window=3600)
    for i in range(5):
        stream_log.opened(View(i))
    stream_log.closed(View(0))
    stream_log.closed(View(1, requested=False))  # never requested: never logged, never counted
    stream_log.nack(View(2), ["web"], ["web"], "v1", "bad")
    assert len(lines(caplog, "stream opened")) == 3
    assert not lines(caplog, "stream closed")
    assert len(lines(caplog, "NACK")) == 1  # not limited
    stream_log.summarise()
    assert lines(caplog, "not logged one by one") == [
        "2 streams opened and 1 closed were not logged one by one (over 3 stream lines in 3600s); "
        "/v1/streams lists every stream"
    ]
    stream_log.summarise()  # nothing left out since: no second line
    assert len(lines(caplog, "not logged one by one")) == 1


async def test_the_count_is_logged_a_window_after_the_first_line_left_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "eds_server.grpc")
    stream_log = StreamLog(lines=1, window=0.05)
    for i in range(3):
        stream_log.opened(View(i))
    await wait_for(lambda: lines(caplog, "not logged one by one"), timeout=5, what="the count's line")
    assert lines(caplog, "not logged one by one")[0].startswith("2 streams opened and 0 closed")


async def test_a_count_logged_early_is_not_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    """As when the server stops: the count goes out at once, and the pending timer logs nothing more."""
    caplog.set_level(logging.INFO, "eds_server.grpc")
    stream_log = StreamLog(lines=1, window=0.05)
    stream_log.opened(View(1))
    stream_log.closed(View(1))  # left out: the timer is set
    stream_log.summarise()
    await loop_past(asyncio.get_running_loop().time() + 0.05)  # past the window: the timer's turn is over
    assert lines(caplog, "not logged one by one") == [
        "0 streams opened and 1 closed were not logged one by one (over 1 stream lines in 0.05s); "
        "/v1/streams lists every stream"
    ]


def test_a_steady_rate_over_the_budget_still_logs_at_the_budget(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "eds_server.grpc")
    now = [1000.0]
    monkeypatch.setattr("eds_server.ratelimit.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    stream_log = StreamLog(lines=10, window=10.0)  # one line a second once the first 10 are spent
    for i in range(10):
        stream_log.opened(View(i))
    for step in range(20):  # 10 s at 4 streams a second
        now[0] += 0.5
        stream_log.opened(View(100 + 2 * step))
        stream_log.opened(View(101 + 2 * step))
    assert len(lines(caplog, "stream opened")) == 10 + 10


def test_drops_are_logged_up_to_a_budget_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    """2,000 streams dropped for not reading at once: DROP_LINES WARNINGs, then one line with the rest."""
    from eds_server.observe import DROP_LINES

    caplog.set_level(logging.INFO, "eds_server.grpc")
    stream_log = StreamLog(lines=3, window=3600)
    for i in range(2000):
        stream_log.stopped_reading(View(i))  # type: ignore[arg-type]
    assert len(lines(caplog, ": not reading")) == DROP_LINES
    stream_log.summarise()
    assert lines(caplog, "dropped for not reading") == [
        f"{2000 - DROP_LINES} more streams dropped for not reading were not logged one by one (over {DROP_LINES} "
        "lines in 3600s); eds_clients_dropped_total counts them all"
    ]
