"""The pieces sources share (sources/base.py): debounce, backoff, warn-once, liveness and status."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from eds_server.encode import encode_group
from eds_server.sources.aggregator import Aggregator
from eds_server.sources.base import (
    Backoff,
    Comeback,
    Debounce,
    FileStamps,
    Heartbeat,
    Hung,
    Liveness,
    SharedProbe,
    SourceStatus,
    WarnOnce,
    pause,
    reconnect,
)
from eds_server.store import Store
from tests.support.waiting import wait_for


def test_debounce_publishes_once_a_delay_after_the_first_change() -> None:
    d = Debounce(0.05)
    assert d.timeout(0.0, 10.0) == 10.0 and not d.due(0.0)  # nothing pending: wait for events only
    d.changed(1.00)
    d.changed(1.03)  # a burst: the first change starts the wait
    assert d.timeout(1.03, 10.0) == pytest.approx(0.02)
    assert not d.due(1.04)
    assert d.due(1.05) and not d.due(1.06)  # once
    assert d.timeout(2.0, 10.0) == 10.0


def test_backoff_grows_jittered_to_its_cap_and_resets() -> None:
    b = Backoff(0.2, 1.0)
    delays = [b.next() for _ in range(6)]
    assert 0.1 <= delays[0] <= 0.2 and all(0.5 <= d <= 1.0 for d in delays[3:])
    b.reset()
    assert b.next() <= 0.2


def test_warn_once_per_object_until_its_warning_changes(caplog: pytest.LogCaptureFixture) -> None:
    w = WarnOnce(logging.getLogger("test.warn"))
    with caplog.at_level(logging.WARNING, "test.warn"):
        w.update({"c1": "bad label", "c2": None})
        w.update({"c1": "bad label"})
        w.update({"c1": "worse label"})
        w.forget("c1")
        w.update({"c1": "worse label"})
    assert [r.getMessage() for r in caplog.records] == ["bad label", "worse label", "worse label"]


def test_liveness_marks_the_store_stale_and_logs_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    store = Store(encode_group)
    feed = Aggregator(store)
    feed.declare(["etcd"])
    live = Liveness(feed, "etcd", "etcd somewhere")
    with caplog.at_level(logging.INFO, "eds_server.sources"):
        live.lost("refused")
        live.lost("refused again")  # not logged again
        assert live.status() == SourceStatus("etcd", False, False, "refused again")
        assert not live.status().stale  # nothing loaded: waiting, not stale
        store.update("etcd", {})
        live.live("3 registrations")
        assert live.status().as_json() == {
            "name": "etcd",
            "loaded": True,
            "live": True,
            "stale": False,
            "last_error": None,
        }
        live.lost("gone")
        stale = live.status(registrations=3).as_json()
        assert stale == {
            "name": "etcd",
            "loaded": True,
            "live": False,
            "stale": True,
            "registrations": 3,
            "last_error": "gone",
        }
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "not loaded yet" in messages[0] and "stale" in messages[2]


def test_liveness_says_what_happened_and_when_it_tries_again(caplog: pytest.LogCaptureFixture) -> None:
    store = Store(encode_group)
    feed = Aggregator(store)
    feed.declare(["kubernetes"])
    feed.publish("kubernetes", {})
    live = Liveness(feed, "kubernetes", "the API server")
    live.live()
    with caplog.at_level(logging.WARNING, "eds_server.sources"):
        live.lost("Services: the API server closed the watch mid-stream: it went away", retry_in=0.25)
    assert [r.getMessage() for r in caplog.records] == [
        "kubernetes: Services: the API server closed the watch mid-stream: it went away; serving the last known "
        "endpoints (stale); reconnecting in 0.2 s"
    ]


def test_comeback_cuts_a_backoff_only_after_the_server_was_seen_away() -> None:
    c = Comeback()
    assert not c.probed(True)  # answering all along (it refuses us, or is slow): the full backoff
    assert not c.probed(False)  # away...
    assert c.probed(True)  # ...and back: try now
    assert not c.probed(True)  # used once: a failing next attempt backs off again
    c.away()  # a refused connection is a sighting too
    assert c.probed(True)
    c.away()
    c.reset()  # a watch opened meanwhile
    assert not c.probed(True)


async def test_shared_probe_asks_once_for_every_waiter_within_its_freshness() -> None:
    now = [100.0]
    answers = [False, True]
    asked: list[float] = []

    async def probe() -> bool:
        asked.append(now[0])
        await asyncio.sleep(0)
        return answers[len(asked) - 1]

    shared = SharedProbe(probe, fresh=0.5, clock=lambda: now[0])
    assert await asyncio.gather(shared(), shared(), shared()) == [False, False, False]  # one in flight, shared
    now[0] += 0.4
    assert await shared() is False and asked == [100.0]  # still fresh
    now[0] += 0.2
    assert await asyncio.gather(shared(), shared()) == [True, True]
    assert asked == [100.0, pytest.approx(100.6)] and shared.probes == 2

    async def broken() -> bool:
        raise OSError("no route")

    assert await SharedProbe(broken, clock=lambda: now[0])() is False  # a failing probe is "not there"


async def test_pause_waits_out_its_delay_unless_the_check_or_stop_ends_it() -> None:
    stop = asyncio.Event()
    checks = 0

    async def on_third() -> bool:
        nonlocal checks
        checks += 1
        return checks == 3

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await pause(5.0, stop, on_third, every=0.01) is True
    assert checks == 3 and loop.time() - t0 < 1.0
    t0 = loop.time()
    assert await pause(0.05, stop, None, every=0.01) is False and loop.time() - t0 >= 0.04
    loop.call_later(0.02, stop.set)
    assert await pause(5.0, stop, on_third, every=1.0) is False and stop.is_set()


def test_file_stamps_see_a_rewrite_a_replacement_and_a_removal(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("token: a")
    stamps = FileStamps([str(path)])
    assert not stamps.changed()
    path.write_text("token: b")  # same size, rewritten in place
    os.utime(path, ns=(1, 1))  # as if within the same mtime tick: the ctime still moves
    assert stamps.changed()
    stamps.take()
    assert not stamps.changed()
    new = tmp_path / "kubeconfig.new"
    new.write_text("token: c")
    new.replace(path)  # the atomic way (kubectl, Secret volumes)
    assert stamps.changed()
    stamps.take()
    path.unlink()
    assert stamps.changed()
    stamps.take()
    path.write_text("token: d")
    assert stamps.changed()


async def test_heartbeat_ends_a_guarded_wait_when_the_peer_stops_answering() -> None:
    """A frozen peer (a probe that never answers) ends the guarded block with Hung within every +
    timeout; a quiet peer that answers its probes is left alone; an error is an answer."""
    frozen = asyncio.Event()
    answers: list[str] = []

    async def probe() -> None:
        if frozen.is_set():
            await asyncio.Event().wait()  # never answers
        answers.append("ok")
        if len(answers) == 2:
            raise OSError("refused by policy")  # still an answer: it is there

    beat = Heartbeat(probe, "the peer at 127.0.0.1:1", every=0.05, timeout=0.1)
    forever = asyncio.Event()
    task = asyncio.create_task(asyncio.wait_for(_guarded_wait(beat, forever), 10))
    # the quiet peer is probed, answers, and nothing ends
    await wait_for(lambda: len(answers), lambda n: n >= 3, timeout=4, what="three answered probes")
    assert not task.done() and beat.hangs == 0
    frozen.set()
    with pytest.raises(Hung, match=r"the peer at 127.0.0.1:1 did not answer within 0.1 s"):
        await task
    assert beat.hangs == 1


async def test_heartbeat_takes_one_slow_answer_for_a_busy_peer_not_a_hung_one() -> None:
    calls = 0

    async def probe() -> None:
        nonlocal calls
        calls += 1
        if calls % 3 == 1:  # every third probe goes unanswered; the next one is answered
            await asyncio.Event().wait()

    beat = Heartbeat(probe, "peer", every=0.02, timeout=0.05)
    async with beat.watching():
        await wait_for(lambda: calls, lambda n: n >= 7, timeout=4, what="seven probes")
    assert beat.hangs == 0


async def _guarded_wait(beat: Heartbeat, forever: asyncio.Event) -> None:
    async with beat.watching():
        await forever.wait()


async def test_heartbeat_does_not_probe_a_peer_heard_from_and_lets_other_timeouts_through() -> None:
    probes = 0

    async def probe() -> None:
        nonlocal probes
        probes += 1

    beat = Heartbeat(probe, "peer", every=0.2, timeout=0.1)
    async with beat.watching():
        for _ in range(10):  # events every 50 ms: the peer is alive, no probe needed
            beat.beat()
            await asyncio.sleep(0.05)  # the pace of the events (nothing is waited for)
        assert probes == 0
        with pytest.raises(TimeoutError) as caught:  # a request's own timeout is not a hang
            async with asyncio.timeout(0.01):
                await asyncio.Event().wait()
        assert not isinstance(caught.value, Hung)


async def test_heartbeat_tells_of_proper_replies_only() -> None:
    """`replied` is for a source that learns nothing else when its peer is back with nothing new to
    say: a proper reply calls it, an error (an answer, but not a good one) does not."""
    replies: list[str] = []
    failing = False

    async def probe() -> None:
        if failing:
            raise ConnectionResetError("reset")

    beat = Heartbeat(probe, "peer", every=0.02, timeout=0.5, replied=lambda: replies.append("ok"))
    async with beat.watching():
        await wait_for(lambda: replies, timeout=2, what="a proper reply")
        failing = True
        # probes run one at a time: once one has started since, the last good one has replied
        started = beat.probes
        await wait_for(lambda: beat.probes, lambda n: n > started, timeout=2, what="a failing probe")
        before, probes = len(replies), beat.probes
        await wait_for(lambda: beat.probes, lambda n: n >= probes + 3, timeout=2, what="three more failing probes")
        assert len(replies) == before and beat.hangs == 0  # errors: no reply, and no hang either


async def test_heartbeat_does_not_blame_the_peer_for_our_own_busy_loop() -> None:
    """A probe whose deadline passed while this process's loop was blocked (a long computation) is
    asked again rather than taken as a hang; a peer that then answers is not hung."""
    calls = 0

    async def probe() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0)
            time.sleep(0.4)  # the loop blocked past the probe's 0.1 s deadline (and the answer with it)
            await asyncio.Event().wait()

    beat = Heartbeat(probe, "peer", every=0.05, timeout=0.1)
    async with beat.watching():
        # asked again, answered, and probed on past that answer's deadline: not taken as a hang
        await wait_for(lambda: calls, lambda n: n >= 3, timeout=2, what="probes after the blocked one")
    assert beat.hangs == 0


async def test_one_reconnect_loop_says_why_each_connection_ended_and_waits_a_growing_backoff() -> None:
    stop = asyncio.Event()
    attempts: list[int] = []
    lost: list[tuple[str, float]] = []
    backoff = Backoff(0.001, 0.004)

    async def connect() -> str:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise ConnectionRefusedError("refused")
        if len(attempts) == 3:
            backoff.reset()  # it followed again
        if len(attempts) == 4:
            stop.set()
        return "ended"

    await asyncio.wait_for(
        reconnect(
            stop,
            connect,
            backoff=backoff,
            why=lambda e: f"{type(e).__name__}: {e}",
            lost=lambda reason, delay: lost.append((reason, delay)),
        ),
        10,
    )
    assert len(attempts) == 4  # the fourth ended while stopping: not reported, no wait
    assert [r for r, _ in lost] == ["ConnectionRefusedError: refused", "ended", "ended"]
    assert 0.0005 <= lost[0][1] <= 0.001 and 0.001 <= lost[1][1] <= 0.002 and lost[2][1] <= 0.001  # reset


async def test_a_reconnect_loop_stops_during_its_wait() -> None:
    stop = asyncio.Event()
    lost: list[str] = []

    async def connect() -> str:
        return "ended"

    task = asyncio.create_task(
        reconnect(
            stop,
            connect,
            backoff=Backoff(3600, 3600),
            why=str,
            lost=lambda reason, _: (lost.append(reason), stop.set()),
        )
    )
    await asyncio.wait_for(task, 10)  # not an hour: stop ends the wait
    assert lost == ["ended"]


def test_backoff_jitter_share() -> None:
    full = Backoff(0.1, 0.1, jitter=1.0)
    none = Backoff(0.1, 0.1, jitter=0.0)
    assert all(0 <= full.next() <= 0.1 for _ in range(50)) and none.next() == 0.1
